"""The life of a run directory across requeues: ``attempt.json`` and ``restarts.jsonl`` (no torch).

Rank 0 of the built-in loop keeps them; ``report``, ``status`` and ``runs`` read them.
Another component that knows why an attempt ends (a watchdog that found a hang) writes
its cause with :func:`end_attempt`; the next attempt turns it into a restart line.

``<run-dir>/attempt.json`` (rewritten atomically), the current or last attempt::

    {"format": "hpc-hsdp-attempt", "version": 1, "restart": 2, "job_id": "4242",
     "started_at": 1764460000.0, "start_step": 40, "total_steps": 200,
     "ended": null | {"reason": "completed", "step": 200, "at": 1764460100.0, "detail": "..."}}

``ended.reason``: ``completed``, ``warning_signal`` (the job's warning signal: time limit
or preemption; saved, requeued), ``sigterm`` (SLURM ended the run: scancel, requeue,
preemption; saved), ``requested`` (``stop_requested()``), ``hang`` (a watchdog),
``error`` (an exception on rank 0; ``detail`` says which). An attempt that ended without
writing ``ended`` was killed: SIGKILL, the out-of-memory killer or a lost node.

``<run-dir>/restarts.jsonl``, one line appended when an attempt starts after another::

    {"wall_time": 1764460050.0, "restart": 2, "job_id": "4242", "resumed_from_step": 40,
     "previous_last_step": 43, "reason": "warning_signal", "detail": "..."}

``reason`` is the previous attempt's ``ended.reason``, or ``killed`` when it has none,
``resubmitted`` after a completed one. ``previous_last_step`` is the last step in
metrics.jsonl before the resume dropped the steps after the checkpoint (null: none).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TypeGuard

from hpc_hsdp.files import is_time, read_json, read_json_lines, write_atomically
from hpc_hsdp.rundir.files import append_jsonl
from hpc_hsdp.rundir.status_section import RunView, StatusSection
from hpc_hsdp.rundir.training.metrics import last_step_written

ATTEMPT = "attempt.json"
RESTARTS = "restarts.jsonl"
_MAX_ATTEMPT_BYTES = 1 << 20
_MAX_RESTARTS_BYTES = 16 << 20

REASONS = {
    "warning_signal": "warning signal (time limit or preemption): saved and requeued",
    "sigterm": "SIGTERM (scancel, requeue or preemption): saved",
    "requested": "stop requested",
    "hang": "hang (watchdog)",
    "node_failure": "node failure: requeued without the dead node",
    "error": "error",
    "killed": "killed without a word: node failure, SIGKILL or out of memory",
    "resubmitted": "resubmitted after it had finished",
    "unknown": "unknown",
}
SHORT: dict[object, str] = {  # looked up with whatever a record holds
    "warning_signal": "warning signal",
    "sigterm": "SIGTERM",
    "requested": "stop requested",
    "hang": "hang",
    "node_failure": "node failure",
    "error": "error",
    "killed": "killed / node failure",
    "resubmitted": "resubmitted",
    "unknown": "unknown",
}


def stop_reason_code(stop_reason: str | None) -> str:
    """The loop's ``stop_reason`` (``"USR2"``, ``"TERM"``, ``"requested"``, None) -> an ``ended.reason``."""
    if stop_reason is None:
        return "completed"
    if stop_reason == "TERM":
        return "sigterm"
    if stop_reason in ("requested", "hang", "error"):
        return stop_reason
    return "warning_signal"  # the name of the job's warning signal (USR2, USR1, ...)


def read_attempt(run_dir: str | Path) -> dict | None:
    """The current or last attempt; None without one, or for one that hpc-hsdp did not write
    (not a regular file, too large, not JSON, fields of other types: none of it is shown)."""
    try:
        data = read_json(Path(run_dir) / ATTEMPT, max_bytes=_MAX_ATTEMPT_BYTES)
    except (OSError, ValueError):
        return None
    return data if _is_attempt(data) else None


def _count(value: object) -> bool:
    """A step, a restart count: an integer from 0 to 2**62 (None: not recorded)."""
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62)


