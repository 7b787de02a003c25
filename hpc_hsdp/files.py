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


TAIL_BLOCK = 1 << 16
"""How much of a file :func:`tail_offset` reads at a time, from its end backwards."""
COPY_BLOCK = 1 << 20
"""How much of a file :func:`copy_from` holds at a time."""


def tail_offset(path: str | os.PathLike, lines: int, *, block: int = TAIL_BLOCK) -> int:
    """Where the last ``lines`` lines of ``path`` begin (a byte offset): read from the end
    backwards a block at a time, as ``tail -n`` and ``journalctl -n`` do, so that the cost is
    the lines asked for, not the file. A last line without its newline counts as a line; 0
    when the file has no more lines than that. OSError when it cannot be read."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if lines <= 0 or size == 0:
            return size
        f.seek(size - 1)
        wanted = lines + (f.read(1) == b"\n")  # the file's last newline ends its last line
        end = size
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            chunk = f.read(end - start)
            found = chunk.count(b"\n")
            if found < wanted:
                wanted -= found
                end = start
                continue
            position = len(chunk)
            for _ in range(wanted):
                position = chunk.rindex(b"\n", 0, position)
            return start + position + 1
        return 0


def copy_from(path: str | os.PathLike, offset: int, out, *, block: int = COPY_BLOCK) -> int:
    """Write the bytes of ``path`` from ``offset`` to its end to the binary stream ``out``, a
    block at a time (memory flat in the file's size); returns the offset reached. OSError when
    it cannot be read."""
    with open(path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(block):
            out.write(chunk)
            offset += len(chunk)
    return offset
