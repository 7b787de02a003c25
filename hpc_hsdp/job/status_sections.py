"""The sections of ``hpc-hsdp status``: the job's own (its state, its step, its pace, its failure),
and what ``submit --wait``'s live line shares with them (:func:`run_facts`, :func:`step_text`)."""

from __future__ import annotations

from pathlib import Path

from hpc_hsdp.rundir import attempts
from hpc_hsdp.rundir.flight_recorder import hang_words
from hpc_hsdp.rundir.layout import nodes_by_rank
from hpc_hsdp.rundir.membership import membership_changes, read_membership
from hpc_hsdp.rundir.pace import progress_of
from hpc_hsdp.rundir.stragglers import persistent
from hpc_hsdp.rundir.tracker_runs import trackers_off

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
    """What a person watching the job wants besides its state: speed, ETA against the time
    left (SLURM), the slow rank or node in words, the restarts and their causes. ``total_steps``:
    the job's own, where the caller knows it (submit --wait)."""
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
    restarts = [
        f"step {r.get('resumed_from_step')}: {attempts.SHORT.get(r.get('reason'), r.get('reason'))}"
        for r in attempts.read_restarts(run_dir)
    ]
    return {
        "membership": membership_changes(read_membership(run_dir)),
        "last": records[-1] if records else None,
        "total_steps": attempt.get("total_steps"),
        "progress": progress,
        "stragglers": slow,
        "straggler_step": probes[-1]["step"] if probes else None,
        "restarts": restarts,
        "hang": hang_words(run_dir),
        "trackers_off": trackers_off(run_dir),
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
