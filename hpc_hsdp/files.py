"""The one writer of files others may reach (atomic writes and appends that refuse symlinks,
FIFOs and devices), and the one reader of files that may be hostile (a run directory's, a
checkpoint's, the emulator's state), shared by the CLI, the scheduler records and the on-node runtime."""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import TypeGuard


class UnsafeTarget(OSError):
    """A file hpc-hsdp was to write is a symlink, a FIFO, a device or a directory (planted by
    whoever else can write the run directory): nothing was written; the message is one line
    naming it. An OSError, so that a writer that gives up on a failed write gives up here too
    (the CLI says it in one line, exit 2)."""


def _refused(path: str, what: str) -> UnsafeTarget:
    return UnsafeTarget(
        f"{path} is {what}; hpc-hsdp writes into a run directory only regular files it can reach without "
        f"a symlink (someone who can write the directory may have put it there): remove it, or use another run directory"
    )


def check_write_target(path: str | os.PathLike) -> None:
    """Refuse (:class:`UnsafeTarget`) when ``path`` exists and is not a regular file: a symlink
    (which a write would follow to whatever it names), a FIFO, a device, a directory."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise _refused(os.fspath(path), "a symlink")
    if not stat.S_ISREG(info.st_mode):
        raise _refused(os.fspath(path), "not a regular file (a FIFO, device or directory)")


PRIVATE_FILE = 0o600
"""What :func:`write_atomically` and :func:`open_for_writing` make a ``private`` file, whatever
the umask: the scripts and code a job runs, which nobody else may change or read."""


def open_for_writing(
    path: str | os.PathLike,
    *,
    append: bool = False,
    exclusive: bool = False,
    mode: int = 0o666,
    private: bool = False,
):
    """``path`` opened for binary writing (``append``: at its end; ``exclusive``: only when it does
    not exist; else truncated), the one way hpc-hsdp opens a run directory's file to write in
    place: ``O_NOFOLLOW`` and ``O_NONBLOCK`` (a symlink is never followed, a FIFO does not block),
    then refused unless it is a regular file, with nothing written (:class:`UnsafeTarget`).
    ``mode`` less the umask when created; ``private`` makes it 0600 whatever the umask."""
    path = os.fspath(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_APPEND if append else 0
    flags |= os.O_EXCL if exclusive else 0
    try:
        fd = os.open(path, flags, PRIVATE_FILE if private else mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refused(path, "a symlink") from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO nobody reads, a directory
            raise _refused(path, "not a regular file (a FIFO, device or directory)") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refused(path, "not a regular file (a FIFO, device or directory)")
        if not append and not exclusive:
            os.ftruncate(fd, 0)
        if private and stat.S_IMODE(info.st_mode) != PRIVATE_FILE:
            os.fchmod(fd, PRIVATE_FILE)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "ab" if append else "wb")
    except BaseException:
        os.close(fd)
        raise


def append_text(path: str | os.PathLike, text: str) -> None:
    """Append ``text`` to ``path`` (created when missing) through :func:`open_for_writing`: a
    symlink, FIFO or device there is refused (:class:`UnsafeTarget`), nothing appended."""
    with open_for_writing(path, append=True) as f:
        f.write(text.encode("utf-8"))


def write_atomically(
    path: str | os.PathLike, text: str | bytes, *, mode: int | None = None, durable: bool = False, private: bool = False
) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a
    rename: readers see the old file or the whole new one, never a partial one.
    ``mode``: the permission bits before the umask (0o755 for a script: 0o700 under umask 077);
    ``private``: 0600 whatever the umask (what a job runs).
    ``durable`` also fsyncs the data before the rename (checkpoint markers, layout.json).
    A symlink, FIFO, device or directory at ``path`` is refused (:class:`UnsafeTarget`), not
    replaced: someone else put it there. Raises OSError; nothing is left behind on failure."""
    path = Path(path)
    check_write_target(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    # ``mode`` (default 0o666) less the umask, as a plain open() would create it (mkstemp would
    # make it 0o600): under umask 077 a script is 0o700, never world-readable
    with open_for_writing(tmp, exclusive=True, mode=0o666 if mode is None else mode, private=private) as f:
        try:
            f.write(text.encode("utf-8") if isinstance(text, str) else text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
            f.close()
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
    when the file has no more lines than that. OSError when it cannot be read, UnreadableFile
    when it is not a regular file (:func:`open_regular`)."""
    with open_regular(path) as f:
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
    it cannot be read, UnreadableFile when it is not a regular file (:func:`open_regular`)."""
    with open_regular(path) as f:
        f.seek(offset)
        while chunk := f.read(block):
            out.write(chunk)
            offset += len(chunk)
    return offset


# ----------------------------------------------------------------------------- reading what may be hostile


class UnreadableFile(ValueError):
    """A file that is not what it should be (a symlink, a FIFO or device, too large, not the JSON
    expected); the message is one line naming the file. A ValueError, so that a reader that
    treats a damaged file as none catches it with the garbage it already catches."""


def open_regular(path: str | os.PathLike):
    """``path`` opened for binary reading, only when it is a regular file reached without a
    symlink at its last component: a FIFO would block (``O_NONBLOCK`` opens it at once, then it
    is refused), ``/dev/zero`` would never end, a symlink could lead to a secret that a reader
    then copies. FileNotFoundError when missing, UnreadableFile when not a regular file, other
    OSError when it cannot be opened."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnreadableFile(f"{path} is a symlink; a run's files are read only as regular files") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile(f"{path} is not a regular file (a FIFO, device or directory)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(path: str | os.PathLike, *, max_bytes: int, tail: bool = False) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), at most ``max_bytes``: a
    larger file is UnreadableFile, or with ``tail`` its last ``max_bytes`` from the first line
    that begins inside them (a log that grows: its newest lines)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes and tail:
            f.seek(size - max_bytes - 1)
            data = f.read(max_bytes + 1)
            cut = data.find(b"\n")
            return data[cut + 1 :] if cut >= 0 else b""
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise UnreadableFile(f"{path} has more than {max_bytes:,} bytes; it was not written by hpc-hsdp")
    return data


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} out of range")
    return value


def _int64(text: str) -> int:
    value = int(text)
    if not -(1 << 63) <= value < 1 << 64:
        raise ValueError(f"integer {text[:20]}... out of range")
    return value


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number")


def parse_json(data: bytes | str, *, where: str = "the file", finite: bool = True) -> object:
    """A JSON value that may be hostile: UnreadableFile (one line naming ``where``) for bytes
    that are not UTF-8, for garbage, for nesting deep enough to exhaust Python's stack, and
    for integers past 64 bits (what orjson and every writer here keep to: ``10**400`` as a
    time or a loss fails far from here, formatted or converted), and (``finite``) for numbers
    out of range (``1e999``, ``NaN``, ``Infinity``; a metric's NaN loss is data: ``finite=False``)."""
    try:
        if isinstance(data, bytes):
            data = data.decode("utf-8")
        if not finite:
            return json.loads(data, parse_int=_int64)
        return json.loads(data, parse_int=_int64, parse_float=_finite, parse_constant=_no_constant)
    except RecursionError:
        raise UnreadableFile(f"{where} is nested too deeply; it was not written by hpc-hsdp") from None
    except ValueError as exc:
        reason = " ".join(str(exc).split())[:120]
        raise UnreadableFile(f"{where} is not JSON written by hpc-hsdp ({reason})") from None


def is_time(value: object) -> TypeGuard[int | float]:
    """A time read from a file may be printed, subtracted and formatted: a number of seconds
    since the epoch between 1970 and about the year 5000 (not a bool, not 10**400)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e11


def read_json(path: str | os.PathLike, *, max_bytes: int, finite: bool = True) -> object:
    """A JSON file that may be hostile: :func:`read_capped`, then :func:`parse_json` (``finite``:
    see there). OSError (FileNotFoundError when missing) or UnreadableFile, each one line."""
    return parse_json(read_capped(path, max_bytes=max_bytes), where=os.fspath(path), finite=finite)


def read_json_lines(path: str | os.PathLike, *, max_bytes: int) -> list:
    """The JSON values of a JSON-lines file that may be hostile, in order; a line that is not
    one (torn, garbage, too deep, out of range) is skipped. Of a file larger than ``max_bytes``,
    its last lines within them. A missing file has none; OSError or UnreadableFile when it
    cannot be read as a regular file."""
    try:
        data = read_capped(path, max_bytes=max_bytes, tail=True)
    except FileNotFoundError:
        return []
    values = []
    for line in data.splitlines():
        if line.strip():
            try:
                values.append(parse_json(line))
            except UnreadableFile:
                continue
    return values
