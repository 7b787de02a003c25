"""What produced a run, gathered at submit (no torch): the code the job runs and where it comes
from (git), the installed packages, Python; and ``--snapshot-code``'s copy of that code.

The code a job runs is hpc-hsdp's own package and the user's module named by ``--entry``,
``--model MODULE:FUNCTION`` or the Python API's function: of each, its top-level package (or
single-file module). A git checkout costs one ``git status`` (the commit, the changes) and, when
tracked files changed, one ``git diff HEAD``; code outside a checkout costs no process at all.
The record is written by :mod:`hpc_hsdp.rundir.lifecycle.provenance_record`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpc_hsdp.batch_shell.code_snapshot import MAX_SNAPSHOT_BYTES, copy_code
from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import is_time, write_atomically
from hpc_hsdp.rundir.lifecycle.provenance_record import (
    MAX_DIFF_BYTES,
    SNAPSHOT_DIR,
    commit_id,
    read_provenance,
    snapshot_path,
    write_provenance,
)

GIT_TIMEOUT_S = 10.0
MAX_UNTRACKED = 50
"""Untracked files named per checkout (their count is always kept)."""
INSTALLED = ("site-packages", "dist-packages")


# ----------------------------------------------------------------------------- which code runs


def top_module(target: str | None) -> str | None:
    """``mypkg.models:build`` -> ``mypkg``; None for none, ``builtin`` and ``hf:PATH``."""
    if not target or target == "builtin" or target.startswith("hf:") or ":" not in target:
        return None
    return target.partition(":")[0].split(".")[0] or None


def user_modules(spec, fn=None) -> list[str]:
    """The top-level modules of the user's code a job runs (without hpc-hsdp's own), in order."""
    names = [top_module(spec.run.entry), top_module(spec.run.training.model.name)]
    module = getattr(fn, "__module__", None) if fn is not None else None
    if isinstance(module, str) and module != "__main__":
        names.append(module.split(".")[0])
    seen: list[str] = []
    for name in names:
        if name and name != "hpc_hsdp" and name not in seen:
            seen.append(name)
    return seen


def module_paths(name: str) -> list[Path]:
    """Where the top-level module ``name`` lies: its package directory (or directories: a namespace
    package) or its file; [] when it cannot be found here or is built in. Found, not imported."""
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    if found is None:
        return []
    if found.submodule_search_locations:
        return [Path(p) for p in found.submodule_search_locations]
    if found.origin and found.has_location and Path(found.origin).is_file():
        return [Path(found.origin)]
    return []


def own_package() -> Path:
    """hpc-hsdp's package directory, as this interpreter imports it."""
    return Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- git


def checkout_of(path: Path) -> Path | None:
    """The git checkout holding ``path`` (a directory with ``.git``, looked for upwards: no
    process), None outside one and for an installed copy (under site-packages)."""
    path = path.resolve()
    if any(part in INSTALLED for part in path.parts):
        return None
    for parent in (path, *path.parents):
        if (parent / ".git").exists():
            return parent
    return None