def _is_attempt(data: object) -> TypeGuard[dict]:
    if not isinstance(data, dict):
        return False
    if not all(_count(data.get(key)) for key in ("restart", "start_step", "total_steps")):
        return False
    if data.get("started_at") is not None and not is_time(data["started_at"]):
        return False
    ended = data.get("ended")
    if ended is None:
        return True
    return (
        isinstance(ended, dict)
        and isinstance(ended.get("reason"), str)
        and isinstance(ended.get("detail", ""), str)
        and _count(ended.get("step"))
        and (ended.get("at") is None or is_time(ended["at"]))
    )


def _is_restart(record: object) -> bool:
    return (
        isinstance(record, dict)
        and is_time(record.get("wall_time", 0))
        and all(_count(record.get(key)) for key in ("restart", "resumed_from_step", "previous_last_step"))
        and isinstance(record.get("reason"), str)
        and isinstance(record.get("detail", ""), str)
    )


def read_restarts(run_dir: str | Path) -> list[dict]:
    """The restart lines (a torn or foreign line is skipped; of a file past 16 MiB, the lines
    in its last 16 MiB)."""
    try:
        records = read_json_lines(Path(run_dir) / RESTARTS, max_bytes=_MAX_RESTARTS_BYTES)
    except (OSError, ValueError):
        return []
    return [record for record in records if _is_restart(record)]


def begin_attempt(
    run_dir: str | Path,
    *,
    restart: int,
    job_id: str | None,
    start_step: int,
    total_steps: int,
    now: float | None = None,
) -> dict | None:
    """Start an attempt (rank 0, before metrics.jsonl is cut back to ``start_step``): append
    the restart line when an attempt ran here before, write the new attempt.json. Returns
    the restart line, or None on a first start."""
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    previous = read_attempt(run_dir)
    line = None
    if previous is not None or start_step > 0:
        ended = (previous or {}).get("ended") or None
        if previous is None:
            reason, detail = "unknown", "a checkpoint but no attempt.json"
        elif ended is None:
            reason, detail = "killed", REASONS["killed"]
        elif ended.get("reason") == "completed":
            reason, detail = "resubmitted", REASONS["resubmitted"]
        else:
            reason = ended.get("reason") if ended.get("reason") in REASONS else "unknown"
            detail = ended.get("detail") or REASONS[reason]
        line = {
            "wall_time": now,
            "restart": restart,
            "job_id": job_id,
            "resumed_from_step": start_step,
            "previous_last_step": last_step_written(run_dir),
            "reason": reason,
            "detail": detail,
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        append_jsonl(run_dir / RESTARTS, line)
    attempt = {
        "format": "hpc-hsdp-attempt",
        "version": 1,
        "restart": restart,
        "job_id": job_id,
        "started_at": now,
        "start_step": start_step,
        "total_steps": total_steps,
        "ended": None,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(run_dir / ATTEMPT, json.dumps(attempt, indent=1))
    return line


def end_attempt(
    run_dir: str | Path,
    *,
    reason: str,
    step: int | None,
    detail: str = "",
    now: float | None = None,
    overwrite: bool = False,
) -> bool:
    """Record why the current attempt ends. The first cause written wins (a watchdog's
    ``hang`` over the error it provoked) unless ``overwrite``; False when nothing was written."""
    run_dir = Path(run_dir)
    attempt = read_attempt(run_dir)
    if attempt is None or (attempt.get("ended") and not overwrite):
        return False
    attempt["ended"] = {
        "reason": reason,
        "step": step,
        "at": time.time() if now is None else now,
        "detail": detail[:500],
    }
    write_atomically(run_dir / ATTEMPT, json.dumps(attempt, indent=1))
    return True


def restart_causes(run_dir: str | Path) -> list[str]:
    """Each restart in words: ``step 40: preempted``."""
    return [f"step {r.get('resumed_from_step')}: {_short(r.get('reason'))}" for r in read_restarts(run_dir)]


def _short(reason: object) -> object:
    return SHORT.get(reason, reason) if isinstance(reason, str) else reason


RESTARTS_SECTION: StatusSection[RunView, list[str]] = StatusSection(
    name="restarts",
    read=lambda view: restart_causes(view.run_dir),
    lines=lambda causes: [f"restarts: {'; '.join(causes)}"] if causes else [],
    fields=lambda causes: {"restart_causes": causes},
)
