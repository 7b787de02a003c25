"""``scontrol requeue`` from inside a job: the one scheduler call a running task makes.

A module of its own so that dependencies point one way: the scheduler module
(:mod:`hpc_hsdp.scheduler`) hands the runtime's task function to submitit, and the runtime
(:mod:`hpc_hsdp.runtime.preemption`, the watchdog) asks for a requeue through this module,
never through the scheduler module. Standard library only.
"""

from __future__ import annotations

import subprocess


def requeue_job(job_id: str, *, timeout_s: float = 30.0) -> tuple[bool, str]:
    """``scontrol requeue <job_id>``, from inside the job: rank 0 calls it after every rank
    saved on the warning signal (:mod:`hpc_hsdp.runtime.preemption`) or after a hang. SLURM then ends this
    run (SIGTERM, SIGKILL after KillWait) and starts the job again with the same id and
    ``SLURM_RESTART_COUNT`` + 1. Never raises: returns (requeued, what scontrol said)."""
    try:
        done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol requeue could not run ({exc})"
    said = " ".join((done.stdout + done.stderr).split())
    return done.returncode == 0, said or f"exit code {done.returncode}"
