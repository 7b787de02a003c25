"""One writer per run directory: the claim a submission (or ``hpc-hsdp run`` on rank 0) takes
before anything of its job is written, refused while another job pending or running (or a
live run) writes the directory. The claim file itself is :mod:`hpc_hsdp.rundir.lifecycle.claim`'s."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from hpc_hsdp.errors import HsdpError, SpecError
from hpc_hsdp.plan.slurm_facts import check_job_id, own_job_id
from hpc_hsdp.rundir.lifecycle import claim as claims
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord, job_record_path
from hpc_hsdp.scheduler.backends import BACKEND_NAMES, task_backend
from hpc_hsdp.scheduler.backends.slurm_command import slurm_timeout_s
from hpc_hsdp.scheduler.status import ACTIVE_STATES
from hpc_hsdp.submit_host.handle import JobHandle


def check_run_dir(spec, *, own_function: bool = False, state=None, writers: bool = True) -> str | None:
    """Before submitting into ``spec``'s run directory: refuse when a job still runs there or
    its run already completed (SpecError, nothing submitted); else what to say first: that a
    stale claim is taken over (:func:`check_writer`), from which step the job resumes (None:
    nothing, a fresh start). ``state``: the directory's :func:`~hpc_hsdp.rundir.checkpointing.state.run_dir_state`,
    when read already. ``writers=False``: the writers were checked already (:func:`claimed`)."""
    from hpc_hsdp.rundir.checkpointing.state import resubmission_note  # noqa: PLC0415  (the run directory is read on a submission, not when status/logs/--help load this module)

    run_dir = Path(spec.run.run_dir)
    takeover = check_writer(run_dir) if writers else None
    resumes = None
    if spec.run.entry is None and not own_function:  # a function of the user's keeps its own state
        resumes = resubmission_note(run_dir, steps=spec.run.training.optimizer.steps, state=state)
    return "\n".join(line for line in (takeover, resumes) if line) or None


def _writers(run_dir: Path) -> list[tuple[JobHandle, dict | None]]:
    """The jobs that may write ``run_dir``: the one its claim names, and the one its
    ``job.json`` names (a directory written before claims); with the claim, when it names the job."""
    found: list[tuple[JobHandle, dict | None]] = []
    claim = claims.read_claim(run_dir)
    if claim is not None and claim.get("job_id") and claim.get("cluster") in BACKEND_NAMES:
        logs_dir = claim.get("logs_dir")
        logs = logs_dir if isinstance(logs_dir, str) else "logs"
        try:
            record = JobRecord(
                job_id=check_job_id(claim["job_id"], where=f"{claims.claim_path(run_dir)}: job_id"),
                cluster=claim["cluster"],
                run_dir=str(run_dir),
                logs_dir=str(run_dir / logs) if ".." not in Path(logs).parts else str(run_dir / "logs"),
                job_name="",
                ntasks=1,
                launcher="srun",
                submitted_at=0.0,
            )
            found.append((JobHandle(record), claim))
        except HsdpError:
            pass  # a claim whose job id is not one: no job holds it
    if job_record_path(run_dir).is_file():
        try:
            handle = JobHandle.find(str(run_dir))
        except HsdpError:
            handle = None
        if handle is not None and all(h.job_id != handle.job_id for h, _ in found):
            found.append((handle, None))
    return found


def check_writer(
    run_dir: Path, *, own_job: str | None = None, refused: str = "nothing submitted", taker: str = "this submission"
) -> str | None:
    """Refuse (SpecError, one line naming it) when a job pending or running writes ``run_dir``
    (other than ``own_job``, the job asking: a requeued attempt of the claimant is the claimant),
    or an ``hpc-hsdp run`` outside any job still does; else the line to say when a claim was
    left by a job (or run) that ended without releasing it, or by a job that writes another
    directory (this one is a copy of it, or was moved) (None: nothing to say). ``refused``:
    what the refusal says was not done; ``taker``: who takes the claim over."""
    said = _check_bare_run(run_dir, refused, taker)
    for handle, claim in _writers(run_dir):
        if own_job is not None and handle.job_id == own_job:
            continue
        try:
            status = handle.status()
            job_state, silent = status.state.split()[0], status.controller_answered is False
        except (HsdpError, OSError, subprocess.SubprocessError):
            job_state, silent = "UNKNOWN", False
        if job_state == "UNKNOWN" and silent:
            if handle.backend.reachable_here():  # it may well still run
                raise SpecError(
                    f"{handle.backend.title} did not answer about job {handle.job_id}, which claims run directory {run_dir}: "
                    f"{refused}; try again"
                )
            job_state = f"UNKNOWN (no {handle.backend.title} here to ask)"  # a run copied off the cluster, say
        if job_state in ACTIVE_STATES:
            elsewhere = handle.runs_elsewhere()
            if elsewhere is None:
                raise SpecError(
                    f"job {handle.job_id} is still {job_state} in run directory {run_dir}: {refused}; wait "
                    f"for it, cancel it (hpc-hsdp cancel {run_dir}) or choose a new --run-dir"
                )
            said = (
                f"run directory {run_dir} is a copy of {elsewhere}, where job {handle.job_id} is still {job_state}: "
                f"{taker} claims the copy"
            )
        elif claim is not None and claim.get("state") == claims.CLAIMED:
            said = (
                f"run directory {run_dir} was claimed by job {handle.job_id}, which is {job_state}: {taker} takes "
                f"the claim over"
            )
    claim = claims.read_claim(run_dir)
    if said is None and claim is not None and claim.get("state") == claims.SUBMITTING:  # no job id: none to ask about
        said = (
            f"run directory {run_dir} was claimed by a submission (pid {claim.get('pid')} on {claim.get('host')}) "
            f"that did not finish: {taker} takes the claim over"
        )
    return said


def _check_bare_run(run_dir: Path, refused: str, taker: str) -> str | None:
    """A claim of ``hpc-hsdp run`` started outside any job (its pid and host, no job id):
    refused while that run lives, taken over (and said) once it is gone. A run lives while it
    holds ``run.lock`` (:func:`claims.run_lock_held`, the kernel's ``flock``, let go when the
    process ends), not while some process has the claim's pid: a claim naming a live process
    that is no run (a pid reused, or a claim written by hand) blocked every submission."""
    claim = claims.read_claim(run_dir)
    if claim is None or claim.get("state") != claims.CLAIMED or claim.get("job_id") is not None:
        return None
    pid, host = claim.get("pid"), claim.get("host")
    if host != claims.who()["host"]:
        raise SpecError(
            f"hpc-hsdp run (pid {pid} on {host}) claims run directory {run_dir}, and its end cannot be seen from "
            f"this host: {refused}; if it has ended, remove {claims.claim_path(run_dir)}"
        )
    if claims.run_lock_held(run_dir):
        raise SpecError(
            f"hpc-hsdp run (pid {pid} on {host}) still writes run directory {run_dir}: {refused}; wait for "
            f"it, stop it, or choose a new --run-dir"
        )
    return f"run directory {run_dir} was claimed by hpc-hsdp run (pid {pid} on {host}), which has ended: {taker} takes the claim over"


def claim_for_task(run_dir: str | Path, env: Mapping[str, str]) -> tuple[str | None, bool]:
    """``hpc-hsdp run`` on rank 0, before anything is written: take ``run_dir``'s claim for the
    job it belongs to (``SLURM_JOB_ID``: the emulator's or SLURM's; none: this process). A
    claim of this very job (the submission's, or an earlier attempt of a requeued job) is
    kept as it is; one of another job pending or running, or of a live run, refuses
    (SpecError, one line). Returns what to say of a claim taken over, and whether the claim
    is this process's own (to release with :func:`release_task_claim` when it ends)."""
    from hpc_hsdp.scheduler.emulator.processes import process_start_time  # noqa: PLC0415  (a process's identity, for a claim without a job)

    run_dir = Path(run_dir)
    _make_dirs(run_dir)
    job_id = own_job_id(env)  # a sweep point's: its array task, as its submission claimed the directory
    with claims.claim_lock(run_dir, wait_s=CLAIM_WAIT_S + slurm_timeout_s()):
        claim = claims.read_claim(run_dir)
        if job_id is not None and claim is not None and claim.get("job_id") == job_id:
            if claim.get("state") != claims.CLAIMED:  # released when it was seen to end, and requeued since
                fields = {k: v for k, v in claim.items() if k in ("cluster", "logs_dir")}
                claims.write_claim(run_dir, claims.CLAIMED, job_id=job_id, **fields)
            return None, False
        said = check_writer(run_dir, own_job=job_id, refused="nothing started", taker="this run")
        if job_id is None:
            claims.hold_run_lock(run_dir)  # to this process's end: what tells that the run lives
            claims.write_claim(run_dir, claims.CLAIMED, job_id=None, pid_started=process_start_time(os.getpid()))
        else:
            cluster = task_backend(env).name
            claims.write_claim(run_dir, claims.CLAIMED, job_id=check_job_id(job_id), cluster=cluster, logs_dir="logs")
        return said, job_id is None


def release_task_claim(run_dir: str | Path) -> None:
    """The end of an ``hpc-hsdp run`` outside any job: its claim (this pid's) released."""
    run_dir = Path(run_dir)
    try:
        with claims.claim_lock(run_dir, wait_s=5.0):
            claim = claims.read_claim(run_dir) or {}
            mine = claim.get("pid") == os.getpid() and claim.get("host") == claims.who()["host"]
            if mine and claim.get("state") == claims.CLAIMED and claim.get("job_id") is None:
                claims.write_claim(run_dir, claims.RELEASED, job_id=None)
        claims.let_go_of_run_lock(run_dir)
    except (OSError, HsdpError):
        pass


CLAIM_WAIT_S = 120.0
"""How long a submission waits for another one into the same run directory to record its job
(on top of sbatch's own bound)."""


@contextmanager
def claimed(run_dir: str | Path, *, cluster: str) -> Iterator[tuple[str | None, Callable[[JobRecord], None]]]:
    """Hold ``run_dir``'s claim for a submission to ``cluster``: the lock, the check that no job
    pending or running writes it (:func:`check_writer`, which refuses), then a ``submitting``
    claim, before anything of the job is written. Yields what to say of a claim taken over and
    the function that records the job (``claimed``, its id) once it was submitted. When the
    submission fails, the claim left before is put back and what was created for it (the
    directory itself) is removed."""
    run_dir = Path(run_dir)
    created = _make_dirs(run_dir)

    def record(job: JobRecord) -> None:
        logs = Path(job.logs_dir)
        relative = logs.relative_to(run_dir) if logs.is_relative_to(run_dir) else logs
        claims.write_claim(run_dir, claims.CLAIMED, job_id=job.job_id, cluster=job.cluster, logs_dir=str(relative))

    try:
        with claims.claim_lock(run_dir, wait_s=CLAIM_WAIT_S + slurm_timeout_s()):
            before = claims.claim_bytes(run_dir)
            takeover = check_writer(run_dir)
            try:
                claims.write_claim(run_dir, claims.SUBMITTING, cluster=cluster)
                yield takeover, record
            except BaseException:
                _put_back(run_dir, before)
                raise
    except BaseException:
        if created:
            _remove_if_only_the_lock(run_dir, created)
        raise


def _remove_if_only_the_lock(run_dir: Path, created: list[Path]) -> None:
    """The directories a failed submission made, removed, unless another submission raced
    into them meanwhile (its claim or job is there: they stay as they are)."""
    try:
        if {entry.name for entry in run_dir.iterdir()} - {claims.CLAIM_LOCK}:
            return
        (run_dir / claims.CLAIM_LOCK).unlink(missing_ok=True)
    except OSError:
        return
    for folder in reversed(created):
        try:
            folder.rmdir()
        except OSError:
            break


def _put_back(run_dir: Path, before: bytes | None) -> None:
    path = claims.claim_path(run_dir)
    try:
        if before is None:
            path.unlink()
        else:
            path.write_bytes(before)
    except OSError:
        pass


def _make_dirs(path: Path) -> list[Path]:
    """Create ``path`` and its missing parents; the ones this call created (not another
    process at the same moment), outermost first."""
    missing = []
    for folder in [path, *path.parents]:
        if folder.exists():
            break
        missing.append(folder)
    created = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
            created.append(folder)
        except FileExistsError:
            if not folder.is_dir():
                raise
    return created
