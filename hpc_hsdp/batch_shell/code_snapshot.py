"""``--snapshot-code``'s copy of the code a job runs: private, named by its SHA-256, checked before import.

At submit, :func:`copy_code` writes ``<run-dir>/code``: the regular files of each tree only (a
symlink that leaves its tree, or names a directory, and a FIFO or device are skipped and counted;
``/dev/zero`` is never read), each counted against the cap as it is copied, directories 0700 and
files 0600 whatever the umask, created without following a symlink. Its SHA-256 (of the manifest:
every file's path, size and SHA-256) goes into the rendered script, which the scheduler keeps a
copy of that nobody else can change.

On the job, before anything of the snapshot is on ``PYTHONPATH``, the batch shell runs
``python -m hpc_hsdp.batch_shell.code_snapshot <run-dir>/code SHA256`` with the installed hpc-hsdp:
:func:`verified_copy` reads every file of ``code/`` once (through directory descriptors, a symlink
never followed), hashes it and writes it into this user's private cache
(``~/.cache/hpc-hsdp/code/<sha256>``, shared by the job's nodes through the home directory), and
prints that directory, which the script puts first on ``PYTHONPATH``. A tree whose SHA-256 differs
fails the job in one line. What is imported is the copy that was hashed: swapping ``code/`` after
the check (a rename needs only write access to the run directory) changes nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import UnreadableFile, open_for_writing, open_regular, private_dir

MAX_SNAPSHOT_BYTES = 256 << 20
"""``--snapshot-code`` refuses code larger than this (a package that holds data, or a whole tree)."""
SKIPPED_NAMES = ("__pycache__", ".git")
BLOCK = 1 << 20
CACHE_VARIABLE = "HPC_HSDP_CODE_CACHE"
"""Where the verified copies go instead of ``$XDG_CACHE_HOME/hpc-hsdp/code`` (a directory every node sees)."""
SNAPSHOT_VARIABLE = "HPC_HSDP_CODE_SNAPSHOT"
"""Set by the batch script to the verified copy it put on ``PYTHONPATH`` (the task's provenance says whether it ran it)."""


class SnapshotTooLarge(SpecError):
    """The code to copy passed :data:`MAX_SNAPSHOT_BYTES` while it was copied."""


class SnapshotMismatch(SpecError):
    """``code/`` is not what submit copied: a file changed, added, removed, or not a regular file."""


@dataclass
class _Tree:
    """Files copied so far: the manifest's lines, their bytes, what was skipped."""

    max_bytes: int
    lines: list[str] = field(default_factory=list)
    visited: set[str] = field(default_factory=set)
    bytes: int = 0
    skipped: int = 0

    def sha256(self) -> str:
        return hashlib.sha256("".join(sorted(self.lines)).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class CopiedCode:
    sha256: str
    bytes: int
    files: int
    skipped: int
    """Symlinks that leave their tree (or name a directory), FIFOs, devices and sockets: not copied."""


def _private_mkdir(path: Path) -> None:
    os.mkdir(path, 0o700)  # never through a symlink: an existing entry is FileExistsError
    os.chmod(path, 0o700, follow_symlinks=False)


def _copy_stream(source, destination: Path, rel: str, tree: _Tree, *, too_large) -> None:
    digest, size = hashlib.sha256(), 0
    with open_for_writing(destination, exclusive=True, private=True) as out:
        while chunk := source.read(BLOCK):
            size += len(chunk)
            tree.bytes += len(chunk)
            if tree.bytes > tree.max_bytes:
                raise too_large(tree)
            digest.update(chunk)
            out.write(chunk)
    tree.lines.append(f"{digest.hexdigest()} {size} {rel}\n")


def _too_large(tree: _Tree) -> SnapshotTooLarge:
    return SnapshotTooLarge(
        f"--snapshot-code: the code to copy passed {tree.max_bytes >> 20} MiB; keep data out of the package "
        f"or submit without --snapshot-code; nothing submitted"
    )


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _copy_source_dir(root: str, folder: str, target: Path, rel: str, tree: _Tree) -> None:
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    for entry in entries:
        if entry.name in SKIPPED_NAMES or entry.name.endswith(".pyc"):
            continue
        if "\n" in entry.name:
            tree.skipped += 1
            continue
        source, is_dir = entry.path, entry.is_dir(follow_symlinks=False)
        if entry.is_symlink():
            source = os.path.realpath(entry.path)
            mode = os.stat(source).st_mode if os.path.exists(source) else 0
            is_dir = stat.S_ISDIR(mode)
            if not _inside(source, root) or not (is_dir or stat.S_ISREG(mode)) or source in tree.visited:
                tree.skipped += 1  # it leaves the tree, loops or leads nowhere: not copied, never followed
                continue
        if is_dir:
            tree.visited.add(os.path.realpath(source))
            _private_mkdir(target / entry.name)
            _copy_source_dir(root, source, target / entry.name, f"{rel}/{entry.name}", tree)
            continue
        try:
            with open_regular(source) as f:
                _copy_stream(f, target / entry.name, f"{rel}/{entry.name}", tree, too_large=_too_large)
        except UnreadableFile:
            tree.skipped += 1  # a FIFO, a device (/dev/zero), a socket


def copy_code(
    sources: Sequence[tuple[str, Sequence[Path]]],
    target: Path,
    *,
    max_bytes: int = MAX_SNAPSHOT_BYTES,
    within: Mapping[str, Path] | None = None,
) -> CopiedCode:
    """Copy each module's ``paths`` (a package's directories, or a module's file) into ``target``,
    which must not exist: ``target/NAME/...`` for a package, ``target/FILE`` for a module. A symlink
    is followed only where it stays inside its package's directory (or ``within[NAME]``: the
    checkout of hpc-hsdp's own package, whose templates may be a link beside it). Raises
    :class:`SnapshotTooLarge` past ``max_bytes``, OSError when the copy fails (``target`` may then
    hold part of it: the caller removes it)."""
    tree = _Tree(max_bytes=max_bytes)
    _private_mkdir(target)
    for name, paths in sources:
        for path in paths:
            real = os.path.realpath(path)
            if os.path.isdir(real):
                if not (target / name).exists():
                    _private_mkdir(target / name)
                root = os.path.realpath((within or {}).get(name, real))
                tree.visited.add(real)
                _copy_source_dir(root, real, target / name, name, tree)
            else:
                with open_regular(real) as f:
                    _copy_stream(f, target / Path(path).name, Path(path).name, tree, too_large=_too_large)
    return CopiedCode(sha256=tree.sha256(), bytes=tree.bytes, files=len(tree.lines), skipped=tree.skipped)


# ----------------------------------------------------------------------------- on the job


def cache_dir(env=None) -> Path:
    env = os.environ if env is None else env
    if env.get(CACHE_VARIABLE):
        return Path(env[CACHE_VARIABLE])
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hpc-hsdp" / "code"


def _mismatch(snapshot: Path, why: str) -> SnapshotMismatch:
    return SnapshotMismatch(
        f"--snapshot-code: {snapshot} is not the code submit copied ({why}): someone changed it, so the job "
        f"does not run it; submit again"
    )


def _verify_dir(snapshot: Path, fd: int, target: Path, rel: str, tree: _Tree) -> None:
    with os.scandir(fd) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    for entry in entries:
        name_rel = f"{rel}/{entry.name}" if rel else entry.name
        if entry.is_dir(follow_symlinks=False):
            sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                _private_mkdir(target / entry.name)
                _verify_dir(snapshot, sub, target / entry.name, name_rel, tree)
            finally:
                os.close(sub)
            continue
        try:
            file_fd = os.open(entry.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            raise _mismatch(snapshot, f"{name_rel} is a symlink or cannot be read") from None
        with os.fdopen(file_fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(file_fd).st_mode):
                raise _mismatch(snapshot, f"{name_rel} is not a regular file")
            os.set_blocking(file_fd, True)
            _copy_stream(
                f, target / entry.name, name_rel, tree, too_large=lambda t: _mismatch(snapshot, "it grew past the cap")
            )


def verified_copy(snapshot: str | Path, sha256: str, *, cache: Path | None = None) -> Path:
    """The private copy of ``snapshot`` whose SHA-256 is ``sha256`` (made now from ``snapshot``, or
    made before: the cache is this user's alone). :class:`SnapshotMismatch` when the tree's SHA-256
    differs; SpecError when the cache cannot be used."""
    snapshot = Path(snapshot)
    if len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256):
        raise SpecError(
            f"--snapshot-code: no SHA-256 of the code in this script ({sha256!r}): only submit copies the code "
            f"and records it; submit the job rather than sbatch a rendered script"
        )
    try:
        root = private_dir(cache or cache_dir())
    except (PermissionError, OSError) as exc:
        raise SpecError(f"--snapshot-code: the private copy of the code cannot be kept: {exc}") from None
    final = root / sha256
    if final.is_dir() and not final.is_symlink():
        return final
    staging = Path(tempfile.mkdtemp(prefix=f".{sha256[:16]}.", dir=root))
    try:
        try:
            fd = os.open(snapshot, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _mismatch(snapshot, f"it is a symlink or cannot be opened: {exc.strerror}") from None
        tree = _Tree(max_bytes=MAX_SNAPSHOT_BYTES)
        try:
            _verify_dir(snapshot, fd, staging, "", tree)
        finally:
            os.close(fd)
        if tree.sha256() != sha256:
            raise _mismatch(snapshot, f"its SHA-256 is {tree.sha256()[:16]}..., submit recorded {sha256[:16]}...")
        try:
            os.rename(staging, final)
        except OSError:  # another task of the job made it first
            shutil.rmtree(staging, ignore_errors=True)
        return final
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


USAGE = "usage: python -m hpc_hsdp.batch_shell.code_snapshot RUN_DIR/code SHA256"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        print(verified_copy(argv[0], argv[1]))
    except (SpecError, OSError) as exc:
        print(f"hpc-hsdp: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
