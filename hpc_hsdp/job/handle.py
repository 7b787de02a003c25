"""A submitted job, found again from its record (``<run-dir>/job.json``) in any shell: its
state, where it writes, its logs, its time left and its cancel; the states of many jobs at once."""

from __future__ import annotations

import time
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.backends.slurm import ask_slurm, slurm_status, time_limits
from hpc_hsdp.job.backends.slurm_command import SchedulerError, SchedulerTimeout, run_slurm
from hpc_hsdp.job.failure import failure_summary, task_index
from hpc_hsdp.job.status import JobStatus, status_from
from hpc_hsdp.plan.slurm_facts import check_job_id
from hpc_hsdp.rundir import claim as claims
from hpc_hsdp.rundir.job_record import JobRecord, same_dir
from hpc_hsdp.rundir.layout import procid_of_rank, rank_of_task
from hpc_hsdp.rundir.metrics import last_metrics, recent_metrics


class JobHandle:
    """State, logs and cancel of one submitted job, SLURM or local."""

    def __init__(self, record: JobRecord) -> None:
        self.record = record

    @classmethod
    def find(cls, ref: str) -> JobHandle:
        return cls(JobRecord.load(ref))

    @property
    def job_id(self) -> str:
        return self.record.job_id

    def status(self) -> JobStatus:
        if self.record.cluster == "local":
            from hpc_hsdp.job.backends.local import LocalJob  # noqa: PLC0415  (the emulator (~25 ms), only for a job it runs)

            info = LocalJob(logs_dir=Path(self.record.logs_dir), job_id=self.job_id).info()
            code = info.get("exit_code")
            status = JobStatus(state=info["state"], exit_code=None if code is None else str(code))
            if status.finished:
                claims.release_claim(self.record.run_dir, self.job_id, ended=status.state)
            return status
        return slurm_status(self.record)

    def works_in(self) -> Path | None:
        """The logs directory the job writes, as the scheduler itself records it: SLURM's
        ``StdOut`` of ``scontrol show job`` (the batch log, in ``<run-dir>/logs``), the emulator's
        state file (the run directory it was launched for). None when it does not say (the job
        left the queue, an older state file)."""
        if self.record.cluster == "local":
            from hpc_hsdp.job.backends.local import LocalJob  # noqa: PLC0415  (the emulator (~25 ms), only for a job it runs)

            info = LocalJob(logs_dir=Path(self.record.logs_dir), job_id=self.job_id).info()
            logs = info.get("logs_dir")
            if not isinstance(logs, str) or not logs:  # a state file of before: its script lies in the logs
                logs = str(Path(info["script"]).parent) if isinstance(info.get("script"), str) else None
            return Path(logs) if logs else None
        try:
            shown = run_slurm(["scontrol", "-o", "show", "job", check_job_id(self.job_id)])
        except SchedulerError:
            return None
        for item in shown.stdout.split():
            if item.startswith("StdOut=") and item[len("StdOut=") :].startswith("/"):
                return Path(item[len("StdOut=") :]).parent
        return None

    def runs_elsewhere(self) -> Path | None:
        """Where the job writes, when the scheduler says that is not this run directory (this
        one is a copy, or was moved); None when it is this one, or the scheduler does not say."""
        logs = self.works_in()
        if logs is None or same_dir(logs, self.record.logs_dir):
            return None
        return logs.parent if logs.name == "logs" else logs

    def cancel(self) -> None:
        """Cancel the job (check :meth:`runs_elsewhere` first: the record may be a copy's)."""
        if self.record.cluster == "local":
            from hpc_hsdp.job.backends.local import LocalJob  # noqa: PLC0415  (the emulator (~25 ms), only for a job it runs)

            LocalJob(logs_dir=Path(self.record.logs_dir), job_id=self.job_id).cancel()
            return
        try:
            done = run_slurm(["scancel", check_job_id(self.job_id)])
        except SchedulerTimeout as exc:
            raise SchedulerError(
                f"{exc}: job {self.job_id} may not be cancelled; see hpc-hsdp status {self.record.run_dir}, "
                f"and try again"
            ) from None
        if done.returncode != 0:
            raise SchedulerError(f"scancel {self.job_id} failed: {' '.join(done.stderr.split())}")

    def last_metrics(self) -> dict | None:
        """The latest record of ``<run-dir>/metrics.jsonl`` (step, loss, tokens_per_s, ...)."""
        return last_metrics(self.record.run_dir)

    def recent_metrics(self, max_bytes: int = 262_144) -> list[dict]:
        """The records in the last ``max_bytes`` of ``<run-dir>/metrics.jsonl`` (a torn line is skipped)."""
        return recent_metrics(self.record.run_dir, max_bytes)

    def time_limits(self) -> tuple[float | None, float | None] | None:
        """(seconds left, time limit per run) of the running job from SLURM; None for the
        local emulator and when SLURM does not say (pending, ended, UNLIMITED)."""
        if self.record.cluster != "slurm":
            return None
        return time_limits(self.job_id)

    def procid_of_rank(self, rank: int) -> int:
        """SLURM's task id of a node-major rank, from layout.json (the rank itself before there is one)."""
        procid = procid_of_rank(self.record.run_dir, rank)
        return rank if procid is None else procid

    def log_paths(self, rank: int | None = None) -> list[Path]:
        logs = Path(self.record.logs_dir)
        if rank is None:
            return sorted(logs.glob(f"{self.job_id}_*_log.out"), key=task_index) + sorted(
                logs.glob(f"{self.job_id}_*_log.err"), key=task_index
            )
        if not 0 <= rank < self.record.ntasks:
            raise SpecError(f"--rank {rank} is outside this job's ranks 0-{self.record.ntasks - 1}")
        procid = self.procid_of_rank(rank)
        return [logs / f"{self.job_id}_{procid}_log.out", logs / f"{self.job_id}_{procid}_log.err"]

    def rank_of_task(self, task: int) -> int | None:
        """The node-major rank of SLURM task ``task`` (srun launcher), from layout.json."""
        if self.record.launcher != "srun":
            return None
        rank = rank_of_task(self.record.run_dir, task)
        return task if rank is None else rank

    def failure_summary(self, lines: int = 12) -> str:
        """Which rank failed first and how, with the last lines of its log (:func:`~hpc_hsdp.job.failure.failure_summary`)."""
        return failure_summary(Path(self.record.logs_dir), self.job_id, rank_of_task=self.rank_of_task, lines=lines)


def job_statuses(records: list[JobRecord]) -> dict[str, JobStatus]:
    """The status of every job of ``records``, keyed by run directory: local jobs from their
    state files, every SLURM job from one ``squeue`` and one ``sacct`` call together (restarts:
    the last known ones)."""
    statuses: dict[str, JobStatus] = {}
    slurm = [record for record in records if record.cluster == "slurm"]
    for record in records:
        if record.cluster != "slurm":
            try:
                statuses[record.run_dir] = JobHandle(record).status()
            except (OSError, ValueError) as exc:  # a broken state file is shown, not fatal
                statuses[record.run_dir] = JobStatus(state="UNKNOWN", reason=f"{type(exc).__name__}: {exc}"[:200])
    if slurm:
        answers = ask_slurm(sorted({record.job_id for record in slurm}))
        now = time.time()
        for record in slurm:
            statuses[record.run_dir] = status_from(record, answers, now=now)
    return statuses
