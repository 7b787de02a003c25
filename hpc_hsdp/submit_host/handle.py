"""A submitted job, found again from its record (``<run-dir>/job.json``) in any shell: its
state, where it writes, its logs, its time left and its cancel, each asked of the backend of
the scheduler the record names; and the states of many jobs at once."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.rundir.layout import procid_of_rank, rank_of_task
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord, same_dir
from hpc_hsdp.rundir.training.metrics import last_metrics, recent_metrics
from hpc_hsdp.scheduler.backends import backend
from hpc_hsdp.scheduler.backends.base import Backend
from hpc_hsdp.scheduler.failure import failure_summary
from hpc_hsdp.scheduler.status import JobStatus


class JobHandle:
    """State, logs and cancel of one submitted job, whichever scheduler runs it."""

    def __init__(self, record: JobRecord) -> None:
        self.record = record

    @classmethod
    def find(cls, ref: str) -> JobHandle:
        from hpc_hsdp.rundir.lifecycle.sweep_record import SweepRecord, is_sweep_dir  # noqa: PLC0415

        if is_sweep_dir(ref) and not Path(ref, "job.json").is_file():
            names = [point.name for point in SweepRecord.load(ref).points]
            shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise SpecError(
                f"{ref} is a sweep's directory, not one job's; give one of its points ({shown}): {ref}/<point>"
            )
        return cls(JobRecord.load(ref))

    @property
    def job_id(self) -> str:
        return self.record.job_id

    @cached_property
    def backend(self) -> Backend:
        """The backend of the scheduler that runs the job (the record's ``cluster``)."""
        return backend(self.record.cluster)

    def status(self) -> JobStatus:
        return self.backend.status(self.record)

    def works_in(self) -> Path | None:
        """The logs directory the job writes, as the scheduler itself records it (SLURM: the batch
        log's directory; the emulator: its state file's). None when it does not say (the job left
        the queue, an older state file)."""
        return self.backend.works_in(self.record)

    def runs_elsewhere(self) -> Path | None:
        """Where the job writes, when the scheduler says that is not this run directory (this
        one is a copy, or was moved, or its ``job.json`` names another directory's job); None
        when it is this one, or the scheduler does not say. The scheduler's logs directory must
        lie in the run directory itself: ``job.json``'s own ``logs_dir`` (which anyone who can
        write the directory can point at another run's logs, by path or by symlink) is not asked."""
        return self._elsewhere(self.works_in())

    def _elsewhere(self, logs: Path | None) -> Path | None:
        if logs is None or same_dir(logs.parent, self.record.run_dir):
            return None
        return logs.parent if logs.name == "logs" else logs

    def check_runs_here(self) -> None:
        """Before anything is done to the job (cancel): SpecError, one line, unless the scheduler
        itself says that the job writes in this run directory (:meth:`runs_elsewhere`)."""
        logs = self.works_in()
        if logs is None:
            raise SpecError(
                f"the {self.backend.title} does not say where job {self.job_id} (named by "
                f"{self.record.run_dir}/job.json) writes, so it is not known to be this run's: nothing cancelled; "
                f"see hpc-hsdp status {self.record.run_dir}"
            )
        elsewhere = self._elsewhere(logs)
        if elsewhere is not None:
            raise SpecError(
                f"{self.record.run_dir} is not where job {self.job_id} runs: the scheduler says it writes {elsewhere} "
                f"({self.record.run_dir} is a copy, or was moved); nothing cancelled: cancel it from there "
                f"(hpc-hsdp cancel {elsewhere})"
            )

    def cancel(self) -> None:
        """Cancel the job, once the scheduler says it runs in this run directory (:meth:`check_runs_here`:
        the record may be a copy's, or name another run's job)."""
        self.check_runs_here()
        self.backend.cancel(self.record)

    def last_metrics(self) -> dict | None:
        """The latest record of ``<run-dir>/metrics.jsonl`` (step, loss, tokens_per_s, ...)."""
        return last_metrics(self.record.run_dir)

    def recent_metrics(self, max_bytes: int = 262_144) -> list[dict]:
        """The records in the last ``max_bytes`` of ``<run-dir>/metrics.jsonl`` (a torn line is skipped)."""
        return recent_metrics(self.record.run_dir, max_bytes)

    def time_limits(self) -> tuple[float | None, float | None] | None:
        """(seconds left, time limit per run) of the running job; None where the scheduler has
        no time limits, and when it does not say (pending, ended, UNLIMITED)."""
        return self.backend.time_limits(self.record)

    def procid_of_rank(self, rank: int) -> int:
        """SLURM's task id of a node-major rank, from layout.json (the rank itself before there is one)."""
        procid = procid_of_rank(self.record.run_dir, rank)
        return rank if procid is None else procid

    def log_paths(self, rank: int | None = None) -> list[Path]:
        """Every task's logs, or those of node-major rank ``rank`` (stdout, then stderr)."""
        if rank is None:
            return self.backend.log_paths(self.record)
        if not 0 <= rank < self.record.ntasks:
            raise SpecError(f"--rank {rank} is outside this job's ranks 0-{self.record.ntasks - 1}")
        return self.backend.log_paths(self.record, self.procid_of_rank(rank))

    def rank_of_task(self, task: int) -> int | None:
        """The node-major rank of SLURM task ``task`` (srun launcher), from layout.json."""
        if self.record.launcher != "srun":
            return None
        rank = rank_of_task(self.record.run_dir, task)
        return task if rank is None else rank

    def failure_summary(self, lines: int = 12) -> str:
        """Which rank failed first and how, with the last lines of its log (:func:`~hpc_hsdp.scheduler.failure.failure_summary`)."""
        return failure_summary(Path(self.record.logs_dir), self.job_id, rank_of_task=self.rank_of_task, lines=lines)


def job_statuses(records: list[JobRecord]) -> dict[str, JobStatus]:
    """The status of every job of ``records``, keyed by run directory: each scheduler asked once
    for all of its jobs (SLURM: one ``squeue`` and one ``sacct``)."""
    statuses: dict[str, JobStatus] = {}
    for name in dict.fromkeys(record.cluster for record in records):
        statuses.update(backend(name).statuses([record for record in records if record.cluster == name]))
    return statuses
