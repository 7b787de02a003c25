"""A running job's scheduler as its task (or its batch shell) sees it, one per backend, as
submitit's ``JobEnvironment``: the job's id, how often the scheduler restarted it, a requeue
(away from some nodes), the node range put back after the scheduler's own requeue, and side jobs.

The task asks :func:`hpc_hsdp.scheduler.backends.task_environment` for its job's, and never reads the
scheduler's variables itself. This one is the emulator's (and any scheduler's that requeues
nothing); SLURM's is :class:`hpc_hsdp.scheduler.backends.slurm_task.SlurmJobEnvironment`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

JOB_ID_VARIABLE = "SLURM_JOB_ID"
"""Where a job's id reaches its processes (the emulator gives its jobs SLURM's variables)."""
RESTART_COUNT_VARIABLE = "SLURM_RESTART_COUNT"


class JobEnvironment:
    """The job this process runs in, as its scheduler (``backend``) knows it; ``env``: the process's environment."""

    def __init__(self, backend, env: Mapping[str, str]) -> None:
        self.backend = backend
        self.env = env

    @property
    def job_id(self) -> str:
        """The job's id ("" outside a job)."""
        return self.env.get(JOB_ID_VARIABLE, "")

    @property
    def restart_count(self) -> int:
        """How often the scheduler restarted this job, for any reason (a requeue, a node failure,
        a preemption): 0 on its first run. Restarts after failures alone, which ``--max-restarts``
        bounds, are :meth:`hpc_hsdp.scheduler.restart_policy.RestartPolicy.failures`."""
        try:
            return int(self.env.get(RESTART_COUNT_VARIABLE) or 0)
        except ValueError:
            return 0

    @property
    def requeues(self) -> bool:
        """The job can requeue itself from inside (:meth:`requeue` asks the scheduler)."""
        return False

    def requeue(self, *, exclude: Sequence[str] = ()) -> tuple[bool, str]:
        """Requeue the job from inside it, away from the nodes ``exclude``: (requeued, what the
        scheduler said). Never raises."""
        return False, f"the {self.backend.title} requeues nothing: resubmit with the same --run-dir to resume"

    def requeue_words(self) -> str:
        """How :meth:`requeue` asks the scheduler, in words for the log."""
        return "no requeue"

    def keeps_node_range(self) -> bool:
        """The job's node range must be put back after the scheduler requeued it itself (:meth:`restore_node_range`)."""
        return False

    def restore_node_range(self) -> tuple[bool, str]:
        """After the scheduler itself requeued the job, put its node range back: (restored, what
        the scheduler said); (False, "") where there is none to restore. Never raises."""
        return False, ""

    def requeues_on_node_failure(self) -> tuple[bool, float]:
        """(whether the scheduler itself requeues this job when one of its nodes dies, how long
        after the node's last answer it notices)."""
        return False, 0.0

    def submit_side_job(
        self, argv: Sequence[str], *, name: str, output: Path, env: Mapping[str, str]
    ) -> tuple[str | None, str | None]:
        """``argv`` as a small job of its own that the training never waits for (an eval job),
        output appended to ``output``, with environment ``env``: (job id, None) or (None, why not)."""
        return self.backend.submit_side_job(argv, name=name, output=output, env=env, job_env=self.env)
