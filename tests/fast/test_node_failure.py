"""A node that dies mid-job (issue 13).

Here: finding dead nodes by their slurmd (a real listening socket against a closed port;
``scontrol show node`` answered by a stand-in that prints what 22.05 prints), and the requeue
that avoids them (requeuehold, ExcNodeList, release), recorded with its cause.
The real dev cluster's half: tests/cluster/test_node_failure.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import hpc
from dist_helpers import wait_until

from hpc_hsdp.plan.topology import plan_for
from hpc_hsdp.rundir.lifecycle import attempts

ROOT = Path(__file__).resolve().parents[2]


def test_a_dead_slurmd_is_found_in_seconds(fake_scontrol):
    from hpc_hsdp.task.resilience.node_failure import unreachable_nodes

    started = time.monotonic()
    assert unreachable_nodes(["n1", "n2", "n9"]) == ["n2"]  # n9: unknown to scontrol, not called dead
    assert time.monotonic() - started < 5


def _ctx(rank: int, run_dir: Path):
    plan = plan_for(nodes=2, gpus_per_node=2, shard_size=2, node_names=("n1", "n2"))
    layout = SimpleNamespace(node=plan.node_names[plan.node_of_rank[rank]])
    return SimpleNamespace(plan=plan, layout=layout, rank=rank, world_size=4, run_dir=run_dir, preemption=None)


def test_the_lowest_live_rank_requeues_without_the_dead_node_and_records_why(fake_scontrol, tmp_path):
    from hpc_hsdp.task.resilience.node_failure import handle_lost_peers

    env = {"SLURM_JOB_ID": "41", "SLURM_CLUSTER_NAME": "dev", "SLURM_RESTART_COUNT": "0"}
    attempts.begin_attempt(tmp_path, restart=0, job_id="41", start_step=0, total_steps=9)
    assert handle_lost_peers(_ctx(1, tmp_path), max_restarts=2, env=env, reason="r") is None  # rank 0 does it
    assert not fake_scontrol.exists()
    line = handle_lost_peers(_ctx(0, tmp_path), max_restarts=2, env=env, reason="the step failed: RuntimeError: gloo")
    assert line == (
        "node n2 died (slurmd unreachable) with ranks 2-3; the step failed: RuntimeError: gloo; requeued "
        "job 41 without n2 (failure restart 1 of at most 2)"
    )
    assert fake_scontrol.read_text().splitlines() == ["requeuehold 41", "update JobId=41 ExcNodeList=n2", "release 41"]
    ended = attempts.read_attempt(tmp_path)["ended"]
    assert ended["reason"] == "node_failure" and ended["detail"].startswith("node n2 died")

    # the next attempt's restart line carries the cause; --max-restarts 1 is then spent
    [restart] = [attempts.begin_attempt(tmp_path, restart=1, job_id="41", start_step=4, total_steps=9)]
    assert (restart["reason"], restart["resumed_from_step"]) == ("node_failure", 4)
    env["SLURM_RESTART_COUNT"] = "1"
    line = handle_lost_peers(_ctx(0, tmp_path), max_restarts=1, env=env, reason="r")
    assert line.endswith("not requeued: the job already restarted 1 times after failures (--max-restarts 1)")
    assert len(fake_scontrol.read_text().splitlines()) == 3
    # outside SLURM nothing is asked
    assert handle_lost_peers(_ctx(0, tmp_path), max_restarts=5, env={"SLURM_JOB_ID": "41"}, reason="r") is None


def test_a_requeueable_job_is_left_to_slurm_and_requeued_by_us_only_when_slurm_does_not(fake_scontrol, tmp_path):
    from hpc_hsdp.task.resilience.node_failure import handle_lost_peers

    (tmp_path / "requeue").write_text("1")  # scontrol show job says Requeue=1; SlurmdTimeout = 1 s
    env = {"SLURM_JOB_ID": "41", "SLURM_CLUSTER_NAME": "dev", "SLURM_RESTART_COUNT": "0"}
    attempts.begin_attempt(tmp_path, restart=0, job_id="41", start_step=0, total_steps=9)
    ctx = _ctx(0, tmp_path)
    ctx.preemption = SimpleNamespace(received={"TERM": time.time()})  # SLURM ended the task: its requeue
    line = handle_lost_peers(ctx, max_restarts=2, env=env, reason="the step failed", grace_s=30)
    assert line.endswith("SLURM is requeueing job 41 (failure restart 1 of at most 2)"), line
    assert not fake_scontrol.exists()  # nothing asked of SLURM
    assert attempts.read_attempt(tmp_path)["ended"]["reason"] == "node_failure"

    ctx.preemption = SimpleNamespace(received={})  # SLURM never ends it: after SlurmdTimeout + grace, ours
    started = time.monotonic()
    line = handle_lost_peers(ctx, max_restarts=2, env=env, reason="the step failed", grace_s=0.5)
    assert time.monotonic() - started >= 1.5
    assert "requeued job 41 without n2" in line, line
    assert fake_scontrol.read_text().splitlines() == ["requeuehold 41", "update JobId=41 ExcNodeList=n2", "release 41"]


def test_status_shows_each_restart_with_its_cause(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "5_local.json").write_text(json.dumps({"state": "COMPLETED", "exit_code": 0}))
    (tmp_path / "job.json").write_text(
        json.dumps(
            {
                "job_id": "5",
                "cluster": "local",
                "run_dir": str(tmp_path),
                "logs_dir": str(logs),
                "job_name": "x",
                "ntasks": 4,
                "launcher": "srun",
                "submitted_at": 0.0,
            }
        )
    )
    attempts.begin_attempt(tmp_path, restart=0, job_id="5", start_step=0, total_steps=9)
    attempts.end_attempt(tmp_path, reason="node_failure", step=None, detail="node n2 died")
    attempts.begin_attempt(tmp_path, restart=1, job_id="5", start_step=4, total_steps=9)
    out = hpc("status", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "restarts: step 4: node failure" in out.stdout, out.stdout


# ----------------------------------------------------------------------------- the real dev cluster


def test_the_requeue_of_a_flexible_job_restores_its_node_range(fake_scontrol):
    from hpc_hsdp.scheduler.backends.slurm_task import REQUEST_FIELDS_VARIABLE, requeue_job

    env = {REQUEST_FIELDS_VARIABLE: "NumNodes=1-2 NumTasks=2", "PATH": os.environ["PATH"]}
    assert requeue_job("41", env=env) == (True, "")
    assert requeue_job("42", env=env, exclude=("n2",)) == (True, "")
    assert fake_scontrol.read_text().splitlines() == [
        "requeuehold 41",
        "update JobId=41 NumNodes=1-2 NumTasks=2",
        "release 41",
        "requeuehold 42",
        "update JobId=42 NumNodes=1-2 NumTasks=2 ExcNodeList=n2",
        "release 42",
    ]


KEEPER_TASK = r"""
import ctypes, os, sys, time
from hpc_hsdp.task.resilience.preemption import NodeRangeKeeper, Preemption
preemption = Preemption(os.environ).install()
keeper = NodeRangeKeeper(os.environ).install()
print("ready", flush=True)
libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)  # a default pthread mutex, unlocked
libc.pthread_mutex_lock(mutex)
libc.pthread_mutex_lock(mutex)  # stuck in C for good, signals or not (as in a collective with a dead peer)
"""


@pytest.mark.parametrize(
    "restarts, local_id, expected",
    [
        ("1", "0", ["update JobId=41 NumNodes=1-2 NumTasks=2"]),  # SLURM requeued it (Restarts went up)
        ("0", "0", None),  # a SIGTERM without a requeue (scancel, time limit): left alone
        ("1", "1", None),  # one task per node asks: local rank 0
    ],
)
def test_a_flexible_jobs_range_is_restored_on_slurms_sigterm_while_the_main_thread_is_stuck(
    fake_scontrol, tmp_path, restarts, local_id, expected
):
    """SLURM pins a job it requeues itself (node failure) to the nodes it had; a ``--nodes 1-2``
    job would wait for two. On SLURM's SIGTERM a thread of local rank 0 updates the pending job,
    before SLURM's SIGKILL (KillWait), even while the main thread never returns to Python."""
    from hpc_hsdp.scheduler.backends.slurm_task import REQUEST_FIELDS_VARIABLE, restore_request

    (tmp_path / "restarts").write_text(restarts)
    env = {
        **os.environ,
        "SLURM_JOB_ID": "41",
        "SLURM_CLUSTER_NAME": "dev",
        "SLURM_RESTART_COUNT": "0",
        "SLURM_LOCALID": local_id,
        REQUEST_FIELDS_VARIABLE: "NumNodes=1-2 NumTasks=2",
        "PYTHONPATH": str(ROOT),
    }
    task = subprocess.Popen(
        [sys.executable, "-c", KEEPER_TASK], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert task.stdout.readline().strip() == "ready"
        task.send_signal(signal.SIGTERM)
        wait_until(
            "the restore",
            lambda: expected is None or (fake_scontrol.exists() and fake_scontrol.read_text().splitlines() == expected),
            5,
        )
        time.sleep(0.5)
        assert task.poll() is None, "the task ended before SLURM's SIGKILL would"
    finally:
        task.kill()
        _, err = task.communicate()
    if expected is None:
        assert not fake_scontrol.exists()
    assert ("node range restored (NumNodes=1-2 NumTasks=2)" in err) == (restarts == "1" and local_id == "0"), err
    assert restore_request("41", env={**env, REQUEST_FIELDS_VARIABLE: ""}) == (False, "")  # a fixed node count
