"""submitit's job object for a flexible allocation (``--nodes MIN-MAX``).

submitit makes one sub-job per task at the most nodes and waits for each one's result file;
when SLURM granted fewer nodes, the tasks of the missing nodes never ran, and ``results()``
would wait for their files and then fail. Imported only where a SLURM job is submitted.
"""

from __future__ import annotations

import submitit

from hpc_hsdp.job.backends.slurm_command import SchedulerError, run_slurm


def last_run_nodes(job_id: str, *, timeout_s: float = 30.0) -> int | None:
    """How many nodes the job's last run had (sacct: a requeued job's newest record), None when unknown."""
    try:
        shown = run_slurm(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "NNodes"], timeout_s=timeout_s)
    except SchedulerError:
        return None
    counts = [line.strip() for line in shown.stdout.splitlines() if line.strip().isdigit()]
    return int(counts[-1]) if shown.returncode == 0 and counts else None


class FlexibleSlurmJob(submitit.SlurmJob):
    """``results()`` and ``exception()`` of the tasks of the job's last run, which had as many
    nodes as SLURM granted (``tasks_per_node`` of them each), not of every task at the most nodes."""

    tasks_per_node = 0
    """Set on the job by :mod:`hpc_hsdp.job.backends.slurm` when it submits; 0: every task, as submitit does."""
    min_nodes = 0
    """The fewest nodes of the range (set with ``tasks_per_node``)."""

    def done(self, force_check: bool = False) -> bool:
        """submitit asks SLURM (sacct) about a task without a result file only now and then (up to a
        minute): once the tasks of the fewest nodes wrote theirs, the others may never exist, so ask now."""
        if not self._sub_jobs or not self.tasks_per_node:
            return super().done(force_check)
        if all(sub_job.paths.result_pickle.exists() for sub_job in self._sub_jobs):
            return True
        fewest = self._sub_jobs[: self.min_nodes * self.tasks_per_node]
        if fewest and all(sub_job.paths.result_pickle.exists() for sub_job in fewest):
            return self.watcher.is_done(self.job_id, mode="force")
        return super().done(force_check)

    def tasks_that_ran(self) -> list:
        """The sub-jobs (one per task) of the last run, once the job is done."""
        self.wait()
        nodes = last_run_nodes(self.job_id) if self.tasks_per_node else None
        if nodes is None:
            return list(self._sub_jobs)
        return list(self._sub_jobs[: nodes * self.tasks_per_node])

    def results(self) -> list:
        if not self._sub_jobs:
            return super().results()
        return [sub_job.result() for sub_job in self.tasks_that_ran()]

    def exception(self):
        if not self._sub_jobs:
            return super().exception()
        raised = [e for e in (sub_job.exception() for sub_job in self.tasks_that_ran()) if e is not None]
        return raised[0] if raised else None
