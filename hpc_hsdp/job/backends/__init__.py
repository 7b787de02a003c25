"""The schedulers a job runs on: SLURM (:mod:`.slurm`, through submitit) and the local emulator
(:mod:`.local`); and the choice between them (``--cluster``)."""

from __future__ import annotations

import shutil

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.backends.slurm_command import SchedulerError, SchedulerTimeout, ping_controller

CLUSTERS = ("auto", "slurm", "local")


def resolve_cluster(choice: str, *, ping=ping_controller, which=shutil.which) -> tuple[str, str]:
    """``auto`` -> ``slurm`` when the controller answers; ``local`` only where no SLURM client is
    installed (no ``sbatch``) or configured (``scontrol`` finds no configuration). Where SLURM is
    configured, a controller that does not answer is a :class:`SchedulerError` (nothing is
    submitted, nothing runs here: a login node is no place to train). With a reason line."""
    if choice not in CLUSTERS:
        raise SpecError(f"--cluster {choice!r} is unknown; choose auto, slurm or local")
    if choice == "local":
        return "local", "running on the local emulator (--cluster local)"
    if which("sbatch") is None:
        if choice == "slurm":
            raise SchedulerError(
                "--cluster slurm but sbatch is not on PATH; load SLURM's client, or use --cluster local"
            )
        return "local", "running on the local emulator: no SLURM here (sbatch not found on PATH)"
    found = ping()
    if found.answered:
        return "slurm", f"submitting to SLURM ({found.controller} answers)"
    if not found.configured and choice == "auto":
        return "local", f"running on the local emulator: SLURM is installed but not configured here ({found.said})"
    if not found.configured:
        raise SchedulerError(
            f"--cluster slurm but SLURM is not configured here ({found.said}); set SLURM_CONF, or use --cluster local"
        )
    if "did not answer" in found.said:
        raise SchedulerTimeout(
            f"{found.said}; nothing submitted: try again, or --cluster local to run on this machine",
            command="scontrol ping",
            timeout_s=found.timeout_s,
        )
    raise SchedulerError(
        f"{found.controller} does not answer ({found.said}); nothing submitted: try again, or --cluster local "
        f"to run on this machine"
    )
