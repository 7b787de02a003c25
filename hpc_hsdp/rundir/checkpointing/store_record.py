"""``RUN_DIR/checkpoint_store.json``: where the uploads of a run with ``--checkpoint-store`` stand,
written by rank 0's uploader, read by ``status``.

``{"url", "committed_step", "committed_at", "uploading": {"step", "since", "waiting"} | null,
"retrying": {"what", "attempts", "error", "since"} | null, "updated_at"}``: the store's newest
committed step, the step being uploaded (and what its commit waits for), and the last failure
being retried. The URL is the one given (no credentials: :func:`parse_store_url` refuses them);
error texts are the store's, cut short.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpc_hsdp.files import is_time, read_json
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.rundir.files import atomic_write_text
from hpc_hsdp.rundir.status_section import RunView, StatusSection

STORE_RECORD = "checkpoint_store.json"
_MAX_BYTES = 1 << 20


def write_store_record(run_dir: str | Path, record: dict) -> None:
    atomic_write_text(Path(run_dir) / STORE_RECORD, json.dumps(dict(record, updated_at=time.time()), indent=1) + "\n")


def read_store_record(run_dir: str | Path) -> dict | None:
    """The record (None: none, or not one hpc-hsdp wrote)."""
    try:
        data = read_json(Path(run_dir) / STORE_RECORD, max_bytes=_MAX_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("url"), str):
        return None
    return data


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def store_lines(record: dict | None, *, now: float | None = None) -> list[str]:
    """``status``'s lines: the newest committed step, the upload in flight, the failure being retried."""
    if record is None:
        return []
    now = time.time() if now is None else now
    committed = _int(record.get("committed_step"))
    head = f"store: {record['url']}: " + (
        f"step {committed} committed" if committed is not None else "nothing committed"
    )
    at = record.get("committed_at")
    if committed is not None and is_time(at):
        head += f" ({now - at:,.0f} s ago)"
    lines = [head]
    uploading = record.get("uploading")
    if isinstance(uploading, dict) and _int(uploading.get("step")) is not None:
        since = uploading.get("since")
        line = f"  uploading step {uploading['step']}"
        if is_time(since):
            line += f" for {now - since:,.0f} s"
        if isinstance(uploading.get("waiting"), str):
            line += f" ({uploading['waiting']})"
        lines.append(line)
    retrying = record.get("retrying")
    if isinstance(retrying, dict) and _int(retrying.get("attempts")) is not None:
        lines.append(
            f"  retrying: {retrying.get('what', '?')} failed {retrying['attempts']} time(s), last: "
            f"{str(retrying.get('error', ''))[:200]}"
        )
    return lines


CHECKPOINT_STORE_SECTION: StatusSection[RunView, dict | None] = StatusSection(
    name="checkpoint-store",
    read=lambda view: read_store_record(view.run_dir),
    lines=lambda record: [terminal_safe(line) for line in store_lines(record)],
    fields=lambda record: {"checkpoint_store": record},
)