def _git(checkout: Path, *args: str) -> bytes:
    done = subprocess.run(
        ["git", "-C", str(checkout), *args],
        capture_output=True,
        timeout=GIT_TIMEOUT_S,
        env={**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"},
        check=False,
    )
    if done.returncode != 0:
        said = " ".join(done.stderr.decode("utf-8", "replace").split())[:200]
        raise OSError(f"git {args[0]} failed (exit {done.returncode}): {said}")
    return done.stdout


def git_state(checkout: Path) -> dict:
    """The commit of ``checkout`` and its uncommitted changes: ``commit``, ``dirty`` (tracked files
    changed, or untracked files), ``diff`` (of the tracked files against HEAD, cut at
    :data:`MAX_DIFF_BYTES`), ``diff_sha256`` (of the whole diff), ``untracked``; ``error`` instead
    when git cannot say (not installed, not a repository it trusts, too slow)."""
    try:
        status = _git(checkout, "status", "--porcelain=v2", "--branch", "-z", "--untracked-files=normal")
    except (OSError, subprocess.SubprocessError) as exc:
        return {"error": " ".join(str(exc).split())[:300]}
    commit, changed, untracked = None, False, []
    for item in status.decode("utf-8", "replace").split("\0"):
        if item.startswith("# branch.oid "):
            oid = item.split()[-1]
            commit = oid if oid != "(initial)" else None
        elif item.startswith(("1 ", "2 ", "u ")):
            changed = True
        elif item.startswith("? "):
            untracked.append(item[2:])
    state: dict = {"commit": commit, "dirty": changed or bool(untracked), "untracked": untracked[:MAX_UNTRACKED]}
    if len(untracked) > MAX_UNTRACKED:
        state["untracked_count"] = len(untracked)
    if changed and commit is not None:
        try:
            diff = _git(checkout, "diff", "HEAD", "--no-color", "--no-ext-diff", "--binary")
        except (OSError, subprocess.SubprocessError) as exc:
            state["error"] = " ".join(str(exc).split())[:300]
            return state
        state["diff_sha256"] = hashlib.sha256(diff).hexdigest()
        state["diff_bytes"] = len(diff)
        state["diff_truncated"] = len(diff) > MAX_DIFF_BYTES
        state["diff"] = diff[:MAX_DIFF_BYTES].decode("utf-8", "replace")
    elif untracked:
        state["diff_sha256"] = hashlib.sha256("\0".join(untracked).encode()).hexdigest()
    return state


def code_record(name: str, paths: list[Path], states: dict[Path, dict]) -> dict:
    """One ``code`` entry: the module's location and its checkout's state (``states``: one git
    look per checkout, shared by the modules in it)."""
    entry: dict = {"name": name, "path": ", ".join(str(p) for p in paths) or None}
    checkout = checkout_of(paths[0]) if paths else None
    if checkout is None:
        return entry
    if checkout not in states:
        states[checkout] = git_state(checkout)
    return {**entry, "checkout": str(checkout), **states[checkout]}


# ----------------------------------------------------------------------------- packages, Python


def installed_packages() -> dict[str, str]:
    """name -> version of every distribution this interpreter sees, from the ``*.dist-info`` and
    ``*.egg-info`` directory names on ``sys.path`` (the first one wins, as imports do): no
    metadata file is opened, a few milliseconds for hundreds of packages."""
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            for suffix in (".dist-info", ".egg-info"):
                if name.endswith(suffix):
                    package, _, version = name[: -len(suffix)].partition("-")
                    version = version.split("-")[0]
                    key = package.lower().replace("_", "-")
                    if version and key not in found:
                        found[key] = version
    return dict(sorted(found.items()))


def python_record() -> dict:
    return {
        "version": platform.python_version(),
        "implementation": platform.python_implementation(),
        "executable": sys.executable,
    }


def gather_provenance(spec, fn=None) -> dict:
    """The submission's record (without the job id and script, known once submitted)."""
    states: dict[Path, dict] = {}
    code = [code_record("hpc_hsdp", [own_package()], states)]
    for name in user_modules(spec, fn):
        code.append(code_record(name, module_paths(name), states))
    return {
        "submitted_at": time.time(),
        "host": platform.node(),
        "cwd": os.getcwd(),
        "argv": list(sys.argv),
        "python": python_record(),
        "code": code,
        "packages": installed_packages(),
        "snapshot": None,
    }


# ----------------------------------------------------------------------------- --snapshot-code


def snapshot_code(run_dir: str | Path, spec, fn=None) -> dict:
    """Copy the code the job runs into ``<run_dir>/code`` (:func:`~hpc_hsdp.batch_shell.code_snapshot.copy_code`:
    hpc-hsdp's package and the user's module, its top-level package or its file; regular files only,
    private, counted against the cap as copied), replacing an earlier copy; its SHA-256, which the
    rendered script carries and the job checks before it imports anything of it, is the record's
    ``sha256``. :class:`SpecError` when a module cannot be found or the code is larger than
    :data:`~hpc_hsdp.batch_shell.code_snapshot.MAX_SNAPSHOT_BYTES`; nothing is left half-copied."""
    sources: list[tuple[str, list[Path]]] = [("hpc_hsdp", [own_package()])]
    for name in user_modules(spec, fn):
        paths = module_paths(name)
        if not paths:
            raise SpecError(
                f"--snapshot-code: module {name!r} cannot be found here, so it cannot be copied; make it importable "
                f"(pip install -e, or PYTHONPATH) or submit without --snapshot-code; nothing submitted"
            )
        sources.append((name, paths))
    target = snapshot_path(run_dir)
    staging = target.with_name(f".{SNAPSHOT_DIR}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        copied = copy_code(sources, staging, max_bytes=MAX_SNAPSHOT_BYTES, within={"hpc_hsdp": own_package().parent})
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            old = target.with_name(f".{SNAPSHOT_DIR}.{os.getpid()}.old")
            os.replace(target, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(staging, target)
    except SpecError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    except (OSError, RecursionError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise SpecError(f"--snapshot-code: could not copy the code into {target} ({exc}); nothing submitted") from None
    return {
        "dir": SNAPSHOT_DIR,
        "modules": [n for n, _ in sources],
        "bytes": copied.bytes,
        "files": copied.files,
        "skipped": copied.skipped,
        "sha256": copied.sha256,
    }


def snapshot_note(snapshot: dict | None) -> str | None:
    """What submit says of a snapshot that left files out (symlinks leaving their tree, FIFOs, devices)."""
    if not snapshot or not snapshot.get("skipped"):
        return None
    return (
        f"--snapshot-code: {snapshot['skipped']} entr{'y' if snapshot['skipped'] == 1 else 'ies'} not copied into "
        f"code/ (symlinks that leave their tree or name a directory, FIFOs, devices): only regular files are"
    )


MAX_EARLIER = 100
"""Earlier submissions into one run directory whose code ``provenance.json`` keeps (the newest)."""


def earlier_submissions(previous: dict | None) -> list[dict]:
    """What a resubmission keeps of the run's earlier submissions (a resumed run may have trained
    its first steps on other code): each one's job id, time and :func:`commit_id`."""
    if previous is None:
        return []
    kept = [e for e in previous.get("earlier", []) if isinstance(e, dict)]
    submitted = previous.get("submitted_at")
    kept.append(
        {
            "job_id": previous.get("job_id") if isinstance(previous.get("job_id"), str) else None,
            "submitted_at": submitted if is_time(submitted) else None,
            "commit": commit_id(previous),
        }
    )
    return kept[-MAX_EARLIER:]


def record_submission(run_dir: str | Path, provenance: dict, *, job_id: str, script: str, logs_dir: Path) -> None:
    """``provenance.json`` of a submitted job: the record, the job id and the rendered script it
    was sent, which the scheduler keeps as ``logs/<job id>_submission.sh`` (written there when it
    did not). A file system that refuses the write costs the record, not the job."""
    script_file = logs_dir / f"{job_id}_submission.sh"
    try:
        if not script_file.is_file() or script_file.is_symlink():
            write_atomically(script_file, script)  # a symlink there is refused, never followed
        name = str(script_file.relative_to(run_dir)) if script_file.is_relative_to(run_dir) else str(script_file)
        write_provenance(
            run_dir,
            {
                **provenance,
                "job_id": str(job_id),
                "script": name,
                "script_sha256": hashlib.sha256(script.encode()).hexdigest(),
                "earlier": earlier_submissions(read_provenance(run_dir)),
            },
        )
    except OSError as exc:
        print(f"hpc-hsdp: provenance.json not written in {run_dir}: {exc}", file=sys.stderr)
