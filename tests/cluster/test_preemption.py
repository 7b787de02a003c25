"""Preemption, time limits and failures: every rank saves, the job requeues and resumes.

Unit tests of :mod:`hpc_hsdp.runtime.preemption` (signals, flags, requeue skipped outside
SLURM), a multi-process gloo test (one rank gets the signal, all save at the same step, the
resumed run is bit-identical), ``failure_summary`` on real srun log lines, and tests
against the real dev SLURM cluster (marked ``slurm``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_helpers import in_child, launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.runtime.checkpoint import complete_checkpoints
from hpc_hsdp.runtime.preemption import (
    EXIT_STOPPED_NOT_REQUEUED,
    TERMINATE,
    WARNING,
    Preemption,
    in_slurm,
    warning_signal_from,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = TrainingSpec(
    layers=1,
    width=32,
    heads=4,
    seq_len=8,
    batch_size=2,
    vocab_size=64,
    steps=6,
    seed=5,
    checkpoint_every=0,
    keep_checkpoints=2,
)


# ----------------------------------------------------------------------------- the unit, in this process


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "SIGUSR2"),
        ("USR2", "SIGUSR2"),
        ("USR1", "SIGUSR1"),
        ("R:usr1@60", "SIGUSR1"),
        ("B:SIGUSR1@90", "SIGUSR1"),
        ("12", "SIGUSR2"),
        ("TERM", "SIGUSR2"),
        ("KILL", "SIGUSR2"),
        ("nonsense", "SIGUSR2"),
    ],
)
def test_warning_signal_from_env(value, expected):
    env = {} if value is None else {"HPC_HSDP_WARNING_SIGNAL": value}
    assert warning_signal_from(env).name == expected


def _deliver(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    for _ in range(100):  # the Python-level handler runs at the next bytecode boundary
        time.sleep(0.001)


def test_a_signal_only_sets_a_flag_and_sigterm_wins():
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    preemption = Preemption({}).install()
    try:
        assert not preemption.should_stop(0) and preemption.stop_reason is None
        _deliver(signal.SIGUSR2)
        assert preemption.local_code == WARNING and set(preemption.received) == {"USR2"}
        assert preemption.should_stop(3) and preemption.stop_reason == "USR2" and preemption.agreed_step == 3
        _deliver(signal.SIGTERM)  # SLURM is ending the job after all: no requeue then
        assert preemption.local_code == TERMINATE
        assert preemption.should_stop(4) and preemption.stop_reason == "TERM"
        outcome = preemption.finish(rank=0)
        assert outcome.reason == "TERM" and not outcome.requeued and preemption.exit_code() == 0
    finally:
        preemption.uninstall()
    assert {s: signal.getsignal(s) for s in before} == before


def test_requeue_is_skipped_outside_slurm(capsys):
    for env in (
        {"SLURM_JOB_ID": "4242"},  # dist_helpers / emulator-like: no cluster name
        {"SLURM_JOB_ID": "4242", "SLURM_CLUSTER_NAME": "local-emulator", "HPC_HSDP_EMULATOR": "1"},
    ):
        assert not in_slurm(env)
        preemption = Preemption(env)
        preemption.request(WARNING)
        assert preemption.should_stop(7)
        outcome = preemption.finish(rank=0)
        assert outcome.reason == "USR2" and outcome.step == 7 and not outcome.requeued
        assert "requeue skipped" in outcome.message
        assert preemption.exit_code() == EXIT_STOPPED_NOT_REQUEUED
    assert "[hpc-hsdp] stopped after step 7 on USR2: requeue skipped" in capsys.readouterr().err


def test_in_slurm_rank0_requeues_through_the_requeue_module(monkeypatch):
    import hpc_hsdp.job.requeue as requeue

    calls = []
    monkeypatch.setattr(requeue, "requeue_job", lambda job_id: (calls.append(job_id), (True, ""))[1])
    env = {"SLURM_JOB_ID": "77", "SLURM_CLUSTER_NAME": "dev", "SLURM_RESTART_COUNT": "2"}
    rank0, rank1 = Preemption(env), Preemption(env)
    for p in (rank0, rank1):
        p.request(WARNING)
        p.should_stop(5)
    assert rank1.finish(rank=1).requeued is False and calls == []  # only rank 0 asks SLURM
    assert rank0.finish(rank=0).requeued and calls == ["77"] and rank0.exit_code() == 0
    assert rank0.restart_count == 2


def test_requeue_job_reports_scontrols_refusal(monkeypatch, tmp_path):
    from hpc_hsdp.job.requeue import requeue_job

    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'scontrol: error: Invalid job id specified' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    ok, said = requeue_job("999999")
    assert not ok and "Invalid job id" in said


# ----------------------------------------------------------------------------- failure_summary on real srun lines


def _fake_job(tmp_path, batch_err: str, task_errs: dict[int, str]):
    from hpc_hsdp.job.scheduler import JobHandle, JobRecord

    logs = tmp_path / "logs"
    logs.mkdir(parents=True)
    (logs / "9_0_log.err").write_text(batch_err + task_errs.pop(0, ""))
    for task, text in task_errs.items():
        (logs / f"9_{task}_log.err").write_text(text)
    ranks = [{"rank": r, "slurm_procid": p} for r, p in ((0, 0), (1, 2), (2, 1), (3, 3))]  # cyclic
    (tmp_path / "layout.json").write_text(json.dumps({"ranks": ranks}))
    return JobHandle(
        JobRecord(
            job_id="9",
            cluster="slurm",
            run_dir=str(tmp_path),
            logs_dir=str(logs),
            job_name="x",
            ntasks=4,
            launcher="srun",
            submitted_at=0.0,
        )
    )


PEER = "[rank1]: RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:3467.\n"


def test_failure_summary_names_the_rank_killed_by_sigkill(tmp_path):
    batch = (
        "hpc-hsdp: job 9 starts (restart 0) on n[1-2]\n[hpc-hsdp] rank 0/4 node n1 procid 0\n"
        "srun: error: n2: task 3: Killed\nsrun: launch/slurm: _step_signal: Terminating StepId=9.0\n"
        "srun: error: n1: task 2: Terminated\nsrun: error: n1: task 0: Exited with exit code 1\n"
    )
    handle = _fake_job(
        tmp_path,
        batch,
        {
            1: "[hpc-hsdp] rank 2/4\nTraceback (most recent call last):\n" + PEER,
            3: "[hpc-hsdp] rank 3/4\n[hpc-hsdp] fault injected: ... SIGKILL\n",
        },
    )
    summary = handle.failure_summary()
    assert summary.startswith("rank 3 (task 3 on n2) failed first: killed by SIGKILL"), summary
    assert "fault injected" in summary


def test_failure_summary_names_the_rank_that_raised_in_the_latest_run(tmp_path):
    earlier = "hpc-hsdp: job 9 starts (restart 0) on n[1-2]\nsrun: error: n1: task 0: Killed\n"  # requeued then
    batch = earlier + (
        "hpc-hsdp: job 9 starts (restart 1) on n[1-2]\nsrun: error: n1: task 2: Exited with exit code 1\n"
        "srun: error: n2: task 3: Terminated\n"
    )
    handle = _fake_job(
        tmp_path,
        batch,
        {
            1: "Traceback (most recent call last):\n" + PEER,
            2: "[hpc-hsdp] rank 1/4\nTraceback (most recent call last):\n"
            "InjectedFault: fault injected: rank 1 raised at step 5\n",
        },
    )
    summary = handle.failure_summary()
    assert summary.startswith("rank 1 (task 2 on n1) failed first: Exited with exit code 1"), summary
    assert "rank 1 raised at step 5" in summary


def test_failure_summary_of_the_emulator(tmp_path):
    batch = "srun (emulator): task 1 exited with code -9; terminating the other tasks (--kill-on-bad-exit)\n"
    summary = _fake_job(tmp_path, batch, {}).failure_summary()
    assert summary.startswith("rank 2 (task 1) failed first: killed by signal 9"), summary


# ----------------------------------------------------------------------------- several ranks (gloo, fork)


def train_with_signal_on_rank3(ctx):
    """fn: the payload, with SIGUSR2 delivered to rank 3 only, before step 3's all_reduce (in which
    the ranks agree on their signals)."""
    from hpc_hsdp.runtime.loop import train

    def on_step(step, record):
        if step == 2 and ctx.rank == 3:
            os.kill(os.getpid(), signal.SIGUSR2)

    result = train(ctx, on_step=on_step)
    return dict(result.summary(ctx), received=sorted(ctx.preemption.received))


@pytest.mark.dist
def test_one_rank_signalled_every_rank_saves_at_the_same_step_and_resume_is_exact(tmp_path):
    from tests.processes.test_runtime import compare_checkpoints

    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", training=TINY, timeout_s=60)
    first = launch(spec, tasks_per_node=[2, 2], fn=train_with_signal_on_rank3, timeout_s=120)
    by_rank = {o.value["rank"]: o.value for o in first}
    assert {r: (v["stopped"], v["stop_reason"], v["steps"]) for r, v in by_rank.items()} == {
        r: (True, "USR2", 3) for r in range(4)
    }
    assert by_rank[3]["received"] == ["USR2"] and all(by_rank[r]["received"] == [] for r in (0, 1, 2))
    assert [s for s, _ in complete_checkpoints(spec.run_dir)] == [3]
    log0 = next(o.log for o in first if o.value["rank"] == 0)
    assert "every rank stops after step 3 and saves" in log0 and "requeue skipped: not in a SLURM job" in log0

    second = launch(spec, tasks_per_node=[2, 2], extra_env={"SLURM_RESTART_COUNT": "1"}, timeout_s=120)
    assert {(o.value["start_step"], o.value["steps"], o.value["stopped"]) for o in second} == {(3, 6, False)}
    assert "resumed from step 3 (restart 1)" in second[0].log
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]

    reference = RunSpec(shard_size=2, run_dir=str(tmp_path / "ref"), device="cpu", training=TINY, timeout_s=60)
    launch(reference, tasks_per_node=[2, 2], timeout_s=120)
    diffs = in_child(
        compare_checkpoints,
        tmp_path / "run" / "checkpoints" / "step-000006",
        tmp_path / "ref" / "checkpoints" / "step-000006",
    )
    assert diffs == [], f"the interrupted run differs from the uninterrupted one in {diffs[:5]}"
    ref_losses = [r["loss"] for r in read_jsonl(tmp_path / "ref" / "metrics.jsonl")]
    assert [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == ref_losses


# ----------------------------------------------------------------------------- the real dev SLURM cluster

JOB = ["--cluster", "slurm", "--device", "cpu", "--width", "32", "--layers", "1", "--seq-len", "8", "--batch-size", "2"]
# not --exclusive (the default): the module's jobs share n1/n2 (2 of 8 CPUs and GPUs each) and run side
# by side, as the time-limit job must while the others run; exclusive, each waited for the one before
TWO_BY_TWO = ["--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--no-exclusive"]
STEPS = 30
SLOW = "HPC_HSDP_FAULT_STEP_DELAY_S"  # test hook: a tiny job lasts long enough to be signalled mid-training


def hpc(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_hsdp", *args], capture_output=True, text=True, timeout=timeout)


def submit(run: Path, *args: str) -> str:
    out = hpc("submit", *JOB, "--run-dir", str(run), *args)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads((run / "job.json").read_text())["job_id"]


def status(run: Path) -> dict:
    out = hpc("status", str(run), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def steps(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl")]


def wait_until(what: str, check, timeout_s: float, run: Path):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached in {timeout_s} s; status {status(run)}\n{_logs(run)}")
        time.sleep(0.5)


def wait_finished(run: Path, timeout_s: float = 240) -> dict:
    return wait_until(
        "end of the job",
        lambda: (
            lambda s: (
                s
                if s["state"].split()[0]
                in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
                else None
            )
        )(status(run)),
        timeout_s,
        run,
    )


def all_logs(run: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("*_log.*")))


def _logs(run: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted((run / "logs").glob("*_log.err"))
    )


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
    from tests.processes.test_runtime import compare_checkpoints

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
    final = wait_finished(run)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 2, final
    logs = all_logs(run)
    assert "stopped after step" in logs and "on USR2: requeued job" in logs
    assert re.search(r"TERM: every rank stops after step \d+ and saves", logs)
    assert "resumed from step" in logs and "(restart 2)" in logs
    assert steps(run) == list(range(1, STEPS + 1))  # no gap, no repeat
    shown = hpc("status", str(run)).stdout
    assert f"restarts {final['restarts']}" in shown

    ref = wait_finished(reference_run)
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
    from tests.processes.test_runtime import compare_checkpoints

    run = tmp_path / "run"
    job_id = submit(run, *TWO_BY_TWO, "--launcher", "torchrun", "--steps", str(STEPS), "--env", f"{SLOW}=0.15")
    wait_until("step 4", lambda: len(steps(run)) >= 4, 180, run)
    assert subprocess.run(["scancel", "--signal=USR2", job_id]).returncode == 0
    final = wait_finished(run)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 1, final
    logs = all_logs(run)
    assert "on USR2: requeued job" in logs and "(restart 1)" in logs
    # the agent did not die of the warning (-12): the launcher saw the warning first, and no
    # failure of torchrun was reported (its end after SLURM's SIGTERM may be cut by SIGKILL)
    assert "torchrun on this node: SIGUSR2 received; the workers stop and save" in logs
    assert "torchrun on this node exited with code" not in logs
    assert steps(run) == list(range(1, STEPS + 1))
    ref = wait_finished(reference_run)
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
    assert wait_finished(run)["state"] == "FAILED"
    assert [s for s, _ in complete_checkpoints(run)] == [2]
    partial = run / "checkpoints" / "step-000004.tmp"
    assert partial.is_dir() and not (partial / "COMPLETE").exists()  # written in part, never marked complete

    # the same run directory on one node x 4 (shard 4): resumes from step 2, resharded
    submit(run, "--nodes", "1", "--gpus-per-node", "4", "--shard", "4", "--steps", "6", "--checkpoint-every", "2")
    final = wait_finished(run)
    assert final["state"] == "COMPLETED", _logs(run)
    assert "resumed from step 2 (restart 0)" in all_logs(run) and "saved on mesh [2, 2], now [1, 4]" in all_logs(run)
    assert steps(run) == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in complete_checkpoints(run)] == [4, 6] and not partial.exists()


@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_a_job_reaching_its_time_limit_saves_on_the_warning_requeues_and_finishes(slurm_cluster, time_limit_run):
    final = wait_finished(time_limit_run, timeout_s=380)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 1, (final, _logs(time_limit_run))
    assert steps(time_limit_run) == list(range(1, 101))
    assert "on USR2: requeued job" in all_logs(time_limit_run)
