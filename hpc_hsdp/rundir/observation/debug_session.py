"""``<run_dir>/debug/``: ``hpc-hsdp debug``'s request to a running job and the session it opened.

``request.json`` (written by the command, taken once by rank 0): ``{"id", "rank", "at_step",
"requested_at"}``: stop ``rank`` in a debugger at the step boundary after ``at_step`` (None: the
next one). Rank 0 takes it only when this user wrote it (the file's owner is the job's user: a
run directory may be writable by others, and nobody else may stop the job) and removes it.

``session.json`` (written by the debugged rank): ``{"id", "rank", "node", "socket", "step",
"state"}``: the Unix socket its debugger listens on (in a directory of the node only its user
reaches, :func:`socket_dir_name`), ``state`` ``waiting``, ``attached``, ``continue`` or ``quit``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

from hpc_hsdp.files import open_regular, parse_json, write_atomically

DEBUG_DIR = "debug"
REQUEST = "request.json"
SESSION = "session.json"
MAX_BYTES = 64 << 10
STATES = ("waiting", "attached", "continue", "quit")


def request_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / DEBUG_DIR / REQUEST


def session_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / DEBUG_DIR / SESSION


def socket_dir_name(uid: int) -> str:
    """The node's directory of this user's debugger sockets (under its temporary directory), 0700."""
    return f"hpc-hsdp-debug-{uid}"


def _small_int(value: object, *, at_least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and at_least <= value < 1 << 40


def write_request(run_dir: str | Path, *, rank: int, at_step: int | None) -> str:
    """The command's request; its id."""
    request_id = uuid.uuid4().hex
    path = request_path(run_dir)
    path.parent.mkdir(exist_ok=True)
    record = {"id": request_id, "rank": rank, "at_step": at_step, "requested_at": time.time()}
    write_atomically(path, json.dumps(record) + "\n")
    return request_id


def _read_own(path: Path) -> dict | None:
    """The JSON object at ``path`` when it is a regular file of this user (None: none, another
    user's, or not a record of ours)."""
    try:
        with open_regular(path) as f:
            if os.fstat(f.fileno()).st_uid != os.getuid():
                return None
            record = parse_json(f.read(MAX_BYTES + 1)[:MAX_BYTES], where=str(path))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("id"), str) else None


def take_request(run_dir: str | Path, *, world_size: int) -> dict | None:
    """Rank 0: the pending request (removed from the directory), None when there is none or it
    is not one this user wrote for a rank of this job."""
    path = request_path(run_dir)
    record = _read_own(path)
    if record is None:
        return None
    try:
        path.unlink()
    except OSError:
        return None
    at_step = record.get("at_step")
    if not _small_int(record.get("rank")) or record["rank"] >= world_size:
        return None
    if at_step is not None and not _small_int(at_step):
        return None
    return {"id": record["id"][:64], "rank": record["rank"], "at_step": at_step}


def write_session(run_dir: str | Path, record: dict) -> None:
    path = session_path(run_dir)
    path.parent.mkdir(exist_ok=True)
    write_atomically(path, json.dumps(record) + "\n")


def read_session(run_dir: str | Path, request_id: str) -> dict | None:
    """The session of request ``request_id`` (None: not opened yet, or not a session of this user's)."""
    record = _read_own(session_path(run_dir))
    if record is None or record.get("id") != request_id or record.get("state") not in STATES:
        return None
    if not isinstance(record.get("socket"), str) or not isinstance(record.get("node"), str):
        return None
    return record
