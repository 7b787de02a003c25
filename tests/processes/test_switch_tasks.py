"""The nodes' switches on real tasks of the local emulator: the rendered script exports them, every
task orders the nodes by them (shard groups under one switch, in layout.json), ``--topology strict``
ends the job in its batch shell before any task starts, a stale value of the submitting shell never
reaches the tasks, and the emulator's srun places a step on ``--nodelist`` (a replica group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import hpc as cli_hpc

from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

TINY = tiny_job(width=16, heads=2, batch_size=1, vocab_size=32)
INTERLEAVED = "spine.a:n[1,3];spine.b:n[2,4]"
"""Nodes n1, n3 under leaf a, n2, n4 under leaf b: the node list alternates the leaves."""


def hpc(*args: str, env: dict | None = None, timeout: float = 200) -> subprocess.CompletedProcess:
    return cli_hpc(*args, env={"OMP_NUM_THREADS": "1", **(env or {})}, timeout=timeout)


def _batch_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs").glob("*_0_log.*")))


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_tasks_order_the_nodes_by_the_given_switches(tmp_path, local_submit, launcher):
    run = tmp_path / "run"
    argv = local_submit(run, "--steps", "2", "--wait", *TINY, nodes=4, gpus_per_node=1, shard=2)
    argv += ["--launcher", launcher, "--straggler-every", "0", "--tracker", "none"]
    out = hpc(*argv, "--env", f"HPC_HSDP_NODE_SWITCHES={INTERLEAVED}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert f"hpc-hsdp: node switches: {INTERLEAVED}" in _batch_log(run)
    layout = json.loads((run / "layout.json").read_text())
    plan = layout["plan"]
    assert plan["node_names"] == ["n1", "n3", "n2", "n4"]  # by switch, the first node first
    assert plan["node_switches"] == ["a", "a", "b", "b"] and plan["shard_groups_cross_switches"] is False
    assert plan["shard_groups"] == [[0, 1], [2, 3]] and plan["replicate_groups"] == [[0, 2], [1, 3]]
    ranks = {r["rank"]: r for r in layout["ranks"]}
    # the realized groups (checked against the plan on every rank) sit under one switch each
    assert [(ranks[r]["node"], ranks[r]["node_switch"]) for r in range(4)] == [
        ("n1", "a"),
        ("n3", "a"),
        ("n2", "b"),
        ("n4", "b"),
    ]
    assert ranks[1]["shard_group"] == [0, 1] and ranks[1]["replicate_group"] == [1, 3]
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_replica_groups_take_the_nodes_under_one_switch(tmp_path, local_submit):
    """--fault-tolerance replica: groups of two nodes, n1+n3 and n2+n4 (each under one leaf), each
    its own step on srun --nodelist; the job trains to the end with both."""
    run = tmp_path / "run"
    argv = local_submit(run, "--steps", "3", "--wait", *TINY, nodes=4, gpus_per_node=1, shard=2)
    argv += [
        "--fault-tolerance",
        "replica",
        "--min-replicas",
        "2",
        "--quorum-timeout",
        "30",
        "--global-batch-size",
        "4",
    ]
    out = hpc(*argv, "--straggler-every", "0", "--tracker", "none", "--env", f"HPC_HSDP_NODE_SWITCHES={INTERLEAVED}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:] + _batch_log(run)[-3000:]
    started = [
        json.loads(line) for line in (run / "replicas.jsonl").read_text().splitlines() if "group started" in line
    ]
    assert sorted((e["replica_id"], e["nodes"]) for e in started) == [(0, ["n1", "n3"]), (1, ["n2", "n4"])]
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m.get("replicas")) for m in steps] == [(1, 2), (2, 2), (3, 2)]


def test_strict_refuses_crossing_shard_groups_before_any_task(tmp_path, local_submit):
    run = tmp_path / "run"
    crossing = "spine.a:n[1-3];spine.b:n4"  # 3 + 1 nodes: one pair must cross
    argv = local_submit(run, "--steps", "2", "--wait", *TINY, nodes=4, gpus_per_node=1, shard=2)
    out = hpc(*argv, "--topology", "strict", "--env", f"HPC_HSDP_NODE_SWITCHES={crossing}")
    assert out.returncode != 0 and "FAILED" in out.stderr, out.stderr[-2000:]
    log = _batch_log(run)
    refusals = [line for line in log.splitlines() if "--topology strict" in line]
    assert len(refusals) == 1 and "must cross leaf switches" in refusals[0], log
    assert "ranks 2-3 on n3,n4 under a,b" in refusals[0]
    assert not (run / "layout.json").exists() and not (run / "metrics.jsonl").exists()
    assert not list((run / "logs").glob("*_1_log.*")), "a task started"


def test_a_stale_value_of_the_submitting_shell_never_reaches_the_tasks(tmp_path, local_submit):
    """The submitting shell says every node is under one leaf; the job's own answer (the
    emulator has no switches) wins: strict cannot tell, and refuses, naming the unknown nodes."""
    run = tmp_path / "run"
    argv = local_submit(run, "--steps", "2", "--wait", *TINY, nodes=2, gpus_per_node=1, shard=2)
    out = hpc(*argv, "--topology", "strict", env={"HPC_HSDP_NODE_SWITCHES": "spine.a:n[1-2]"})
    assert out.returncode != 0
    log = _batch_log(run)
    assert "--topology strict: the shard groups span 2 nodes but SLURM gave no leaf switch for n1, n2" in log, log


def test_the_emulators_srun_places_a_step_on_a_nodelist(tmp_path):
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SLURM")},
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "n[1-4]",
        "SLURM_TASKS_PER_NODE": "2(x4)",
        "SLURM_JOB_NAME": "nodelist",
    }
    command = ["sh", "-c", 'echo "$SLURMD_NODENAME $SLURM_PROCID $SLURM_STEP_NODELIST $SLURM_NTASKS"']
    srun = [sys.executable, "-m", "hpc_hsdp.scheduler.emulator", "srun"]
    out = subprocess.run(
        [*srun, "--nodes=2", "--ntasks=4", "--ntasks-per-node=2", "--nodelist=n[4,2]", *command],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["n2 0 n[2,4] 4", "n2 1 n[2,4] 4", "n4 2 n[2,4] 4", "n4 3 n[2,4] 4"]
    wrong = subprocess.run([*srun, "--nodes=2", "--nodelist=n[2,9]", *command], capture_output=True, text=True, env=env)
    assert wrong.returncode == 2 and "the job's nodes are n[1-4]" in wrong.stderr
