"""``scontrol requeue`` from inside a job: the one scheduler call a running task makes.

A module of its own so that dependencies point one way: the scheduler module
(:mod:`hpc_hsdp.scheduler`) hands the runtime's task function to submitit, and the runtime
(:mod:`hpc_hsdp.runtime.preemption`, the watchdog) asks for a requeue through this module,
never through the scheduler module. Standard library only.
"""

from __future__ import annotations

import subprocess


def requeue_job(job_id: str, *, timeout_s: float = 30.0, exclude: tuple[str, ...] = ()) -> tuple[bool, str]:
    """``scontrol requeue <job_id>``, from inside the job: rank 0 calls it after every rank
    saved on the warning signal (:mod:`hpc_hsdp.runtime.preemption`) or after a hang. SLURM then ends this
    run (SIGTERM, SIGKILL after KillWait) and starts the job again with the same id and
    ``SLURM_RESTART_COUNT`` + 1. With ``exclude`` (nodes found dead), the job is requeued held,
    told to avoid those nodes, then released, so that it does not land on them again before
    SLURM marks them down. Never raises: returns (requeued, what scontrol said)."""
    if exclude:
        return _requeue_avoiding(job_id, exclude, timeout_s=timeout_s)
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol requeue could not run ({exc})"
    said = " ".join((done.stdout + done.stderr).split())
    return done.returncode == 0, said or f"exit code {done.returncode}"


def _scontrol(*args: str, timeout_s: float) -> tuple[bool, str]:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol {args[0]} could not run ({exc})"
    return done.returncode == 0, " ".join((done.stdout + done.stderr).split()) or f"exit code {done.returncode}"


def _requeue_avoiding(job_id: str, exclude: tuple[str, ...], *, timeout_s: float) -> tuple[bool, str]:
    ok, said = _scontrol("requeuehold", job_id, timeout_s=timeout_s)
    if not ok:
        return False, said
    try:
        excluded, why = _scontrol("update", f"JobId={job_id}", f"ExcNodeList={','.join(exclude)}", timeout_s=timeout_s)
    finally:
        released, why_release = _scontrol("release", job_id, timeout_s=timeout_s)
    if not released:
        return False, f"requeued but still held: {why_release}; release it with scontrol release {job_id}"
    return True, "" if excluded else f"(could not exclude {','.join(exclude)}: {why})"
