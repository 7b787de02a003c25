"""Everything hpc-hsdp takes from submitit beyond its public classes, in this one module.

``pyproject.toml`` pins submitit to the versions this is tested with (1.5.4 and its 1.5
successors; ``tests/fast/test_backends.py`` checks that each hook below is still there, with its
parameters). Before widening the pin, read these again in the new version's source:

- ``submitit.SlurmExecutor``'s private hooks, overridden by :class:`RenderedScriptExecutor`
  (``submitit/core/core.py``, ``PicklingExecutor._submit_command`` calls them in this order):
  ``_make_submission_file_text(command, uid)`` (the sbatch text: here the script ``render``
  made), ``_make_submission_command(submission_file_path)`` (``sbatch PATH``: here under
  coreutils' ``timeout``) and ``_num_tasks()`` (how many tasks' result files the job object
  waits for); and its class attribute ``job_class`` (the job object made from sbatch's answer).
- ``submitit.SlurmJob``'s private parts that :class:`FlexibleSlurmJob` reads: ``_sub_jobs``
  (one job object per task), ``watcher.is_done(job_id, mode="force")`` and a sub-job's
  ``paths.result_pickle``.
- ``submitit.core.utils``: ``FailedJobError`` (sbatch failed; its ``__cause__`` carries the exit
  code), and ``DelayedSubmission``, ``JobPaths`` and ``pickle_load``, with which the local
  emulator writes a job's call and reads its tasks' results as submitit's own files, so that
  one task runner serves both schedulers.

That task runner, ``submitit.core.submission.process_job``, is called on the task by
:mod:`hpc_hsdp.task.submitit_job` (the runtime imports nothing of the submitting side).
Imported only where a job is submitted, or an emulated job's results are read.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import submitit
from submitit.core import utils as submitit_utils

from hpc_hsdp.scheduler.backends.slurm_command import (
    TIMED_OUT,
    SchedulerError,
    SchedulerTimeout,
    bounded_command,
    daemon_of,
    run_slurm,
    slurm_timeout_s,
)


class RenderedScriptExecutor(submitit.SlurmExecutor):
    """submitit, sending the script ``render`` made for a job (instead of its own sbatch text),
    with sbatch bounded to ``timeout_s``; the job object waits for ``num_tasks`` tasks' results."""

    def __init__(
        self,
        folder: str | Path,
        *,
        script: str,
        num_tasks: int,
        timeout_s: float,
        job_class: type[submitit.SlurmJob] | None = None,
    ) -> None:
        super().__init__(folder=folder)
        self.script = script
        self.num_tasks = num_tasks
        self.timeout_s = timeout_s
        if job_class is not None:
            self.job_class = job_class

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return self.script

    def _num_tasks(self) -> int:
        return self.num_tasks

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return bounded_command(super()._make_submission_command(submission_file_path), timeout_s=self.timeout_s)


def submit_rendered(spec, script: str, func: Callable, args: tuple, kwargs: dict):
    """sbatch ``script`` (the rendered job of ``spec``) through submitit, each task running
    ``func(*args, **kwargs)``; submitit's job object. sbatch's refusal is a
    :class:`SchedulerError` with what it said; no answer in time a :class:`SchedulerTimeout`."""
    limit = slurm_timeout_s()
    num_tasks = spec.world_size if spec.launch.launcher == "srun" else spec.nodes
    executor = RenderedScriptExecutor(
        spec.log_dir,
        script=script,
        num_tasks=num_tasks,
        timeout_s=limit,
        job_class=FlexibleSlurmJob if spec.flexible else None,  # SLURM may grant fewer nodes
    )
    try:
        job = executor.submit(functools.partial(func, **kwargs), *args)
        if isinstance(job, FlexibleSlurmJob):
            job.tasks_per_node, job.min_nodes = num_tasks // spec.nodes, spec.min_nodes
        return job
    except submitit_utils.FailedJobError as exc:  # sbatch's own stderr is inside
        if getattr(exc.__cause__, "returncode", None) == TIMED_OUT:
            raise SchedulerTimeout(
                f"{daemon_of('sbatch')} did not answer sbatch within {limit:g} s; the job may be queued all the "
                f"same: look with squeue --me before submitting again",
                command="sbatch",
                timeout_s=limit,
            ) from None
        message = " ".join(str(exc).split())
        raise SchedulerError(f"sbatch refused the job: {message[-400:]}") from None


# ----------------------------------------------------------------------------- a flexible allocation


def last_run_nodes(job_id: str, *, timeout_s: float = 30.0) -> int | None:
    """How many nodes the job's last run had (sacct: a requeued job's newest record), None when unknown."""
    try:
        shown = run_slurm(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "NNodes"], timeout_s=timeout_s)
    except SchedulerError:
        return None
    counts = [line.strip() for line in shown.stdout.splitlines() if line.strip().isdigit()]
    return int(counts[-1]) if shown.returncode == 0 and counts else None


class FlexibleSlurmJob(submitit.SlurmJob):
    """submitit's job object for a flexible allocation (``--nodes MIN-MAX``): ``results()`` and
    ``exception()`` of the tasks of the job's last run, which had as many nodes as SLURM granted
    (``tasks_per_node`` of them each), not of every task at the most nodes. (submitit makes one
    sub-job per task at the most nodes and waits for each one's result file; the tasks of the
    nodes SLURM did not grant never ran.)"""

    tasks_per_node = 0
    """Set on the job by :func:`submit_rendered`; 0: every task, as submitit does."""
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


# ----------------------------------------------------------------------------- submitit's files, for the emulator


def dump_call(folder: str | Path, job_id: str, func: Callable, args: tuple, kwargs: dict) -> Path:
    """Write ``func(*args, **kwargs)`` where submitit's task runner loads job ``job_id``'s call."""
    path = submitit_utils.JobPaths(folder, job_id=job_id).submitted_pickle
    submitit_utils.DelayedSubmission(functools.partial(func, **kwargs), *args).dump(path)
    return path


def result_path(folder: str | Path, job_id: str, task: int) -> Path:
    """Where submitit's task runner leaves task ``task``'s outcome."""
    return submitit_utils.JobPaths(folder, job_id=job_id, task_id=task).result_pickle


def load_result(path: Path) -> tuple[str, object]:
    """A task's outcome as submitit's task runner pickled it: (``success`` or ``error``, value or traceback)."""
    return submitit_utils.pickle_load(path)
