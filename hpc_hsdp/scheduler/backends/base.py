"""What every scheduler backend does, as the code above the backends sees it.

A backend is picked by name (:func:`hpc_hsdp.scheduler.backends.backend`, from the ``cluster`` a
:class:`~hpc_hsdp.rundir.lifecycle.job_record.JobRecord` records), never asked which one it is: what
differs between schedulers is a method here, or a fact stated by a class attribute.
"""

from __future__ import annotations

import subprocess
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from hpc_hsdp.errors import SchedulerError
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.scheduler.backends.job_environment import JobEnvironment
from hpc_hsdp.scheduler.failure import task_index
from hpc_hsdp.scheduler.status import JobStatus


class Backend(ABC):
    """One scheduler: submit a job, the statuses of many jobs at once, cancel, where a job
    writes and its logs, requeue."""

    name: ClassVar[str]
    """What a job record's ``cluster`` says (``slurm``, ``local``)."""
    title: ClassVar[str]
    """The scheduler in words, for messages (``SLURM``, ``local emulator``)."""
    has_time_limits: ClassVar[bool]
    """Its jobs run within a time limit (:meth:`time_limits` may say one)."""
    separate_machines: ClassVar[bool]
    """Each node of a job is a machine of its own (not this one): its daemons can be asked about it."""
    requeues: ClassVar[bool]
    """A job can requeue itself from inside (:meth:`requeue` asks the scheduler; else it returns None)."""

    @abstractmethod
    def submit(self, spec, script: str, func: Callable, args: tuple, kwargs: dict) -> tuple[str, Any]:
        """Submit ``script`` (the rendered job of ``spec``), each task running ``func(*args, **kwargs)``;
        (job id, the submitit-style job object: ``job_id``, ``state``, ``done()``, ``results()`` ...)."""

    def submit_array(
        self, specs, script: str, script_path: Path, *, parallelism: int | None, indices: list[int]
    ) -> str:
        """Submit a sweep's job array (``script``, written at ``script_path``): task ``indices[k]`` runs
        the point of ``specs[k]``, at most ``parallelism`` at once; the array's job id (point i: ``<id>_<i>``)."""
        raise SchedulerError(f"the {self.title} runs no job arrays; submit each point of the sweep on its own")

    def max_array_size(self) -> int | None:
        """The most tasks one job array may have (SLURM's ``MaxArraySize``); None: no bound known."""
        return None

    @abstractmethod
    def statuses(self, records: list[JobRecord]) -> dict[str, JobStatus]:
        """The status of every job of ``records`` (all of this backend), keyed by run directory,
        in as few questions to the scheduler as it allows."""

    def status(self, record: JobRecord) -> JobStatus:
        """The status of one job (a backend may say more of one job than of many: its restarts)."""
        return self.statuses([record])[record.run_dir]

    @abstractmethod
    def cancel(self, record: JobRecord) -> None:
        """Cancel the job (:class:`~hpc_hsdp.errors.SchedulerError` when the scheduler refused)."""

    def cancel_array(self, job_id: str, records: list[JobRecord]) -> None:
        """Cancel a job array (``job_id``), of which ``records`` are the tasks not ended: each one."""
        for record in records:
            self.cancel(record)

    @abstractmethod
    def works_in(self, record: JobRecord) -> Path | None:
        """The logs directory the job writes, as the scheduler itself records it; None when it
        does not say (the job left the queue, an older record)."""

    def time_limits(self, record: JobRecord) -> tuple[float | None, float | None] | None:
        """(seconds left, time limit per run) of the running job; None when the scheduler does not say."""
        return None

    def log_paths(self, record: JobRecord, procid: int | None = None) -> list[Path]:
        """The logs of the job's tasks (every task's stdout, then every task's stderr), or of task
        ``procid``: the ``--output``/``--error`` patterns of the rendered script, which both
        SLURM and the emulator expand."""
        logs = Path(record.logs_dir)
        if procid is None:
            return sorted(logs.glob(f"{record.job_id}_*_log.out"), key=task_index) + sorted(
                logs.glob(f"{record.job_id}_*_log.err"), key=task_index
            )
        return [logs / f"{record.job_id}_{procid}_log.out", logs / f"{record.job_id}_{procid}_log.err"]

    def environment(self, env: Mapping[str, str]) -> JobEnvironment:
        """The job a process with environment ``env`` runs in, as this scheduler tells it to its
        task: job id, restart count, requeue, side jobs (:mod:`~hpc_hsdp.scheduler.backends.job_environment`)."""
        return JobEnvironment(self, env)

    @abstractmethod
    def requeue(self, job_id: str) -> tuple[bool, str] | None:
        """Requeue the job, from inside it: (requeued, what the scheduler said); None where this
        scheduler has no requeue (the job is not asked)."""

    def check_partition(self, spec) -> None:
        """A ``--partition`` this scheduler does not have: a
        :class:`~hpc_hsdp.errors.SchedulerError` naming the ones it has (here:
        a scheduler without partitions, which has nothing to check)."""
        return None

    @abstractmethod
    def fp8_refusal(self, spec) -> str | None:
        """Why ``--precision fp8`` cannot train on the GPUs this scheduler would give ``spec``'s
        tasks (None: it may, or they cannot be told here)."""

    def submit_side_job(
        self, argv: Sequence[str], *, name: str, output: Path, env: Mapping[str, str], job_env: Mapping[str, str]
    ) -> tuple[str | None, str | None]:
        """From inside a job (its environment ``job_env``), start ``argv`` as a small job of its own
        that the training never waits for (an eval job), with environment ``env``: (job id, None) or
        (None, why not). Never raises. ``argv`` writes its own output into ``output`` (a file of the
        run directory, opened without following a symlink): the scheduler's own output file is
        ``/dev/null``, as sbatch's ``--output`` would follow a symlink planted there. Here: a
        detached process of this machine (the emulator's way, and any scheduler's outside a job)."""
        return start_detached(argv, output=output, env=env)

    def run_on_nodes(
        self, record: JobRecord, nodes: Sequence[str], argv: Sequence[str], *, timeout_s: float
    ) -> tuple[str, str]:
        """Run ``argv`` once on each of ``nodes`` of the running job, beside its tasks and as its user
        (``hpc-hsdp stacks``): (stdout, stderr), the nodes' output together. Here: once, on this
        machine (the emulator's nodes are its processes). SchedulerError when it cannot run."""
        return run_here(argv, timeout_s=timeout_s)

    def on_node_command(self, record: JobRecord, node: str, argv: Sequence[str]) -> list[str]:
        """The command that runs ``argv`` interactively (stdin and stdout passed through) on ``node``
        of the running job (``hpc-hsdp debug``). Here: ``argv`` itself."""
        return list(argv)

    def reachable_here(self) -> bool:
        """Whether this machine can ask the scheduler about its jobs (a job it did not answer
        about may well still run)."""
        return True


def run_here(argv: Sequence[str], *, timeout_s: float) -> tuple[str, str]:
    """``argv`` on this machine for at most ``timeout_s`` seconds: (stdout, stderr)."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"{Path(argv[0]).name} did not end within {timeout_s:.0f} s") from None
    except OSError as exc:
        raise SchedulerError(f"{argv[0]} could not be run ({exc.strerror or exc})") from None
    return proc.stdout, proc.stderr


DETACHED: list[subprocess.Popen] = []
"""The detached processes this one started (kept so that Python reaps them when they end)."""


def start_detached(argv: Sequence[str], *, output: Path, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """``argv`` as a process of a session of its own (a job's end, its process group killed, does
    not end it), in the directory of ``output``, which it writes itself (its own output goes to
    ``/dev/null``): (``local-PID``, None) or (None, why not)."""
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=dict(env),
            cwd=output.parent,
            start_new_session=True,
        )
    except OSError as exc:
        return None, f"{argv[0]} could not be started ({exc.strerror or exc})"
    DETACHED.append(proc)
    return f"local-{proc.pid}", None
