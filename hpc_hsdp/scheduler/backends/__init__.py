"""One backend per scheduler, behind one interface (:class:`~hpc_hsdp.scheduler.backends.base.Backend`):
SLURM (:mod:`.slurm`, through submitit: :mod:`.submitit_hooks`) and the local emulator
(:mod:`.local`). Code above the backends picks one by name (:func:`backend`, with the
``cluster`` a job record holds) and never asks which one it has; which one a new job goes
to is :func:`resolve_cluster`'s choice (``--cluster``).

Importing this package is cheap: a backend's module loads when it is first asked for.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from typing import TYPE_CHECKING

from hpc_hsdp.errors import SchedulerError, SpecError
from hpc_hsdp.job.option_fields import CLUSTERS as OPTION_CLUSTERS
from hpc_hsdp.scheduler.backends.slurm_command import SchedulerTimeout, ping_controller

if TYPE_CHECKING:
    from hpc_hsdp.scheduler.backends.base import Backend
    from hpc_hsdp.scheduler.backends.job_environment import JobEnvironment

BACKEND_NAMES = ("slurm", "local")
"""What a job record's ``cluster`` may say."""
CLUSTERS = OPTION_CLUSTERS
"""``--cluster`` (a config key and an ``hpc_hsdp.submit`` keyword too): ``auto`` and the backends."""


def backend(name: str) -> Backend:
    """The backend of scheduler ``name`` (``slurm`` or ``local``, a job record's ``cluster``)."""
    if name == "slurm":
        from hpc_hsdp.scheduler.backends.slurm import SlurmBackend  # noqa: PLC0415  (loaded when first asked for)

        return SlurmBackend()
    if name == "local":
        from hpc_hsdp.scheduler.backends.local import LocalBackend  # noqa: PLC0415  (loaded when first asked for)

        return LocalBackend()
    raise SpecError(f"scheduler {name[:40]!r} is neither slurm nor local")


def task_backend(env: Mapping[str, str]) -> Backend:
    """The backend whose job this task (with environment ``env``) runs in: the emulator's where it
    marked the job's environment as its own, else SLURM's."""
    from hpc_hsdp.scheduler.emulator.allocation import EMULATOR_VARIABLE  # noqa: PLC0415  (the emulator names its own mark)

    return backend("local" if env.get(EMULATOR_VARIABLE) == "1" else "slurm")


def task_environment(env: Mapping[str, str]) -> JobEnvironment:
    """The job this task (with environment ``env``) runs in, as its backend tells it: job id,
    restart count, requeue, side jobs."""
    return task_backend(env).environment(env)


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
