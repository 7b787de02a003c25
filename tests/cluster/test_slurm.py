"""Against the real dev SLURM cluster (scripts/dev-cluster): submit, groups, launchers, handles.

Every job here is a real sbatch submission: slurmctld allocates n1/n2, slurmd starts the
tasks with SLURM's own variables, and the realized DeviceMesh groups are checked by
the job itself and recorded in layout.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import hpc

from tests.slurm_job_helpers import TINY, _logs, _ranks, sbatch_wait

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

THREAD_SHARD = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
THREAD_REPLICATE = [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def assert_thread_groups_node_local(run_dir: Path) -> list[dict]:
    layout, ranks = _ranks(run_dir)
    assert layout["plan"]["shard_groups"] == THREAD_SHARD
    assert layout["plan"]["replicate_groups"] == THREAD_REPLICATE
    node_of = {r["rank"]: r["node"] for r in ranks}
    assert sorted(set(node_of.values())) == ["n1", "n2"]
    for r in ranks:
        assert r["shard_group"] == THREAD_SHARD[r["rank"] // 4]
        assert r["replicate_group"] == THREAD_REPLICATE[r["rank"] % 4]
        assert len({node_of[m] for m in r["shard_group"]}) == 1, f"shard group of rank {r['rank']} crosses nodes"
    return ranks


def test_submit_public_thread_case(slurm_cluster, tmp_path):
    run = tmp_path / "thread"
    out = hpc(
        "submit",
        "--cluster",
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "8",
        "--shard",
        "4",
        "--wait",
        "--run-dir",
        str(run),
        *TINY,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "submitted job" in out.stdout and "COMPLETED" in out.stderr
    ranks = assert_thread_groups_node_local(run)
    assert all(r["slurm_procid"] == r["rank"] for r in ranks)  # block distribution
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]


def test_cyclic_distribution_still_node_local(slurm_cluster, tmp_path):
    """2 nodes x 4, shard 4 (8 processes rather than the thread case's 16: the same question)."""
    run = tmp_path / "cyclic"
    out = hpc(
        "submit",
        "--cluster",
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--shard",
        "4",
        "--distribution",
        "cyclic",
        "--wait",
        "--run-dir",
        str(run),
        *TINY,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    layout, ranks = _ranks(run)
    assert layout["plan"]["shard_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout["plan"]["replicate_groups"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [r["node"] for r in ranks] == ["n1"] * 4 + ["n2"] * 4  # node-major, whatever the PROCIDs
    assert [r["slurm_procid"] for r in ranks] == [0, 2, 4, 6, 1, 3, 5, 7]  # SLURM dealt tasks round-robin over n1, n2


def test_torchrun_launcher_gives_the_same_groups(slurm_cluster, tmp_path):
    run = tmp_path / "torchrun"
    out = hpc(
        "submit",
        "--cluster",
        "slurm",
        "--nodes",
        "2",
        "--shard",
        "4",
        "--launcher",
        "torchrun",
        "--wait",
        "--run-dir",
        str(run),
        *TINY,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert_thread_groups_node_local(run)
    layout, _ = _ranks(run)
    assert layout["launch_mode"] == "torchrun"


def test_rendered_script_runs_with_plain_sbatch(slurm_cluster, tmp_path):
    """2 nodes x 2 (4 processes, not the thread case's 16, which test_submit_public_thread_case runs;
    the rendered script and submit's differ only in the task command: the test below)."""
    run = tmp_path / "plain"
    script = tmp_path / "train.sbatch"
    out = hpc(
        "render",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--run-dir",
        str(run),
        "-o",
        str(script),
        *TINY,
    )
    assert out.returncode == 0, out.stderr
    done = sbatch_wait([str(script)])
    assert done.returncode == 0, done.stdout + done.stderr + _logs(run)
    layout, ranks = _ranks(run)
    assert layout["plan"]["shard_groups"] == [[0, 1], [2, 3]] and layout["plan"]["replicate_groups"] == [[0, 2], [1, 3]]
    assert [r["node"] for r in ranks] == ["n1", "n1", "n2", "n2"] and [r["slurm_procid"] for r in ranks] == [0, 1, 2, 3]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_submit_and_render_differ_only_in_the_task_command(slurm_cluster, tmp_path):
    args = ["--nodes", "2", "--shard", "4", "--run-dir", str(tmp_path / "same"), *TINY]
    rendered = hpc("render", *args).stdout.splitlines()
    submitted = hpc("submit", "--dry-run", *args).stdout.splitlines()
    assert len(rendered) == len(submitted)
    differing = [(a, b) for a, b in zip(rendered, submitted) if a != b]
    assert len(differing) == 1, differing
    before, after = differing[0]
    assert before.strip().startswith("python -m hpc_hsdp run --shard 4")
    assert "-m hpc_hsdp.task.submitit_job" in after and after.strip().endswith("|| status=$?")
    # the line before is the same srun invocation in both
    index = rendered.index(before)
    srun_start = max(i for i in range(index) if rendered[i].startswith("srun"))
    assert rendered[srun_start:index] == submitted[srun_start:index]
    assert "--kill-on-bad-exit=1" in "".join(rendered[srun_start:index])


def test_uneven_allocation(slurm_cluster, tmp_path):
    run = tmp_path / "uneven"
    out = hpc(
        "submit",
        "--cluster",
        "slurm",
        "--nodes",
        "2",
        "--ntasks",
        "12",
        "--shard",
        "4",
        "--wait",
        "--run-dir",
        str(run),
        *TINY,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    layout, ranks = _ranks(run)
    assert layout["plan"]["tasks_per_node"] == [8, 4]
    assert layout["plan"]["num_replicas"] == 3
    node_of = {r["rank"]: r["node"] for r in ranks}
    for r in ranks:
        assert len({node_of[m] for m in r["shard_group"]}) == 1


def test_shard_not_fitting_uneven_allocation_fails_fast_on_the_task(slurm_cluster, tmp_path):
    """8,4 tasks with shard 8: the tasks themselves refuse, and the job ends at once."""
    run = tmp_path / "refused"
    run.mkdir()
    command = f"srun --kill-on-bad-exit=1 {sys.executable} -m hpc_hsdp run --shard 8 --run-dir {run} --device cpu"
    start = time.monotonic()
    done = sbatch_wait(
        ["--nodes", "2", "--ntasks", "12", "--output", str(run / "out.txt"), "--wrap", command], timeout_s=120
    )
    elapsed = time.monotonic() - start
    assert done.returncode != 0
    text = (run / "out.txt").read_text()
    assert "shard size 8 is larger than the smallest node (4 tasks)" in text
    assert "Traceback" not in text
    assert elapsed < 60


def test_python_api_status_logs_cancel(slurm_cluster, tmp_path):
    code = f"""
import hpc_hsdp, json
def fn(ctx):
    return (ctx.rank, ctx.layout.node, list(ctx.layout.shard_group))
job = hpc_hsdp.submit(fn, cluster="slurm", nodes=2, gpus_per_node=2, shard=2, run_dir={str(tmp_path / "api")!r},
                      device="cpu")
print(json.dumps(sorted(job.results())))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results == [[0, "n1", [0, 1]], [1, "n1", [0, 1]], [2, "n2", [2, 3]], [3, "n2", [2, 3]]]

    # a long job: follow it with status and logs, then cancel it
    run = tmp_path / "long"
    sub = hpc(
        "submit",
        "--cluster",
        "slurm",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--run-dir",
        str(run),
        "--device",
        "cpu",
        "--steps",
        "100000",
    )
    assert sub.returncode == 0, sub.stderr
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(1)
    status = json.loads(hpc("status", str(run), "--json").stdout)
    assert status["state"] == "RUNNING" and status["cluster"] == "slurm"
    logs = hpc("logs", str(run), "--rank", "3")
    assert logs.returncode == 0 and "rank 3" in logs.stdout + logs.stderr
    assert hpc("cancel", str(run)).returncode == 0
    deadline = time.monotonic() + 60
    while json.loads(hpc("status", str(run), "--json").stdout)["state"] not in ("CANCELLED", "FAILED"):
        assert time.monotonic() < deadline, "job did not end after cancel"
        time.sleep(1)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "2", "--shard", "3"], "does not divide the 8 tasks"),
        (["--nodes", "2", "--shard", "4", "--partition", "nosuch"], "--partition 'nosuch' does not exist"),
        (["--nodes", "2", "--shard", "4", "--entry", "no_such_module_xyz:main"], "no_such_module_xyz"),
    ],
)
def test_bad_submit_is_refused_before_submitting(slurm_cluster, tmp_path, args, message):
    before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    out = hpc("submit", "--cluster", "slurm", "--run-dir", str(tmp_path / "bad"), *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == before
    assert not (tmp_path / "bad" / "job.json").exists()
