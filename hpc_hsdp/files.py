"""Atomic file writes, shared by the CLI, the scheduler records and the on-node runtime."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def write_atomically(path: str | os.PathLike, text: str, *, mode: int | None = None, durable: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a
    rename: readers see the old file or the whole new one, never a partial one.
    ``mode``: the permission bits before the umask (0o755 for a script: 0o700 under umask 077).
    ``durable`` also fsyncs the data before the rename (checkpoint markers, layout.json).
    Raises OSError; nothing is left behind on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    # ``mode`` (default 0o666) less the umask, as a plain open() would create it (mkstemp would
    # make it 0o600): under umask 077 a script is 0o700, never world-readable
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def private_dir(path: str | os.PathLike, *, mode: int = 0o700) -> Path:
    """A state directory only this user can change: created with ``mode`` (0o700: nobody else
    reaches it; its parents as usual) when missing; an existing one is refused
    (``PermissionError`` naming it) when it is a symlink or another user owns it, and loses
    the permission bits beyond ``mode`` that it has. Another user's directory could feed
    this one file names, pids and job ids, or read what is written there."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"{path} is a symlink or not a directory; remove it, or give another directory")
    if info.st_uid != os.geteuid():
        raise PermissionError(
            f"{path} belongs to user id {info.st_uid}, not to you; remove it, or give another directory"
        )
    if stat.S_IMODE(info.st_mode) & ~mode:
        os.chmod(path, stat.S_IMODE(info.st_mode) & mode)
    return path


def user_state_dir(name: str) -> Path:
    """``$XDG_STATE_HOME/hpc-hsdp/NAME`` (``~/.local/state`` without it): this user's state of
    hpc-hsdp on this machine (the jobs index, the emulator's port reservations). Not created."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "hpc-hsdp" / name
