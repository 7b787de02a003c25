"""Preemption, time limits and failures on the real dev SLURM cluster: every rank saves, the job
requeues and resumes."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from cluster_helpers import hpc, log_tails, status, wait_ended, wait_until
from dist_helpers import in_child

from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.task.checkpointing.checkpoint import complete_checkpoints
from tests.job_helpers import tiny_job
from tests.preemption_helpers import steps

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the real dev SLURM cluster

JOB = tiny_job(vocab_size=None, cluster="slurm", device="cpu")
# not --exclusive (the default): the module's jobs share n1/n2 (2 of 8 CPUs and GPUs each) and run side
# by side, as the time-limit job must while the others run; exclusive, each waited for the one before
TWO_BY_TWO = ["--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--no-exclusive"]
STEPS = 30
SLOW = "HPC_HSDP_FAULT_STEP_DELAY_S"  # test hook: a tiny job lasts long enough to be signalled mid-training


def submit(run: Path, *args: str) -> str:
    out = hpc("submit", *JOB, "--run-dir", str(run), *args)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads((run / "job.json").read_text())["job_id"]


def all_logs(run: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("*_log.*")))


@pytest.fixture(scope="module")
def reference_run(slurm_cluster, tmp_path_factory) -> Path:
    """The uninterrupted run (same seed, steps, mesh) the preempted ones must equal; submitted first."""
    run = tmp_path_factory.mktemp("reference") / "run"
    submit(run, *TWO_BY_TWO, "--steps", str(STEPS))
    return run


@pytest.fixture(scope="module")
def time_limit_run(slurm_cluster, tmp_path_factory) -> Path:
    """A job that outlives its 2-minute limit: submitted at the start of the module so that it runs
    while the other tests do. ``--signal USR2@60``: SLURM sends it between 30 s and 60 s after the
    start (it checks limits every 30 s), every run; 100 steps of 0.5 s need two or three runs."""
    run = tmp_path_factory.mktemp("time-limit") / "run"
    submit(run, *TWO_BY_TWO, "--steps", "100", "--time", "2", "--signal", "USR2@60", "--env", f"{SLOW}=0.5")
    return run


@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_usr2_and_scontrol_requeue_checkpoint_requeue_resume_and_match_an_uninterrupted_run(
    slurm_cluster, reference_run, time_limit_run, tmp_path
):
    from tests.runtime_helpers import compare_checkpoints

    run = tmp_path / "run"
    job_id = submit(run, *TWO_BY_TWO, "--steps", str(STEPS), "--env", f"{SLOW}=0.15")
    wait_until("step 4", lambda: len(steps(run)) >= 4, 180, run)
    signalled = time.time()
    assert subprocess.run(["scancel", "--signal=USR2", job_id]).returncode == 0  # reaches every task
    wait_until("restart 1", lambda: status(run)["restarts"] >= 1, 120, run)
    first_stop = wait_until(
        "resume", lambda: (lambda t: t if "resumed from step" in t else None)(all_logs(run)), 120, run
    )
    stop_step = int(re.search(r"resumed from step (\d+) \(restart 1\)", first_stop).group(1))
    wait_until(f"step {stop_step + 1}", lambda: len(steps(run)) > stop_step, 120, run)
    recovery_s = (
        next(r["wall_time"] for r in read_jsonl(run / "metrics.jsonl") if r["step"] == stop_step + 1) - signalled
    )
    wait_until(f"step {stop_step + 3}", lambda: len(steps(run)) >= stop_step + 3, 120, run)

    # SLURM itself ends the run (SIGTERM, SIGKILL after KillWait=5 s): every rank saves in time
    assert subprocess.run(["scontrol", "requeue", job_id]).returncode == 0
    final = wait_ended(run)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 2, final
    logs = all_logs(run)
    assert "stopped after step" in logs and "on USR2: requeued job" in logs
    assert re.search(r"TERM: every rank stops after step \d+ and saves", logs)
    assert "resumed from step" in logs and "(restart 2)" in logs
    assert steps(run) == list(range(1, STEPS + 1))  # no gap, no repeat
    shown = hpc("status", str(run)).stdout
    assert f"restarts {final['restarts']}" in shown

    ref = wait_ended(reference_run)
    assert ref["state"] == "COMPLETED" and ref["restarts"] == 0
    diffs = in_child(
        compare_checkpoints,
        run / "checkpoints" / f"step-{STEPS:06d}",
        reference_run / "checkpoints" / f"step-{STEPS:06d}",
    )
    assert diffs == [], f"the preempted run differs from the uninterrupted one in {diffs[:5]}"
    assert [r["loss"] for r in read_jsonl(run / "metrics.jsonl")] == [
        r["loss"] for r in read_jsonl(reference_run / "metrics.jsonl")
    ]
    print(f"recovery (USR2 sent -> first resumed step done): {recovery_s:.1f} s")
    assert recovery_s < 90


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_torchrun_launcher_saves_requeues_and_resumes_on_the_warning(slurm_cluster, reference_run, tmp_path):
    """SLURM signals every process of the step: torchrun's agent must survive the warning
    (it starts with it ignored) while its workers save; the resumed run equals the reference."""
    from tests.runtime_helpers import compare_checkpoints

    run = tmp_path / "run"
    job_id = submit(run, *TWO_BY_TWO, "--launcher", "torchrun", "--steps", str(STEPS), "--env", f"{SLOW}=0.15")
    wait_until("step 4", lambda: len(steps(run)) >= 4, 180, run)
    assert subprocess.run(["scancel", "--signal=USR2", job_id]).returncode == 0
    final = wait_ended(run)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 1, final
    logs = all_logs(run)
    assert "on USR2: requeued job" in logs and "(restart 1)" in logs
    # the agent did not die of the warning (-12): the launcher saw the warning first, and no
    # failure of torchrun was reported (its end after SLURM's SIGTERM may be cut by SIGKILL)
    assert "torchrun on this node: SIGUSR2 received; the workers stop and save" in logs
    assert "torchrun on this node exited with code" not in logs
    assert steps(run) == list(range(1, STEPS + 1))
    ref = wait_ended(reference_run)
    assert ref["state"] == "COMPLETED"
    diffs = in_child(
        compare_checkpoints,
        run / "checkpoints" / f"step-{STEPS:06d}",
        reference_run / "checkpoints" / f"step-{STEPS:06d}",
    )
    assert diffs == [], f"the preempted torchrun job differs from the uninterrupted one in {diffs[:5]}"


@pytest.mark.slurm
@pytest.mark.timeout(120)
def test_a_rank_killed_with_sigkill_fails_the_job_fast_and_names_the_rank(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    done = hpc(
        "submit",
        *JOB,
        *TWO_BY_TWO,
        "--run-dir",
        str(run),
        "--steps",
        "200",
        "--wait",
        "--env",
        "HPC_HSDP_FAULT_KILL_AT=3:5",
    )
    ended = time.time()
    assert done.returncode == 1, done.stdout + done.stderr
    killed_at = float(re.search(r"fault injected: rank 3 at step 5 .*SIGKILL at ([0-9.]+)", all_logs(run)).group(1))
    assert ended - killed_at < 60, f"the job took {ended - killed_at:.0f} s to end after the kill"
    assert "ended FAILED" in done.stderr
    assert "rank 3 (task 3 on n2) failed first: killed by SIGKILL" in done.stderr, done.stderr
    assert status(run)["state"] == "FAILED"
    print(f"kill -> submit --wait returned: {ended - killed_at:.1f} s")


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_killed_while_saving_resumes_from_the_previous_checkpoint_on_another_node_count(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    submit(run, *TWO_BY_TWO, "--steps", "6", "--checkpoint-every", "2", "--env", "HPC_HSDP_FAULT_KILL_IN_SAVE=1:4")
    assert wait_ended(run)["state"] == "FAILED"
    assert [s for s, _ in complete_checkpoints(run)] == [2]
    partial = run / "checkpoints" / "step-000004.tmp"
    assert partial.is_dir() and not (partial / "COMPLETE").exists()  # written in part, never marked complete

    # the same run directory on one node x 4 (shard 4): resumes from step 2, resharded
    submit(run, "--nodes", "1", "--gpus-per-node", "4", "--shard", "4", "--steps", "6", "--checkpoint-every", "2")
    final = wait_ended(run)
    assert final["state"] == "COMPLETED", log_tails(run)
    assert "resumed from step 2 (restart 0)" in all_logs(run) and "saved on mesh [2, 2], now [1, 4]" in all_logs(run)
    assert steps(run) == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in complete_checkpoints(run)] == [4, 6] and not partial.exists()


@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_a_job_reaching_its_time_limit_saves_on_the_warning_requeues_and_finishes(slurm_cluster, time_limit_run):
    final = wait_ended(time_limit_run, timeout_s=380)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 1, (final, log_tails(time_limit_run))
    assert steps(time_limit_run) == list(range(1, 101))
    assert "on USR2: requeued job" in all_logs(time_limit_run)
