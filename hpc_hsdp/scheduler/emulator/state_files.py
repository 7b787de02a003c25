"""An emulated job's state file (``<logs>/<job id>_local.json``), the emulator's own state folder,
and the job ids it gives out."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import private_dir, read_json, user_state_dir, write_atomically

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED")


MAX_STATE_BYTES = 1 << 20


def read_state(path: str | Path) -> dict:
    """A JSON object the emulator wrote (a job's ``<logs>/<id>_local.json``, the port
    reservations), read as data that may be hostile (:func:`hpc_hsdp.files.read_json`: a regular
    file, at most 1 MiB). OSError (FileNotFoundError when missing) or ValueError, one line."""
    data = read_json(path, max_bytes=MAX_STATE_BYTES)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


EMULATOR_STATES = ("PENDING", "RUNNING", *TERMINAL_STATES)


def read_job_state(path: str | Path) -> dict:
    """A job's state file (:func:`read_state`) whose ``state`` is one the emulator writes; else
    ValueError, one line (``{"state": ""}`` broke ``status`` and ``runs`` over a whole tree)."""
    data = read_state(path)
    if data.get("state") not in EMULATOR_STATES:
        raise ValueError(f"{path} holds no state of the emulator's")
    return data


def write_state(path: Path, data: dict) -> None:
    write_atomically(path, json.dumps(data, indent=1))


def emulator_state_dir() -> Path:
    """The emulator's own state on this machine (the ports it reserved, and their lock)."""
    return user_state_dir("emulator")


MAX_SPOOLED_SCRIPT_BYTES = 4 << 20
"""SLURM's default cap of a batch script (``max_script_size``)."""


def spool_path(state_file: Path) -> Path:
    """Where the emulator keeps its own copy of the batch script of the job whose state file is
    ``state_file`` (SLURM's spool: private to this user, named from the state file's path, which
    the supervisor is given on its command line): the supervisor runs that copy, never a script a
    file of the logs directory names, which whoever can write that directory could change."""
    name = hashlib.sha256(str(Path(state_file).absolute()).encode()).hexdigest()[:32]
    return emulator_state_dir() / "scripts" / f"{name}.sh"


def spooled_launch_path(state_file: Path) -> Path:
    """Where the emulator keeps its own copy of what starts the job of ``state_file`` (its id, its
    allocation, the directory it starts in, a job array's variables): private, like the script's copy
    (:func:`spool_path`). The state file in the logs directory is only read for the job's state: a
    value that reaches the job's environment or its command lines is never taken from it."""
    return spool_path(state_file).with_suffix(".json")


LAUNCH_KEYS = (
    "job_id",
    "run_dir",
    "tasks_per_node",
    "node_names",
    "gpus_per_node",
    "job_name",
    "submit_dir",
    "array_env",
)
"""The facts of a state file that start a job, spooled privately (:func:`spooled_launch_path`)."""


def read_launch(state_file: Path) -> dict:
    """The private copy of what starts the job of ``state_file``; OSError or ValueError, one line."""
    return read_state(spooled_launch_path(state_file))


def emulator_private_dir(path: Path, *, mode: int = 0o700) -> Path:
    """:func:`~hpc_hsdp.files.private_dir`, refusing a symlink or another user's directory as a user error."""
    try:
        return private_dir(path, mode=mode)
    except PermissionError as exc:
        raise SpecError(f"the local emulator cannot use {exc}") from None


_TAKEN_IDS = [0]
"""The highest job id this process gave out (a job array's tasks' included)."""


def new_job_id(tasks: int = 0) -> str:
    """A numeric id like SLURM's (ports and file names derive from it), unique enough locally; in
    one process always above every id given before, and above the ``tasks`` ids after it (a job
    array's tasks' own job ids: a sweep of several arrays submits them one after the other)."""
    found = max(int(time.time() * 1000) % 90_000_000 + 10_000_000, _TAKEN_IDS[0] + 1)
    _TAKEN_IDS[0] = found + tasks
    return str(found)


def state_path(logs_dir: Path, job_id: str) -> Path:
    return Path(logs_dir) / f"{job_id}_local.json"
