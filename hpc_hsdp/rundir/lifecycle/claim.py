"""``<run-dir>/claim.json``: which job writes this run directory (one writer per run directory).

A submission takes the claim before it writes anything of its job: under an exclusive
``flock`` of ``<run-dir>/claim.lock``, held from the check until the job's id is recorded,
it reads the claim there, asks the scheduler about the job it names (:mod:`hpc_hsdp.submit_host.claims`
does; this module holds no scheduler knowledge), and either refuses or records itself. A
second submission started at the same moment waits on the lock and then sees the first
one's job. The lock is the kernel's: a submitter that dies lets go of it, and the claim it
left (``submitting``, never followed by a job id) is stale for the next one.

States of the claim: ``submitting`` (a submission holds the lock and has no job id yet),
``claimed`` (job ``job_id`` writes the directory), ``released`` (that job ended; the
directory is free). Paths in it are relative to the run directory; ``run_dir`` is where it
was written, a hint only (a copied or moved directory carries its claim along).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import read_capped, read_json, write_atomically

CLAIM = "claim.json"
CLAIM_LOCK = "claim.lock"
RUN_LOCK = "run.lock"
"""Held (``flock``) by an ``hpc-hsdp run`` outside any job for as long as it runs."""
_RUN_LOCKS: dict[str, int] = {}
"""This process's held run locks: run directory -> the descriptor."""
SUBMITTING, CLAIMED, RELEASED = "submitting", "claimed", "released"
_MAX_CLAIM_BYTES = 16 * 1024


def claim_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CLAIM


def read_claim(run_dir: str | Path) -> dict | None:
    """The claim recorded in ``run_dir`` (None: none, or one not written by hpc-hsdp, which is no claim)."""
    try:
        data = read_json(claim_path(run_dir), max_bytes=_MAX_CLAIM_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("state") not in (SUBMITTING, CLAIMED, RELEASED):
        return None
    job_id = data.get("job_id")
    if job_id is not None and not isinstance(job_id, str):
        return None
    return data


def claim_bytes(run_dir: str | Path) -> bytes | None:
    """The claim file's bytes as they are, to be put back after a failed submission (None: no
    claim file, or one that is not a regular file of at most 16 KiB, which is no claim: never
    read through a symlink, so that putting it back cannot copy another file's bytes here)."""
    try:
        return read_capped(claim_path(run_dir), max_bytes=_MAX_CLAIM_BYTES)
    except (OSError, ValueError):
        return None


def who() -> dict:
    """This process, as a claim names it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "at": time.time()}


def write_claim(run_dir: str | Path, state: str, **fields) -> dict:
    """Record ``state`` (with ``fields``: job_id, cluster, logs_dir ...) as this process's claim."""
    record = {"state": state, **fields, **who(), "run_dir": str(Path(run_dir).absolute())}
    write_atomically(claim_path(run_dir), json.dumps(record, indent=1))
    return record


def release_claim(run_dir: str | Path, job_id: str, *, ended: str) -> bool:
    """Mark job ``job_id``'s claim of ``run_dir`` released (it ended ``ended``); nothing when the
    claim names another job, or the directory is not writable. Under the lock, so that a
    submission that just claimed the directory keeps its claim; not waited for: a submission
    holding it (this very process, checking the claim's job) decides itself. True when released here."""
    path = Path(run_dir)
    first = read_claim(path)
    if first is None or first.get("job_id") != str(job_id) or first.get("state") != CLAIMED:
        return False  # the common case, a claim released already: no lock, nothing written
    try:
        with _locked(path, wait_s=0.0):
            claim = read_claim(path)
            if claim is None or claim.get("job_id") != str(job_id) or claim.get("state") != CLAIMED:
                return False
            fields = {k: v for k, v in claim.items() if k not in ("state", "host", "pid", "at", "run_dir")}
            write_claim(path, RELEASED, **{**fields, "ended": ended})
            return True
    except (OSError, SpecError):
        return False


def _open_lock(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def hold_run_lock(run_dir: str | Path) -> None:
    """Take ``run_dir``'s run lock for the rest of this process (or :func:`let_go_of_run_lock`);
    SpecError when another process holds it."""
    key = str(Path(run_dir).absolute())
    if key in _RUN_LOCKS:
        return
    fd = _open_lock(Path(run_dir) / RUN_LOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise SpecError(
            f"another hpc-hsdp run writes run directory {run_dir}; wait for it or choose a new --run-dir"
        ) from None
    _RUN_LOCKS[key] = fd


def let_go_of_run_lock(run_dir: str | Path) -> None:
    fd = _RUN_LOCKS.pop(str(Path(run_dir).absolute()), None)
    if fd is not None:
        os.close(fd)


def run_lock_held(run_dir: str | Path) -> bool:
    """Whether a live ``hpc-hsdp run`` (this process or another) holds ``run_dir``'s run lock."""
    if str(Path(run_dir).absolute()) in _RUN_LOCKS:
        return True
    try:
        fd = os.open(Path(run_dir) / RUN_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # none (or not a file of ours): no run holds it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN)
    finally:
        os.close(fd)  # a lock taken here goes with it
    return False


@contextmanager
def _locked(run_dir: Path, *, wait_s: float) -> Iterator[None]:
    fd = os.open(run_dir / CLAIM_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise SpecError(
                        f"the file system of {run_dir} does not lock files (flock: {exc.strerror}); a run directory "
                        f"needs one that does (Lustre: mount with -o flock)"
                    ) from None
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if time.monotonic() > deadline:
                holder = read_claim(run_dir) or {}
                raise SpecError(
                    f"another submission into run directory {run_dir} (pid {holder.get('pid', '?')} on "
                    f"{holder.get('host', '?')}) has held its claim for more than {wait_s:.0f} s: nothing "
                    f"submitted; try again when it is done"
                )
            time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing lets go of the lock


@contextmanager
def claim_lock(run_dir: str | Path, *, wait_s: float) -> Iterator[None]:
    """Hold ``run_dir``'s claim lock (exclusive ``flock``; ``run_dir`` must exist), waiting up to
    ``wait_s`` for another submission to finish (SpecError, one line, after that)."""
    with _locked(Path(run_dir), wait_s=wait_s):
        yield
