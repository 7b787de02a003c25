"""``hpc-hsdp status`` as a list of sections (:class:`~hpc_hsdp.rundir.status_section.StatusSection`):
the job's own, declared here (its state, the scheduler's note, its step, its pace, its slow
ranks, its failure, its run directory), and each run-directory record's, declared beside it in
``rundir/``. :data:`SECTIONS` lists them in the order the text shows them; :data:`JSON_ORDER`
in the order of ``--json``'s keys. :func:`run_facts` and :func:`step_text` are shared with
``submit --wait``'s live line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_hsdp.rundir.checkpointing.store_record import CHECKPOINT_STORE_SECTION
from hpc_hsdp.rundir.layout import nodes_by_rank
from hpc_hsdp.rundir.lifecycle import attempts
from hpc_hsdp.rundir.lifecycle.provenance_record import CODE_SECTION, VERSIONS_SECTION
from hpc_hsdp.rundir.observation.fabric_check_record import CHECK_SECTION
from hpc_hsdp.rundir.observation.flight_recorder import HANG_SECTION
from hpc_hsdp.rundir.observation.replica_membership import MEMBERSHIP_SECTION
from hpc_hsdp.rundir.observation.stacks import HANG_STACKS_SECTION
from hpc_hsdp.rundir.observation.tracker_runs import TRACKERS_OFF_SECTION
from hpc_hsdp.rundir.status_section import StatusSection
from hpc_hsdp.rundir.training.evals import EVALS_SECTION
from hpc_hsdp.rundir.training.metrics import COMPILE_SECTION, latest_eval
from hpc_hsdp.rundir.training.pace import progress_of
from hpc_hsdp.rundir.training.staging_record import STAGING_SECTION
from hpc_hsdp.rundir.training.stragglers import persistent
from hpc_hsdp.scheduler.status import JobStatus
from hpc_hsdp.submit_host.handle import JobHandle

LIVE_PROBES = 5
"""status and submit --wait name the ranks that were slow in at least half of this many latest probes."""


def step_text(metrics: dict | None, total_steps: int | None = None, last_eval: tuple[int, float] | None = None) -> str:
    """``step 12/20 loss 5.5022 eval 5.61 (step 10) 5769 tok/s`` from a metrics.jsonl record
    ('' without one); ``last_eval``: the latest (step, eval loss) when the record has none."""
    if not metrics or metrics.get("step") is None:
        return ""
    text = f"step {metrics['step']}" + (f"/{total_steps}" if total_steps else "")
    if isinstance(metrics.get("loss"), (int, float)):
        text += f" loss {metrics['loss']:.4f}"
    if isinstance(metrics.get("eval_loss"), (int, float)):
        text += f" eval {metrics['eval_loss']:.4f}"
    elif last_eval is not None and last_eval[0] <= metrics["step"]:
        text += f" eval {last_eval[1]:.4f} (step {last_eval[0]})"
    if isinstance(metrics.get("tokens_per_s"), (int, float)):
        text += f" {metrics['tokens_per_s']:.0f} tok/s"
    return text


def run_facts(handle, status=None, *, total_steps: int | None = None) -> dict:
    """What a person watching the job wants besides its state, from the newest metrics: the
    last step, speed, ETA against the time left (SLURM), the slow rank or node in words.
    ``total_steps``: the job's own, where the caller knows it (submit --wait)."""
    run_dir = Path(handle.record.run_dir)
    records = handle.recent_metrics()
    attempt = attempts.read_attempt(run_dir) or {}
    if _before(attempt, handle.record):  # a resumed run's previous job: its steps, its pace are not this job's
        last_step = records[-1].get("step") if records else 0
        attempt = {"total_steps": total_steps, "start_step": last_step if isinstance(last_step, int) else 0}
    running = status is None or (status.state.split()[0] == "RUNNING" and status.current)
    limits = handle.time_limits() if running else None  # no second wait on a controller that did not answer
    left, limit = limits if limits else (None, None)
    progress = progress_of(
        records,
        total_steps=attempt.get("total_steps"),
        attempt_start_step=attempt.get("start_step") or 0,
        time_left_s=left,
        time_limit_s=limit,
    )
    probes = [r for r in records if isinstance(r.get("stragglers"), dict)]
    nodes = nodes_by_rank(run_dir)
    found = persistent([r["stragglers"] for r in probes[-LIVE_PROBES:]], nodes)
    slow = f"{found[0]} (in {found[1]} of the last {found[2]} probes)" if found else None
    return {
        "last": records[-1] if records else None,
        "total_steps": attempt.get("total_steps"),
        "progress": progress,
        "stragglers": slow,
        "straggler_step": probes[-1]["step"] if probes else None,
    }


def _before(attempt: dict, record) -> bool:
    """attempt.json was written by a job started before this one was submitted (a resume's previous job)."""
    started = attempt.get("started_at")
    return (
        isinstance(started, (int, float))
        and isinstance(record.submitted_at, (int, float))
        and (started < record.submitted_at)
    )


def failure_of(handle, status) -> str | None:
    """For a job that failed: which rank failed first and how, with the last lines of its
    log (None while it runs, once it completed or was cancelled, or when no log says)."""
    if not status.finished or status.state.split()[0] in ("COMPLETED", "CANCELLED"):
        return None
    return handle.failure_summary() or None


