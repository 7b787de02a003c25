"""Atomic file writes, shared by the CLI, the scheduler records and the on-node runtime."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: str | os.PathLike, text: str, *, mode: int | None = None, durable: bool = False) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and a
    rename: readers see the old file or the whole new one, never a partial one.
    ``durable`` also fsyncs the data before the rename (checkpoint markers, layout.json).
    Raises OSError; nothing is left behind on failure."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    # 0o666 and the umask, as a plain open() would create it (mkstemp would make it 0o600)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
