"""The one restart policy of a job that restarts itself: the watchdog after a hang, the survivors
of a lost node, preemption's warning signal and the fabric check's verdict all requeue through it.

Restarts after failures (:data:`hpc_hsdp.rundir.checkpointing.state.FAILURE_REASONS`) are bounded by
``--max-restarts``, counted in ``restarts.jsonl`` (the record of why each attempt ended, which the
policy writes); a requeue on the warning signal or for the check's verdict is not a failure and is
not bounded. The requeue itself is the job's scheduler's
(:class:`~hpc_hsdp.scheduler.backends.job_environment.JobEnvironment`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hpc_hsdp.rundir.checkpointing.state import FAILURE_REASONS, failure_restarts, record_restart
from hpc_hsdp.rundir.lifecycle.attempts import read_restarts
from hpc_hsdp.scheduler.backends.job_environment import JobEnvironment


class RestartPolicy:
    """When the job of ``environment`` requeues itself, within ``max_restarts`` failure restarts;
    ``run_dir``: where the restarts and their causes are recorded (None: nowhere)."""

    def __init__(self, environment: JobEnvironment, *, run_dir: str | Path | None = None, max_restarts: int = 0):
        self.environment = environment
        self.run_dir = run_dir
        self.max_restarts = max_restarts

    def failures(self) -> int:
        """Restarts of this job after failures so far (without a run directory, which records
        their causes: every restart of it)."""
        if self.run_dir is None:
            return self.environment.restart_count
        return failure_restarts(self.run_dir, job_id=self.environment.job_id)

    def spent(self) -> str | None:
        """Why a failure restart is not allowed any more, in words (None: it is)."""
        failures = self.failures()
        if failures < self.max_restarts:
            return None
        return (
            f"not requeued: the job already restarted {failures} times after failures "
            f"(--max-restarts {self.max_restarts})"
        )

    def exceeded(self) -> str | None:
        """Why this attempt must not train at all: the job restarted after failures more often than
        ``--max-restarts`` allows, with their causes (None: it may; without a run directory or a job: always)."""
        job_id = self.environment.job_id
        if self.run_dir is None or not job_id:
            return None
        failures = failure_restarts(self.run_dir, job_id=job_id)
        if failures <= self.max_restarts:
            return None
        causes = "; ".join(
            f"restart {r.get('restart')}: {r.get('detail') or r.get('reason')}"
            for r in read_restarts(self.run_dir)
            if r.get("reason") in FAILURE_REASONS and str(r.get("job_id")) == job_id
        )
        return (
            f"job {job_id} restarted {failures} times after failures, more than --max-restarts "
            f"{self.max_restarts}: not training again ({causes})"
        )

    def next_restart(self) -> str:
        """The failure restart a requeue now would be, in words."""
        return f"failure restart {self.failures() + 1} of at most {self.max_restarts}"

    def record(self, *, reason: str, cause: str, step: int | None = None) -> None:
        """Why this attempt ends (``restarts.jsonl``, the next attempt's line), where there is a run directory."""
        if self.run_dir is not None:
            record_restart(self.run_dir, reason=reason, cause=cause, step=step)

    def requeue(self, *, exclude: Sequence[str] = ()) -> tuple[bool, str]:
        """Requeue the job away from ``exclude``: (requeued, what the scheduler said). Never raises."""
        return self.environment.requeue(exclude=exclude)

    def refused(self, said: str) -> str:
        """A requeue the scheduler refused, in words."""
        return f"scontrol requeue {self.environment.job_id} failed: {said}"