@dataclass(frozen=True, kw_only=True)
class JobView:
    """A job as ``status`` shows it: its handle, what its scheduler said, the facts of its run."""

    handle: JobHandle
    status: JobStatus
    facts: dict

    @classmethod
    def of(cls, handle: JobHandle) -> JobView:
        status = handle.status()
        return cls(handle=handle, status=status, facts=run_facts(handle, status))

    @property
    def run_dir(self) -> str:
        return self.handle.record.run_dir

    @property
    def last_metrics(self) -> dict | None:
        return self.facts["last"]


def _job_line(job: JobView) -> list[str]:
    st = job.status
    return [
        f"job {job.handle.job_id} ({job.handle.record.cluster}): {st.state}"
        + ("" if st.current else " (not current: see below)")
        + (f", exit {st.exit_code}" if st.exit_code else "")
        + (f", reason {st.reason}" if st.reason else "")
        + f", restarts {st.restarts}"
    ]


JOB_SECTION: StatusSection[JobView, JobView] = StatusSection(
    name="job",
    read=lambda job: job,
    lines=_job_line,
    fields=lambda job: {
        "job_id": job.handle.job_id,
        "cluster": job.handle.record.cluster,
        "state": job.status.state,
        "exit_code": job.status.exit_code,
        "restarts": job.status.restarts,
        "reason": job.status.reason,
    },
)
SCHEDULER_SECTION: StatusSection[JobView, JobStatus] = StatusSection(
    name="scheduler",
    read=lambda job: job.status,
    lines=lambda st: [f"scheduler: {st.note}"] if st.note else [],
    fields=lambda st: st.to_dict(),
)


def _last_step(job: JobView) -> tuple[dict | None, int | None, tuple[int, float] | None]:
    """The newest metrics record, the job's steps, and the latest eval loss where the record has none."""
    metrics = job.last_metrics
    last_eval = None if metrics is None or "eval_loss" in metrics else latest_eval(job.run_dir)
    return metrics, job.facts["total_steps"], last_eval


STEP_SECTION: StatusSection[JobView, tuple[dict | None, int | None, tuple[int, float] | None]] = StatusSection(
    name="step",
    read=_last_step,
    lines=lambda found: _prefixed("last", step_text(*found)),
    fields=lambda found: {"last_step": found[0], "total_steps": found[1]},
)


def _prefixed(label: str, words: str | None) -> list[str]:
    return [f"{label} {words}"] if words else []


def _time_lines(job: JobView) -> list[str]:
    if job.status.finished:
        return []
    timing = job.facts["progress"].words()
    if timing:
        return [f"time: {timing}"]
    if not job.handle.backend.has_time_limits:
        return [f"time: no time limit ({job.handle.backend.title})"]
    return []


TIME_SECTION: StatusSection[JobView, JobView] = StatusSection(
    name="time",
    read=lambda job: job,
    lines=_time_lines,
    fields=lambda job: {"progress": job.facts["progress"].to_dict()},
)
SLOW_SECTION: StatusSection[JobView, dict] = StatusSection(
    name="slow",
    read=lambda job: job.facts,
    lines=lambda facts: (
        [f"slow: {facts['stragglers']} (step {facts['straggler_step']})"] if facts["stragglers"] else []
    ),
    fields=lambda facts: {"stragglers": facts["stragglers"]},
)
FAILURE_SECTION: StatusSection[JobView, str | None] = StatusSection(
    name="failure",
    read=lambda job: failure_of(job.handle, job.status),
    lines=lambda failure: [f"failure: {failure}"] if failure else [],
    fields=lambda failure: {"failure": failure},
)
RUN_DIRECTORY_SECTION: StatusSection[JobView, str] = StatusSection(
    name="run-directory",
    read=lambda job: job.run_dir,
    lines=lambda run_dir: [f"run directory: {run_dir}"],
    fields=lambda run_dir: {"run_dir": run_dir},
)

SECTIONS: tuple[StatusSection[JobView, Any], ...] = (
    JOB_SECTION,
    SCHEDULER_SECTION,
    STEP_SECTION,
    COMPILE_SECTION,
    TIME_SECTION,
    SLOW_SECTION,
    attempts.RESTARTS_SECTION,
    MEMBERSHIP_SECTION,
    STAGING_SECTION,
    CHECKPOINT_STORE_SECTION,
    CHECK_SECTION,
    EVALS_SECTION,
    HANG_SECTION,
    HANG_STACKS_SECTION,
    TRACKERS_OFF_SECTION,
    FAILURE_SECTION,
    CODE_SECTION,
    VERSIONS_SECTION,
    RUN_DIRECTORY_SECTION,
)
"""Every section of ``status``, in the order its text shows them."""

JSON_ORDER = (
    "job",
    "run-directory",
    "step",
    "time",
    "slow",
    "restarts",
    "membership",
    "hang",
    "trackers-off",
    "compile",
    "failure",
    "code",
    "versions",
    "evals",
    "staging",
    "hang-stacks",
    "checkpoint-store",
    "scheduler",
)
"""The sections with keys in ``status --json``, in the order of those keys: the order the dump
had before its sections were declared, so that its bytes stay what scripts have read."""


def status_lines(job: JobView) -> list[str]:
    """``status``'s text: every section's lines, every record read before the first line."""
    found = [(section, section.read(job)) for section in SECTIONS]
    return [line for section, value in found for line in section.lines(value)]


def status_fields(job: JobView) -> dict[str, object]:
    """``status --json``: every section's keys, in :data:`JSON_ORDER`."""
    by_name = {section.name: section for section in SECTIONS}
    fields: dict[str, object] = {}
    for name in JSON_ORDER:
        section = by_name[name]
        if section.fields is not None:
            fields.update(section.fields(section.read(job)))
    return fields
