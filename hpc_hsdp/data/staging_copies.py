"""Token files on node-local disk (``--stage-data [DIR]``): one verified copy per node.

Every task of a node calls :func:`stage_files` with the token files its loader reads; the
first to take the node's lock (``fcntl.flock`` on ``ROOT/.lock``, released by the kernel when
a task dies) copies what is missing, the node's other tasks wait and then find the copies
ready. ``ROOT`` is ``DIR/hpc-hsdp-staged-<uid>`` (:func:`stage_root`); ``DIR`` is the one
given, or the job's node-local temporary directory: ``$SLURM_TMPDIR``, ``$TMPDIR``, else
``/tmp`` (:func:`hpc_hsdp.plan.staging_dir.stage_base`).

Each copy ``ROOT/<key>-NAME.bin`` (``key``: a digest of the source's absolute path) has a
record ``ROOT/<key>-NAME.bin.staged.json``: the source's size, mtime and SHA-256, the copy's
size and mtime when it was last verified, and the launch that verified it. A copy is used only
when its record matches the source as it is now (:func:`copy_state`); a new launch (a second
job on the node, a requeue) re-reads the copy once and compares its SHA-256 (a damaged copy is
replaced), the other tasks of the same launch trust the first's verification. The SHA-256 is the
one in the token file's sidecar (``prepare-data`` writes it); a sidecar without one (data
prepared before) is verified against the digest of the shared copy as read while copying, and
the record says so (``checksum_from``). The shared copy not matching its sidecar's digest is a
:class:`~hpc_hsdp.errors.DataError`. Too little free space for the copies (checked first, with a
margin) leaves the node on the shared copy (``fallback`` says why).

The loader then reads the copies (:meth:`~hpc_hsdp.data.tokens.TokenDataset.read_from`: the
same dataset, the same shards in the same order, so the same samples). No torch: the tasks gather the nodes' results
and write ``staging.json`` (:mod:`hpc_hsdp.rundir.training.staging_record`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_hsdp.data.tokens import TokenFile, read_latency_of
from hpc_hsdp.errors import DataError
from hpc_hsdp.files import private_dir, read_json, write_atomically
from hpc_hsdp.plan.staging_dir import DIR_HINT

RECORD_SUFFIX = ".staged.json"
LOCK_NAME = ".lock"
COPY_CHUNK = 8 << 20
SPACE_MARGIN_BYTES = 64 << 20
SPACE_MARGIN_FRACTION = 0.02
"""Free space the copies leave: 64 MiB and 2 % of what they need (the file system's own reserve
and a second job's copies are not ours to fill)."""

COPIED, REUSED, REPLACED, SHARED = "copied", "reused", "replaced", "shared"
"""What happened to one file: copied now, an earlier copy reused, a damaged copy replaced, or
left on the shared file system (the node's disk too small)."""


# ---------------------------------------------------------------------------- where


def stage_root(base: Path, uid: int | None = None) -> Path:
    """The user's own directory under ``base`` that holds the copies."""
    return Path(base) / f"hpc-hsdp-staged-{os.geteuid() if uid is None else uid}"


def local_name(source: Path) -> str:
    """The copy's file name: a digest of the source's absolute path (two datasets' ``00000.bin``
    never meet), then its own name."""
    key = hashlib.sha256(str(Path(source).resolve()).encode()).hexdigest()[:16]
    return f"{key}-{Path(source).name}"


# ---------------------------------------------------------------------------- the decisions (pure)


@dataclass(frozen=True)
class FileStat:
    """A file's size and modification time (ns)."""

    size: int
    mtime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileStat | None:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None
        return cls(info.st_size, info.st_mtime_ns)

    @classmethod
    def of_present(cls, path: Path) -> FileStat:
        """Of a file this launch has just written or read (FileNotFoundError when it is gone)."""
        info = os.stat(path)
        return cls(info.st_size, info.st_mtime_ns)


REUSE, VERIFY, COPY = "reuse", "verify", "copy"


def copy_state(
    *, source: FileStat, expected: str | None, record: Mapping | None, local: FileStat | None, launch: str
) -> str:
    """What one copy needs: ``reuse`` (verified by this launch already and untouched since),
    ``verify`` (a copy of this very source, to re-read once: a new launch, or a copy changed
    since), ``copy`` (none, or one of another source or digest). ``expected``: the sidecar's
    SHA-256 (None: an old sidecar; the record's own digest of the shared copy stands)."""
    if record is None or local is None:
        return COPY
    same_source = record.get("source_size") == source.size and record.get("source_mtime_ns") == source.mtime_ns
    digest = record.get("sha256")
    if not same_source or not digest or (expected is not None and digest != expected):
        return COPY
    if local.size != source.size:
        return COPY
    if record.get("launch") == launch and record.get("local_mtime_ns") == local.mtime_ns:
        return REUSE
    return VERIFY


def space_needed(sizes: Sequence[int]) -> int:
    """Bytes of free space the copies of files of these sizes need, the margin included."""
    total = sum(sizes)
    return total + SPACE_MARGIN_BYTES + int(total * SPACE_MARGIN_FRACTION) if total else 0


def launch_token(env: Mapping[str, str], *, rendezvous: str, parent_pid: int) -> str:
    """This launch on this node: the job, its step and restart, its rendezvous address and the
    tasks' common parent (slurmstepd, torchrun's agent, the emulator). The node's tasks of one
    launch share it; a second job, a requeue or a new step do not."""
    parts = [env.get(name, "") for name in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT")]
    return ".".join([*parts, rendezvous, str(parent_pid)])


# ---------------------------------------------------------------------------- the copies


@dataclass(frozen=True)
class StagedFile:
    source: str
    local: str | None
    """The copy the loader reads (None: the shared copy)."""
    bytes: int
    action: str
    """COPIED, REUSED, REPLACED or SHARED."""
    checksum_from: str
    """``sidecar`` (prepare-data's SHA-256) or ``shared copy`` (an old sidecar: the source as read)."""


@dataclass(frozen=True)
class StageResult:
    """One task's view of its node's staging."""

    root: str
    files: tuple[StagedFile, ...]
    seconds: float
    """From the call to the copies being ready (the lock's wait included)."""
    copy_s: float
    """Copying and verifying by this task (0: another task of the node did it, or nothing to do)."""
    verify_s: float
    """Re-reading earlier copies to verify them (a new launch)."""
    fallback: str | None = None
    """Why the node reads the shared copy (too little space), else None."""

    @property
    def copied_bytes(self) -> int:
        return sum(f.bytes for f in self.files if f.action in (COPIED, REPLACED))

    def local_paths(self) -> dict[str, str]:
        """Source path -> the local copy, for the files staged."""
        return {f.source: f.local for f in self.files if f.local is not None}

    def as_record(self) -> dict:
        return {
            "root": self.root,
            "seconds": round(self.seconds, 4),
            "copy_s": round(self.copy_s, 4),
            "verify_s": round(self.verify_s, 4),
            "copied_bytes": self.copied_bytes,
            "fallback": self.fallback,
            "files": [dataclasses.asdict(f) for f in self.files],
        }


def file_sha256(path: Path, *, latency_s: float = 0.0) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK):
            if latency_s:
                time.sleep(latency_s)
            digest.update(chunk)
    return digest.hexdigest()


def _read_record(path: Path) -> dict | None:
    try:
        record = read_json(path, max_bytes=1 << 20)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _copy(source: TokenFile, local: Path) -> tuple[str, FileStat]:
    """Copy ``source`` to ``local`` through a temporary file, hashing what is read; the copy
    is then read back from the disk (its pages dropped first) and must hash the same.
    Returns the digest of the source as read and the copy's stat."""
    latency = read_latency_of(source.path)
    tmp = local.with_name(f".{local.name}.{os.getpid()}.tmp")
    read_digest = hashlib.sha256()
    try:
        with open(source.path, "rb") as src, open(tmp, "wb") as dst:
            while chunk := src.read(COPY_CHUNK):
                if latency:
                    time.sleep(latency)
                read_digest.update(chunk)
                dst.write(chunk)
            dst.flush()
            os.fsync(dst.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(dst.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        written = file_sha256(tmp)
        if written != read_digest.hexdigest():
            raise DataError(
                f"--stage-data: the copy of {source.path} at {tmp} does not read back as written (a failing "
                f"local disk?); give another --stage-data DIR, or leave --stage-data out"
            )
        os.replace(tmp, local)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return read_digest.hexdigest(), FileStat.of_present(local)


def _write_record(path: Path, *, source: FileStat, digest: str, checksum_from: str, local: FileStat, launch: str):
    record = {
        "source_size": source.size,
        "source_mtime_ns": source.mtime_ns,
        "sha256": digest,
        "checksum_from": checksum_from,
        "local_mtime_ns": local.mtime_ns,
        "launch": launch,
    }
    write_atomically(path, json.dumps(record) + "\n")


class _NodeLock:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> _NodeLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _taken_by_another(root: Path) -> str | None:
    """Why ``root`` is not this user's to stage into (None: it is, or it is not there yet): someone
    who made ``BASE/hpc-hsdp-staged-<uid>`` first, or put a symlink there, could read or swap the
    copies; that directory is not used, and nothing of it is touched."""
    try:
        info = os.lstat(root)
    except OSError:
        return None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return f"{root} is a symlink or not a directory, not one of yours"
    if info.st_uid != os.geteuid():
        return f"{root} belongs to user id {info.st_uid}, not to you"
    return None


def _shared_copies(files: Sequence[TokenFile], root: Path, began: float, why: str) -> StageResult:
    """Every file read from its shared copy, ``why`` the node does not stage."""
    staged = []
    for f in {str(f.path): f for f in files}.values():
        source = FileStat.of(f.path)
        if source is None:
            raise DataError(f"--stage-data: token file {f.path} is gone; check --data")
        staged.append(StagedFile(str(f.path), None, source.size, SHARED, "sidecar" if f.sha256 else "shared copy"))
    return StageResult(str(root), tuple(staged), time.perf_counter() - began, 0.0, 0.0, why)


def stage_files(
    files: Sequence[TokenFile],
    root: Path,
    *,
    launch: str,
    free_bytes: Callable[[Path], int] | None = None,
) -> StageResult:
    """Make ``root`` hold a verified copy of every file (see the module docstring); every task
    of the node calls it. Raises :class:`DataError` (one line) when ``root`` cannot be made or
    written, or a shared copy does not match its sidecar's SHA-256."""
    began = time.perf_counter()
    taken = _taken_by_another(root)
    if taken:  # never used, never changed: the node reads the shared copy, and says so
        return _shared_copies(files, root, began, f"{taken}; reading the shared copy")
    try:
        root = private_dir(root)
        lock = _NodeLock(root / LOCK_NAME)
        lock.__enter__()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise DataError(f"--stage-data: cannot use {root} ({reason}); {DIR_HINT}") from None
    copy_s = verify_s = 0.0
    try:
        unique = list({str(f.path): f for f in files}.values())
        plans = []
        for f in unique:
            local = root / local_name(f.path)
            record_path = local.with_name(local.name + RECORD_SUFFIX)
            source = FileStat.of(f.path)
            if source is None:
                raise DataError(f"--stage-data: token file {f.path} is gone; check --data")
            record = _read_record(record_path)
            state = copy_state(source=source, expected=f.sha256, record=record, local=FileStat.of(local), launch=launch)
            action = COPIED
            if state == VERIFY:
                assert record is not None  # copy_state verifies only a copy with a record
                t = time.perf_counter()
                if file_sha256(local) == record["sha256"]:
                    _write_record(
                        record_path,
                        source=source,
                        digest=record["sha256"],
                        checksum_from=record.get("checksum_from", "sidecar"),
                        local=FileStat.of_present(local),
                        launch=launch,
                    )
                    state = REUSE
                else:
                    action = REPLACED
                    local.unlink(missing_ok=True)
                    state = COPY
                verify_s += time.perf_counter() - t
            elif state == COPY and FileStat.of(local) is not None:
                action = REPLACED
                local.unlink(missing_ok=True)
            from_ = "sidecar" if f.sha256 else (record or {}).get("checksum_from", "shared copy")
            plans.append((f, local, record_path, source, state, action, from_))
        need = space_needed([source.size for _, _, _, source, state, *_ in plans if state == COPY])
        free = (free_bytes or (lambda p: shutil.disk_usage(p).free))(root)
        if need > free:
            fallback = (
                f"{root} has {free / 2**20:,.0f} MiB free, the token files need {need / 2**20:,.0f} MiB "
                f"(with a margin); reading the shared copy"
            )
            shared = tuple(
                StagedFile(str(f.path), None, source.size, SHARED, from_) for f, _, _, source, *_, from_ in plans
            )
            return StageResult(str(root), shared, time.perf_counter() - began, 0.0, verify_s, fallback)
        staged = []
        for f, local, record_path, source, state, action, from_ in plans:
            if state == REUSE:
                staged.append(StagedFile(str(f.path), str(local), source.size, REUSED, from_))
                continue
            t = time.perf_counter()
            read_digest, copied = _copy(f, local)
            if f.sha256 is not None and read_digest != f.sha256:
                local.unlink(missing_ok=True)
                raise DataError(
                    f"token file {f.path} does not match the sha256 its sidecar records (read {read_digest[:12]}..., "
                    f"recorded {f.sha256[:12]}...): the shared copy is damaged or was changed; prepare the data "
                    f"again with `hpc-hsdp prepare-data`"
                )
            if FileStat.of(f.path) != source:
                local.unlink(missing_ok=True)
                raise DataError(
                    f"--stage-data: token file {f.path} changed while it was copied; do not rewrite --data during a job"
                )
            _write_record(
                record_path, source=source, digest=read_digest, checksum_from=from_, local=copied, launch=launch
            )
            copy_s += time.perf_counter() - t
            staged.append(StagedFile(str(f.path), str(local), source.size, action, from_))
        return StageResult(str(root), tuple(staged), time.perf_counter() - began, copy_s, verify_s)
    finally:
        lock.__exit__()
