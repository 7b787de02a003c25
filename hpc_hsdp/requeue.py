"""``scontrol requeue`` from inside a job: the one scheduler call a running task makes.

A module of its own so that dependencies point one way: the scheduler module
(:mod:`hpc_hsdp.scheduler`) hands the runtime's task function to submitit, and the runtime
(:mod:`hpc_hsdp.runtime.preemption`, the watchdog) asks for a requeue through this module,
never through the scheduler module. Standard library only.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REQUEUE_FILE_VARIABLE = "HPC_HSDP_REQUEUE_FILE"
"""Set by the rendered script of a container job: where no ``scontrol`` exists (inside the
image), rank 0 writes this file and the batch shell (on the host) requeues the job when the
step has ended."""


def requeue_job(job_id: str, *, timeout_s: float = 30.0, exclude: tuple[str, ...] = (),
                env=None) -> tuple[bool, str]:  # fmt: skip
    """``scontrol requeue <job_id>``, from inside the job: rank 0 calls it after every rank
    saved on the warning signal (:mod:`hpc_hsdp.runtime.preemption`) or after a hang. SLURM then ends this
    run (SIGTERM, SIGKILL after KillWait) and starts the job again with the same id and
    ``SLURM_RESTART_COUNT`` + 1. With ``exclude`` (nodes found dead), the job is requeued held,
    told to avoid those nodes, then released, so that it does not land on them again before
    SLURM marks them down. Without ``scontrol`` here (a container) and with
    ``HPC_HSDP_REQUEUE_FILE`` set, the request goes to the batch shell through that file.
    Never raises: returns (requeued, what scontrol said)."""
    env = os.environ if env is None else env
    request = env.get(REQUEUE_FILE_VARIABLE, "").strip()
    if request and shutil.which("scontrol", path=env.get("PATH")) is None:
        try:
            Path(request).write_text(f"{job_id}\n")
        except OSError as exc:
            return False, f"no scontrol here and the requeue request {request} cannot be written ({exc})"
        return True, f"no scontrol here: asked the batch shell to requeue job {job_id} when the step ends ({request})"
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
