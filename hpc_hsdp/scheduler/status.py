"""A job's state: :class:`JobStatus`, and the state of a job from what its scheduler answered.

A state the scheduler gave is recorded as the job's last known one (``<run-dir>/job_state.json``);
when the scheduler is silent, that last known state is shown instead, with who did not answer.
A job seen to end releases its run directory's claim (:mod:`hpc_hsdp.rundir.lifecycle.claim`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from hpc_hsdp.plan.units import duration
from hpc_hsdp.rundir.lifecycle import claim as claims
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.rundir.lifecycle.job_state import is_job_state, load_job_state, save_job_state

TERMINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    state: str
    """The job's state: SLURM's answer; when it did not answer, the last known one (or a final
    state from the accounting), ``UNKNOWN`` without either."""
    exit_code: str | None = None
    restarts: int = 0
    reason: str | None = None
    controller_answered: bool | None = None
    """Whether the SLURM controller answered this query (None: not asked, a local job)."""
    accounting_answered: bool | None = None
    """Whether ``sacct`` answered (None: not asked; the queue said enough)."""
    note: str | None = None
    """In words, when the state is not SLURM's current answer: who did not answer, and what is shown instead."""
    last_known_state: str | None = None
    """The state SLURM last told (``<run-dir>/job_state.json``), when it did not answer now."""
    last_known_at: float | None = None
    """When SLURM told ``last_known_state`` (epoch seconds)."""

    def __post_init__(self) -> None:
        if not is_job_state(self.state):  # what no scheduler says: a state file's ``""``, say
            object.__setattr__(self, "state", "UNKNOWN")

    @property
    def finished(self) -> bool:
        return self.state.split()[0] in TERMINAL

    @property
    def current(self) -> bool:
        """The state is what the scheduler just said (not a last known one)."""
        return self.note is None

    def last_known_age_s(self, now: float | None = None) -> float | None:
        if self.last_known_at is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.last_known_at)

    def to_dict(self, now: float | None = None) -> dict:
        age = self.last_known_age_s(now)
        return {
            "controller_answered": self.controller_answered,
            "accounting_answered": self.accounting_answered,
            "scheduler_note": self.note,
            "last_known_state": self.last_known_state,
            "last_known_age_s": None if age is None else round(age, 1),
        }


ACTIVE_STATES = (
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "RESIZING",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SIGNALING",
    "STAGE_OUT",
)


@dataclass(frozen=True, kw_only=True)
class SchedulerAnswers:
    """What one round of queries (one squeue, one sacct) said about some jobs."""

    queued: dict[str, tuple[str, str | None]]
    controller: str | None
    """Why the controller did not answer (None: it answered)."""
    accounted: dict[str, tuple[str, str]]
    accounting: str | None
    """Why the accounting did not answer (None: it answered, or was not asked)."""
    accounting_asked: bool


def status_from(record: JobRecord, answers: SchedulerAnswers, *, restarts: int | None = None, now: float) -> JobStatus:
    """One job's status from a round of answers; recorded as its last known state when it is
    the scheduler's current one, and completed with the last known one when it is not."""
    job_id = record.job_id
    known = load_job_state(record.run_dir, job_id)
    known_restarts = int(known.get("restarts") or 0) if known else 0
    controller_answered = answers.controller is None
    accounting_answered = None if not answers.accounting_asked else answers.accounting is None
    current: JobStatus | None = None
    if job_id in answers.queued:
        state, reason = answers.queued[job_id]
        current = JobStatus(
            state=state,
            reason=reason,
            restarts=known_restarts if restarts is None else restarts,
            controller_answered=controller_answered,
            accounting_answered=accounting_answered,
        )
    elif job_id in answers.accounted and (answers.controller is None or answers.accounted[job_id][0] in TERMINAL):
        # out of the queue and in the accounting; or the accounting holds its end (final, whoever is silent)
        state, code = answers.accounted[job_id]
        current = JobStatus(
            state=state,
            exit_code=code,
            restarts=known_restarts if restarts is None else restarts,
            controller_answered=controller_answered,
            accounting_answered=accounting_answered,
        )
    elif answers.controller is None and answers.accounting is None:
        return JobStatus(
            state="UNKNOWN",
            restarts=known_restarts,
            reason="no accounting record",
            controller_answered=controller_answered,
            accounting_answered=accounting_answered,
        )
    if current is not None and (answers.controller is None or current.finished):
        save_job_state(
            record.run_dir,
            job_id,
            state=current.state,
            exit_code=current.exit_code,
            restarts=current.restarts,
            reason=current.reason,
            now=now,
            previous=known,
        )
        release_if_ended(record, current)
        if answers.controller is None:
            return current
        return replace(current, note=f"{answers.controller}; the accounting has the job's end")
    # not SLURM's current answer: say who did not answer and show the last known state
    silent = "; ".join(why for why in (answers.controller, answers.accounting) if why is not None)
    accounting_state = answers.accounted.get(job_id, (None,))[0]
    # the controller answered that the job left the queue: it ended, but how is unknown
    state = "UNKNOWN" if answers.controller is None else (known or {}).get("state") or accounting_state or "UNKNOWN"
    if known:
        shown = f"last known state {known['state']}, {_age_words(now - float(known.get('at') or now))} ago"
    elif accounting_state:
        shown = f"no state recorded before; the accounting says {accounting_state}, which may be behind"
    else:
        shown = "no state recorded before"
    return JobStatus(
        state=state,
        exit_code=(known or {}).get("exit_code"),
        restarts=known_restarts,
        reason=(known or {}).get("reason"),
        note=f"{silent} ({shown})",
        last_known_state=(known or {}).get("state"),
        last_known_at=float(known["at"]) if known and known.get("at") else None,
        controller_answered=controller_answered,
        accounting_answered=accounting_answered,
    )


def _age_words(seconds: float) -> str:
    return duration(max(0.0, seconds))


def release_if_ended(record: JobRecord, status: JobStatus) -> JobStatus:
    """``status``, after the job's claim of its run directory was released when it has ended
    (as SLURM ends a job: the run directory is free again)."""
    if status.finished:
        claims.release_claim(record.run_dir, record.job_id, ended=status.state)
    return status
