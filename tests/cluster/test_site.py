"""The dev cluster shaped like a real site (issue 15): what a first job on real GPU nodes meets.

Partition ``site`` of ``scripts/dev-cluster``: nodes of 32 CPUs and 8 GPUs (more cores
than GPUs, two sockets) whose SLURM names (site1, site2) resolve nowhere and whose host
name resolves to loopback. The same controller serves the default partition, so the
suite still starts one cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import hpc

from tests.job_helpers import tiny_job
from tests.slurm_job_helpers import TINY, _logs, _ranks, sbatch_wait

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

REPORT_ENV = """
import hpc_hsdp, json, os
def fn(ctx):
    return dict(rank=ctx.rank, node=ctx.layout.node, cpus=os.environ.get("SLURM_CPUS_PER_TASK"),
                omp=os.environ.get("OMP_NUM_THREADS"), master=os.environ.get("MASTER_ADDR"))
job = hpc_hsdp.submit(fn, cluster="slurm", partition="site", device="cpu", run_dir={run!r}, **{options!r})
print(json.dumps(sorted(job.results(), key=lambda r: r["rank"])))
"""


def _site_partition(slurm_cluster) -> None:
    shown = subprocess.run(["scontrol", "show", "partition", "site"], capture_output=True, text=True)
    if shown.returncode != 0:
        pytest.skip("the dev cluster has no 'site' partition (started with --site-nodes 0)")


def _submit_reporting(run: Path, **options) -> list[dict]:
    code = REPORT_ENV.format(run=str(run), options=options)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "MASTER_ADDR": "login7.stale.invalid", "MASTER_PORT": "29500"},
    )
    assert out.returncode == 0, out.stdout + out.stderr + _logs(run)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_site_nodes_uneven_tasks_cpus_and_rendezvous(slurm_cluster, tmp_path):
    """--ntasks 12 on two 32-CPU nodes of 8 GPUs: SLURM alone would run 11,1 (or 6,6); the job
    must run the planned 8,4, give every rank its share of the node's CPUs (32 / 8), and meet at
    the first node's reachable address: not its SLURM name (site1 resolves nowhere) and not
    the stale MASTER_ADDR/MASTER_PORT of the submitting shell."""
    _site_partition(slurm_cluster)
    run = tmp_path / "site"
    results = _submit_reporting(run, nodes=2, gpus_per_node=8, ntasks=12, shard=4)
    layout, ranks = _ranks(run)
    assert layout["plan"]["tasks_per_node"] == [8, 4]
    assert [r["node"] for r in ranks] == ["site1"] * 8 + ["site2"] * 4
    assert {(r["cpus"], r["omp"]) for r in results} == {("4", "1")}
    masters = {r["master"] for r in results}
    assert len(masters) == 1 and masters != {"site1"} and masters != {"login7.stale.invalid"}
    assert layout["master_addr"] == masters.pop() and layout["master_port"] != 29500


def test_torchrun_gets_all_of_the_nodes_cpus(slurm_cluster, tmp_path):
    """One torchrun task per node: its agent and workers share all 32 CPUs of the exclusive
    node (not one CPU for the whole node). Two GPUs per node, not the site's 8: the CPUs a
    task gets do not depend on the workers it starts, and 16 workers on this machine's two
    cores cost the suite a minute."""
    _site_partition(slurm_cluster)
    run = tmp_path / "torchrun"
    script = tmp_path / "train.sbatch"
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json, os, sys\n"
        "print('PROBE', json.dumps({k: os.environ.get(k) for k in "
        "('SLURM_CPUS_PER_TASK', 'OMP_NUM_THREADS', 'SLURM_CPUS_ON_NODE')}))\n"
    )
    out = hpc(
        "render",
        "--partition",
        "site",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--launcher",
        "torchrun",
        "--run-dir",
        str(run),
        "-o",
        str(script),
        *TINY,
    )
    assert out.returncode == 0, out.stderr
    text = script.read_text().replace("    bash -c ", f'    bash -c \'python {probe}; exec "$0" "$@"\' bash -c ', 1)
    script.write_text(text)
    done = sbatch_wait([str(script)])
    assert done.returncode == 0, done.stdout + done.stderr + _logs(run)
    probes = [
        json.loads(line.split("PROBE ", 1)[1])
        for p in (run / "logs").glob("*_log.out")
        for line in p.read_text().splitlines()
        if line.startswith("PROBE ")
    ]
    assert len(probes) == 2
    assert all(p == {"SLURM_CPUS_PER_TASK": "32", "OMP_NUM_THREADS": "1", "SLURM_CPUS_ON_NODE": "32"} for p in probes)
    assert _ranks(run)[0]["launch_mode"] == "torchrun"


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _job_state(job_id: str) -> str:
    shown = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout.strip()
    return shown or "GONE"


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_scancel_quit_prints_stacks_and_the_job_goes_on(slurm_cluster, tmp_path, launcher):
    """docs/fault-tolerance.md: `scancel --signal=QUIT JOB` makes every rank print its stacks and the job keeps
    running. torchrun's agent used to take QUIT as "shut down the workers"."""
    run = tmp_path / launcher
    script = tmp_path / "train.sbatch"
    out = hpc(
        *("render", "--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--launcher", launcher),
        *("--run-dir", str(run), "-o", str(script)),
        *tiny_job(vocab_size=None, device="cpu", steps=100000),
    )
    assert out.returncode == 0, out.stderr
    (run / "logs").mkdir(parents=True, exist_ok=True)
    submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        _wait_for(lambda: (run / "metrics.jsonl").exists(), 120, "the first step")
        subprocess.run(["scancel", "--signal=QUIT", job_id], check=True, timeout=30)

        def stacks() -> int:
            return sum(p.read_text(errors="replace").count("Current thread") for p in (run / "logs").glob("*_log.err"))

        _wait_for(lambda: stacks() >= 4, 60, "stacks of all 4 ranks")
        time.sleep(8)  # a torchrun agent that takes QUIT as a death signal ends its workers within ~1 s
        errors = "".join(p.read_text(errors="replace") for p in (run / "logs").glob("*_log.err"))
        assert "death signal" not in errors and "Terminating" not in errors, errors[-3000:]
        steps_then = len((run / "metrics.jsonl").read_text().splitlines())
        _wait_for(
            lambda: len((run / "metrics.jsonl").read_text().splitlines()) > steps_then + 2,
            60,
            "steps after the stack dump",
        )
        assert _job_state(job_id) == "RUNNING", _logs(run)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
        _wait_for(lambda: _job_state(job_id) == "GONE", 60, "the job to end")
