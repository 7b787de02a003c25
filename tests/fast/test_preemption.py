"""Preemption in this process: :mod:`hpc_hsdp.task.resilience.preemption` (signals, flags, requeue skipped
outside SLURM) and ``failure_summary`` on real srun log lines."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from hpc_hsdp.scheduler.backends import task_environment
from hpc_hsdp.task.resilience.preemption import (
    EXIT_STOPPED_NOT_REQUEUED,
    TERMINATE,
    WARNING,
    Preemption,
    warning_signal_from,
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
        assert not task_environment(env).requeues
        preemption = Preemption(env)
        preemption.request(WARNING)
        assert preemption.should_stop(7)
        outcome = preemption.finish(rank=0)
        assert outcome.reason == "USR2" and outcome.step == 7 and not outcome.requeued
        assert "requeue skipped" in outcome.message
        assert preemption.exit_code() == EXIT_STOPPED_NOT_REQUEUED
    assert "[hpc-hsdp] stopped after step 7 on USR2: requeue skipped" in capsys.readouterr().err


def test_in_slurm_rank0_requeues_through_its_job_environment(monkeypatch):
    import hpc_hsdp.scheduler.backends.slurm_task as slurm_task

    calls = []
    monkeypatch.setattr(slurm_task, "requeue_job", lambda job_id, exclude=(): (calls.append(job_id), (True, ""))[1])
    env = {"SLURM_JOB_ID": "77", "SLURM_CLUSTER_NAME": "dev", "SLURM_RESTART_COUNT": "2"}
    rank0, rank1 = Preemption(env), Preemption(env)
    for p in (rank0, rank1):
        p.request(WARNING)
        p.should_stop(5)
    assert rank1.finish(rank=1).requeued is False and calls == []  # only rank 0 asks SLURM
    assert rank0.finish(rank=0).requeued and calls == ["77"] and rank0.exit_code() == 0
    assert rank0.restart_count == 2


def test_requeue_job_reports_scontrols_refusal(monkeypatch, tmp_path):
    from hpc_hsdp.scheduler.backends.slurm_task import requeue_job

    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'scontrol: error: Invalid job id specified' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    ok, said = requeue_job("999999")
    assert not ok and "Invalid job id" in said


# ----------------------------------------------------------------------------- failure_summary on real srun lines


def _fake_job(tmp_path, batch_err: str, task_errs: dict[int, str]):
    from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
    from hpc_hsdp.submit_host.handle import JobHandle

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
