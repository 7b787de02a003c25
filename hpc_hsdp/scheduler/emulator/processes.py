"""Which process is which: a pid's start time, whether it lives, and whether it is the supervisor
the emulator started for a job (never a process a forged state file names)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeGuard

from hpc_hsdp.files import read_capped


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22):
    with the pid it names one process, never a later one that got the same pid."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


SUPERVISOR_MARK = "HPC_HSDP_EMULATOR_STATE"
"""Set in the environment the emulator starts a job's supervisor with: the absolute path of the
job's state file. A process is that job's supervisor only when its environment says so."""


def is_supervisor(pid: object, started: object, state_file: Path) -> TypeGuard[int]:
    """``pid`` (from the job's state file, which anyone with the run directory could edit) is
    the supervisor this emulator started for ``state_file``: a process of this user that began
    when the state file says and whose environment (``/proc/PID/environ``, readable by its owner
    alone, fixed when it started) names ``state_file`` in :data:`SUPERVISOR_MARK`. A pid, start
    time and owner copied from ``/proc`` into a forged record name another process of the user,
    whose environment has no such mark: it is not signalled."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        return False
    now = process_start_time(pid)
    if now is None and not Path("/proc/self/stat").exists():
        return True  # no /proc here (macOS): the pid alone
    if now is None or now != started:
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return False
        marks = _environment_value(pid, SUPERVISOR_MARK)
        return marks is not None and os.path.realpath(marks) == os.path.realpath(state_file)
    except OSError:
        return False


def _environment_value(pid: int, name: str) -> str | None:
    """``name``'s value in the environment process ``pid`` started with (None: not set)."""
    data = read_capped(f"/proc/{pid}/environ", max_bytes=MAX_ENVIRON_BYTES)
    prefix = f"{name}=".encode()
    for entry in data.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


MAX_ENVIRON_BYTES = 16 << 20


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as dead
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True
