"""``<run-dir>/replicas.jsonl``: the membership changes of a fault-tolerant run (no torch).

Two writers append to it: the job's replica supervisor (:mod:`hpc_hsdp.batch_shell.replica_supervisor`: the
lighthouse, each group step started, lost, finished, a fall back to requeue, ``"event"`` and
``"cause"``), and each replica group's rank 0 when the quorum of a step differs from its last
one (:mod:`hpc_hsdp.task.training.replica_coordinator`: ``"step"``, ``"replicas"`` of ``"of"``, ``"cause"``).
Every record has its ``"time"`` (seconds since the epoch). ``status`` and ``report`` show them.
"""

from __future__ import annotations

import time
from pathlib import Path

from hpc_hsdp.files import is_time, read_json_lines
from hpc_hsdp.rundir.status_section import RunView, StatusSection

MEMBERSHIP_LOG = "replicas.jsonl"
_MAX_MEMBERSHIP_BYTES = 16 << 20


def membership_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / MEMBERSHIP_LOG


def read_membership(run_dir: str | Path) -> list[dict]:
    """The records, in the order written (none without the file)."""
    try:
        records = read_json_lines(membership_path(run_dir), max_bytes=_MAX_MEMBERSHIP_BYTES)
    except (OSError, ValueError):
        return []
    return [r for r in records if isinstance(r, dict) and is_time(r.get("time"))]


def membership_changes(records: list[dict]) -> list[str]:
    """One line per change, with its time and cause: the supervisor's events (a group lost,
    started again, the lighthouse, a fall back) and each new quorum size as the groups saw it
    (once per step, whichever group wrote it)."""
    lines, seen = [], set()
    for record in records:
        stamp = time.strftime("%H:%M:%S", time.localtime(record["time"]))
        event = record.get("event")
        if event is not None:
            if event == "replica group started" and record.get("cause") == "job start":
                continue
            what = event
            if "replica_id" in record:
                what = what.replace("replica group", f"replica group {record['replica_id']}")
            if isinstance(record.get("nodes"), list) and record["nodes"]:
                what += f" on {','.join(map(str, record['nodes']))}"
            cause = record.get("cause")
            lines.append(f"{stamp} {what}" + (f" ({cause})" if cause else ""))
            continue
        key = (record.get("step"), record.get("replicas"))
        if key in seen or record.get("cause") == "start":
            continue
        seen.add(key)
        lines.append(
            f"{stamp} step {record.get('step')}: {record.get('replicas')}/{record.get('of')} replica groups "
            f"({record.get('cause')})"
        )
    return lines


MEMBERSHIP_SHOWN = 8
"""The newest membership changes of a fault-tolerant run that ``status`` shows."""


def _membership_lines(found: tuple[list[str], dict | None]) -> list[str]:
    changes, metrics = found
    if not changes:
        return []
    last = metrics.get("replicas") if metrics else None
    now = f" ({last}/{metrics.get('replica_groups')} now)" if metrics and last is not None else ""
    return [f"replica groups{now}:"] + [f"  {line}" for line in changes[-MEMBERSHIP_SHOWN:]]


MEMBERSHIP_SECTION: StatusSection[RunView, tuple[list[str], dict | None]] = StatusSection(
    name="membership",
    read=lambda view: (membership_changes(read_membership(view.run_dir)), view.last_metrics),
    lines=_membership_lines,
    fields=lambda found: {"membership": found[0]},
)
