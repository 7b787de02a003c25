"""--fault-tolerance replica for real on the local emulator: the rendered script's replica
supervisor, a torchft lighthouse, one emulated job step (process group) per replica group,
and one group killed (-9, every process of it) in the middle of the run."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from throttle import user_pids

from hpc_hsdp.data.sampler import BatchLayout, SampleOrder
from hpc_hsdp.data.synthetic import SyntheticSamples
from hpc_hsdp.rundir.checkpointing.state import complete_checkpoints
from hpc_hsdp.rundir.observation.replica_membership import membership_path, read_membership
from tests.fault_tolerance_helpers import GLOBAL_BATCH, STEPS, _launch, _metrics, _spec

pytestmark = [pytest.mark.dist, pytest.mark.timeout(420)]


def _group_pids(job_id: str, replica_id: int) -> list[int]:
    """This user's processes of emulated job ``job_id`` in replica group ``replica_id`` (its srun and tasks)."""
    return user_pids({f"SLURM_JOB_ID={job_id}".encode(), f"HPC_HSDP_REPLICA_ID={replica_id}".encode()})


def _wait_for_step(run_dir: Path, step: int, job, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        records = _metrics(run_dir)
        if records and records[-1]["step"] >= step and records[-1].get("replicas") == 2:
            return
        assert not job.done(), f"the job ended early: {job.info()}"
        time.sleep(0.2)
    raise AssertionError(f"no step {step} with 2 replica groups after {timeout_s} s: {_metrics(run_dir)[-3:]}")


def _samples_per_step(samples: Path) -> dict[int, list[int]]:
    """The sample ids each step trained, from every rank's ``HPC_HSDP_FAULT_SAMPLE_LOG`` file."""
    per_step: dict[int, list[int]] = {}
    for path in samples.glob("samples-rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            per_step.setdefault(record["step"], []).extend(i for micro in record["sample_ids"] for i in micro)
    return per_step


def _assert_every_step_once(run_dir: Path, samples: Path) -> None:
    """Steps 1..STEPS in order, each with its whole global batch, no sample twice in a step."""
    assert [r["step"] for r in _metrics(run_dir)] == list(range(1, STEPS + 1))
    per_step = _samples_per_step(samples)
    for step in range(1, STEPS + 1):
        assert len(per_step[step]) == GLOBAL_BATCH and len(set(per_step[step])) == GLOBAL_BATCH, step


def _assert_last_step_saved_and_relaunch_resumes_exactly(spec, run_dir: Path, samples: Path) -> None:
    """After a fall back: the last committed step itself was saved (nothing to redo), and the
    same script on the same run directory (what the requeue does) completes every step once."""
    saved = [step for step, _ in complete_checkpoints(run_dir)]
    last = _metrics(run_dir)[-1]["step"]
    assert saved and saved[-1] == last, (saved, last)
    again = _launch(spec)
    try:
        assert again.wait(timeout_s=300) == "COMPLETED"
    finally:
        again.cancel()
    _assert_every_step_once(run_dir, samples)


def _healed_since(run_dir: Path, replica_id: int, since: float) -> bool:
    """Group ``replica_id`` healed from a live peer after ``since`` (a group started after its peer
    heals at the job's start too)."""
    return any(
        "healed from a live peer" in e.get("cause", "") and e.get("replica_id") == replica_id and e["time"] > since
        for e in read_membership(run_dir)
    )


def _wait_for_heal(run_dir: Path, replica_id: int, job, since: float, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not job.done() and not _healed_since(run_dir, replica_id, since):
        time.sleep(0.2)


def test_a_killed_replica_group_costs_no_step_and_comes_back_on_a_spare(tmp_path: Path) -> None:
    run_dir, samples = tmp_path / "run", tmp_path / "samples"
    samples.mkdir()
    # the survivor's steps are slow from the kill until the group on the spare has joined, however
    # long a loaded machine takes to start it (20 steps of 2 s), then back to the usual pace
    pace = tmp_path / "step-delay"
    pace.write_text("0.4")
    spec = _spec(run_dir, samples, "--spare-nodes", "1", step_delay=f"@{pace}")
    (run_dir / "logs").mkdir(parents=True)
    job = _launch(spec)
    try:
        _wait_for_step(run_dir, 4, job, timeout_s=240)
        victims = _group_pids(job.job_id, 1)
        assert victims, "no process of replica group 1 found"
        killed_after = _metrics(run_dir)[-1]["step"]
        pace.write_text("2")
        killed_at = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        _wait_for_heal(run_dir, 1, job, since=killed_at, timeout_s=60)
        pace.write_text("0.4")
        state = job.wait(timeout_s=300)
    finally:
        job.cancel()
    assert state == "COMPLETED", (run_dir / "logs" / f"{job.job_id}_0_log.err").read_text()[-3000:]

    # every step once, in order; the count of replica groups drops after the kill and comes back
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    replicas = [r["replicas"] for r in records]
    assert all(r["replica_groups"] == 2 for r in records)
    after = replicas[killed_after:]
    assert 1 in after, f"the loss of a group is not seen: {replicas}"
    assert after[-1] == 2, f"the group on the spare never joined: {replicas}"

    # every sample of every step trained exactly once: the step's global batch, split over the live groups
    per_step = _samples_per_step(samples)
    train = SyntheticSamples(seed=0, seq_len=8, vocab_size=256)
    order = SampleOrder(num_samples=train.num_samples, seed=0)
    layout = BatchLayout(global_batch=GLOBAL_BATCH, world_size=2 * 2, grad_accum=1)
    assert sorted(per_step) == list(range(1, STEPS + 1))
    for step, ids in per_step.items():
        expected = order.sample_ids(layout.step_positions(step))
        assert sorted(ids) == sorted(np.asarray(expected).tolist()), f"step {step}: rows trained {sorted(ids)}"

    # the membership changes, with time and cause, from the supervisor and the groups
    events = read_membership(run_dir)
    lost = [e for e in events if e.get("event") == "replica group lost"]
    assert lost and lost[0]["replica_id"] == 1 and "exit code" in lost[0]["cause"]
    restarted = [e for e in events if e.get("event") == "replica group started" and e["attempt"] == 1]
    assert restarted and restarted[0]["nodes"] == ["n3"]
    assert any("healed from a live peer" in e.get("cause", "") and e["replica_id"] == 1 for e in events)
    assert len(events) == len(membership_path(run_dir).read_text().splitlines())  # none dropped for want of a time
    assert all(isinstance(e["time"], float) for e in events)


def test_below_min_replicas_the_survivor_saves_its_last_step_and_the_requeued_job_resumes_exactly(tmp_path: Path):
    run_dir, samples = tmp_path / "run", tmp_path / "samples"
    samples.mkdir()
    spec = _spec(run_dir, samples, "--min-replicas", "2", "--quorum-timeout", "8")
    (run_dir / "logs").mkdir(parents=True)
    job = _launch(spec)
    try:
        _wait_for_step(run_dir, 4, job, timeout_s=240)
        for pid in _group_pids(job.job_id, 1):
            os.kill(pid, signal.SIGKILL)
        job.wait(timeout_s=240)
    finally:
        job.cancel()
    assert job.info()["exit_code"] == 75, job.info()  # fell back: the job asks to be requeued
    events = read_membership(run_dir)
    assert any(e.get("event") == "fall back to requeue" and "--min-replicas" in e["cause"] for e in events)
    _assert_last_step_saved_and_relaunch_resumes_exactly(spec, run_dir, samples)


def _lighthouse_pids(job_id: str) -> list[int]:
    """This user's torchft lighthouse of emulated job ``job_id`` (the supervisor's child: its environment;
    its script runs as ``python torchft_lighthouse ...``)."""
    return user_pids(
        {f"SLURM_JOB_ID={job_id}".encode()}, lambda argv: any(a.endswith(b"torchft_lighthouse") for a in argv[:2])
    )


def test_a_killed_lighthouse_is_restarted_on_its_address_and_the_groups_train_on(tmp_path: Path) -> None:
    run_dir, samples = tmp_path / "run", tmp_path / "samples"
    samples.mkdir()
    # --min-replicas 2: both groups train every step (none trains alone while the other is still starting)
    spec = _spec(run_dir, samples, "--min-replicas", "2", "--quorum-timeout", "60")
    (run_dir / "logs").mkdir(parents=True)
    job = _launch(spec)
    try:
        _wait_for_step(run_dir, 4, job, timeout_s=240)
        lighthouses = _lighthouse_pids(job.job_id)
        assert len(lighthouses) == 1, f"not one lighthouse of job {job.job_id}: {lighthouses}"
        killed_after = _metrics(run_dir)[-1]["step"]
        os.kill(lighthouses[0], signal.SIGKILL)
        state = job.wait(timeout_s=300)
    finally:
        job.cancel()
    assert state == "COMPLETED", (run_dir / "logs" / f"{job.job_id}_0_log.err").read_text()[-3000:]

    # every step once, in order, by both groups: no group was lost to the lighthouse's end
    _assert_every_step_once(run_dir, samples)
    assert all(r["replicas"] == 2 for r in _metrics(run_dir)) and killed_after < STEPS
    assert sorted(_samples_per_step(samples)) == list(range(1, STEPS + 1))

    events = read_membership(run_dir)
    started = [e for e in events if e.get("event") == "lighthouse started"]
    assert len(started) == 2 and started[0]["address"] == started[1]["address"], started
    assert started[0]["pid"] == lighthouses[0] != started[1]["pid"]
    ended = [e for e in events if e.get("event") == "lighthouse ended"]
    assert len(ended) == 1 and ended[0]["code"] == -signal.SIGKILL, ended
    assert not any(e.get("event") in ("replica group lost", "fall back to requeue") for e in events), events


def test_a_lighthouse_that_cannot_be_kept_falls_back_to_a_requeue_that_resumes_exactly(tmp_path: Path) -> None:
    from hpc_hsdp.batch_shell.replica_supervisor import LIGHTHOUSE_RESTARTS, LIGHTHOUSE_WINDOW_S

    run_dir, samples = tmp_path / "run", tmp_path / "samples"
    samples.mkdir()
    spec = _spec(run_dir, samples, "--min-replicas", "2", "--quorum-timeout", "20")
    (run_dir / "logs").mkdir(parents=True)
    job = _launch(spec)
    killed: list[int] = []
    try:
        _wait_for_step(run_dir, 4, job, timeout_s=240)
        deadline = time.monotonic() + 60
        while not job.done() and time.monotonic() < deadline:  # every lighthouse it starts, killed at once
            for pid in set(_lighthouse_pids(job.job_id)) - set(killed):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)
        job.wait(timeout_s=240)
    finally:
        job.cancel()
    assert job.info()["exit_code"] == 75, job.info()  # fell back: the job asks to be requeued
    events = read_membership(run_dir)
    started = [e for e in events if e.get("event") == "lighthouse started"]
    # the supervisor gave up after LIGHTHOUSE_RESTARTS starts within LIGHTHOUSE_WINDOW_S (an earlier one may have aged out)
    assert len(started) >= LIGHTHOUSE_RESTARTS and len(killed) == len(started), (started, killed)
    assert started[-1]["time"] - started[-LIGHTHOUSE_RESTARTS]["time"] < LIGHTHOUSE_WINDOW_S, started
    fell = [e for e in events if e.get("event") == "fall back to requeue"]
    assert len(fell) == 1 and fell[0]["cause"] == "the lighthouse could not be kept", fell
    _assert_last_step_saved_and_relaunch_resumes_exactly(spec, run_dir, samples)
