"""What a run directory holds, read without torch: its checkpoints, whether they are whole,
and what submitting into it again would do.

Layout of one checkpoint (written by :mod:`hpc_hsdp.task.checkpointing.checkpoint`):
``<run_dir>/checkpoints/step-000010/`` with DCP's files (``.metadata``, ``__<rank>_<n>.distcp``),
``train_state.json``, ``manifest.json`` (every file's size and CRC-32 at save time) and
``COMPLETE``, the last file written. The submitting side (``submit``) and the tasks use the
same functions, so that what ``submit`` says it resumes from is what the job loads.
"""

from __future__ import annotations

import os
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path

from hpc_hsdp.errors import DataError, SpecError
from hpc_hsdp.files import UnreadableFile, open_regular, read_json
from hpc_hsdp.rundir.lifecycle.attempts import end_attempt, read_restarts

COMPLETE = "COMPLETE"
TRAIN_STATE = "train_state.json"
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "hpc-hsdp-checkpoint-manifest"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_CHUNK = 4 << 20


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the checkpoints marked complete, oldest first (whole or not: see
    :func:`damage`)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / COMPLETE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def crc32_of(path: str | Path) -> int:
    """CRC-32 of a regular file's bytes (zlib's, about as fast as the disk reads); a symlink, a
    FIFO or a device (``/dev/zero`` never ends) is UnreadableFile."""
    crc = 0
    with open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def file_record(path: str | Path, *, checksum: bool) -> dict:
    record = {"bytes": os.path.getsize(path)}
    if checksum:
        record["crc32"] = crc32_of(path)
    return record


MAX_MANIFEST_BYTES = 64 << 20
_FILE_NAME = re.compile(r"^(\.metadata|__\d+_\d+\.distcp)$")
"""The files a manifest may name: DCP's, in the checkpoint directory itself."""


def read_manifest(path: str | Path) -> dict | None:
    """The checkpoint's manifest (None: written before manifests existed, or unreadable, or not
    one that hpc-hsdp wrote: a file named otherwise than DCP names its files, a size or CRC-32
    that is not a small integer; then the checkpoint is damaged, see :func:`damage`)."""
    try:
        data = read_json(Path(path) / MANIFEST, max_bytes=MAX_MANIFEST_BYTES)
    except (OSError, ValueError):
        return None
    return manifest_of(data)


def manifest_of(data: object) -> dict | None:
    """A parsed manifest checked as :func:`read_manifest` checks it (None: not one hpc-hsdp wrote)."""
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        return None
    files, total = data.get("files", {}), data.get("total_bytes", 0)
    if not isinstance(files, dict) or not _small_int(total):
        return None
    for name, saved in files.items():
        if not _FILE_NAME.match(name) or not isinstance(saved, dict) or not _small_int(saved.get("bytes")):
            return None
        if "crc32" in saved and not _small_int(saved["crc32"]):
            return None
    return data


def _small_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62


def damage(path: str | Path, *, checksum_files: list[str] | None = None) -> str | None:
    """What is wrong with a complete checkpoint, on one line; None when it is whole.

    Sizes of every file in the manifest are always checked (a stat each); the CRC-32 of the
    files named in ``checksum_files`` (all: ``["*"]``) is recomputed as well. A checkpoint
    without a manifest (hpc-hsdp before 0.2) can only be checked for its train_state.json."""
    path = Path(path)
    if not (path / TRAIN_STATE).is_file():
        return f"{TRAIN_STATE} is missing"
    problem = _train_state_problem(path)
    if problem:
        return problem
    manifest = read_manifest(path)
    if manifest is None:
        return None if not (path / MANIFEST).exists() else f"{MANIFEST} is unreadable"
    files = manifest.get("files", {})
    for name, saved in sorted(files.items()):
        file = path / name
        try:
            info = os.lstat(file)
        except OSError:
            return f"{name} is missing ({saved['bytes']:,} bytes at save)"
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file (a symlink, FIFO or device)"
        size = info.st_size
        if size != saved["bytes"]:
            return f"{name} has {size:,} bytes, {saved['bytes']:,} at save"
    wanted = sorted(files) if checksum_files == ["*"] else sorted(checksum_files or [])
    for name in wanted:
        saved = files.get(name, {})
        try:
            crc = crc32_of(path / name) if "crc32" in saved else None
        except UnreadableFile:
            return f"{name} is not a regular file (a symlink, FIFO or device)"
        if crc is not None and crc != saved["crc32"]:
            return f"{name} has the right size but not the bytes saved (CRC-32 differs)"
    return None


MAX_TRAIN_STATE_BYTES = 4 << 20


def _train_state_problem(path: Path) -> str | None:
    """``train_state.json`` is a JSON object of at most 4 MiB whose ``step`` is the directory's."""
    try:
        data = _read_train_state(path)
    except OSError as exc:
        return f"{TRAIN_STATE} is unreadable ({exc.strerror})"
    except UnreadableFile as exc:
        return f"{TRAIN_STATE}: {str(exc).removeprefix(str(path / TRAIN_STATE) + ' ')}"
    step = data.get("step") if isinstance(data, dict) else None
    if not isinstance(data, dict) or isinstance(step, bool) or not isinstance(step, int):
        return f"{TRAIN_STATE} has no integer step"
    match = _STEP_DIR.match(path.name)
    if match and int(match.group(1)) != step:
        return f"{TRAIN_STATE} says step {step}, the directory {path.name}"
    position = data.get("data")
    if position is not None and not _data_position(position):
        return f"{TRAIN_STATE}'s data position is not one hpc-hsdp wrote (fields missing or of other types)"
    return None


def _read_train_state(path: Path) -> object:
    return read_json(path / TRAIN_STATE, max_bytes=MAX_TRAIN_STATE_BYTES)


def _data_position(position: object) -> bool:
    """``train_state.json``'s ``data``: an object whose global batch, seed and sample count, where
    present, are integers and whose mixture sources, if any, an object of objects (what
    :func:`check_data_position` compares)."""
    if not isinstance(position, dict):
        return False
    for key in ("global_batch", "seed", "num_samples"):
        if key in position and (isinstance(position[key], bool) or not isinstance(position[key], int)):
            return False
    sources = position.get("sources")
    return sources is None or (isinstance(sources, dict) and all(isinstance(v, dict) for v in sources.values()))


def saved_train_state(path: str | Path) -> dict:
    """A checkpoint directory's ``train_state.json``, read as data that may be hostile (a
    regular file of at most 4 MiB holding a JSON object); OSError, ValueError when unreadable."""
    data = _read_train_state(Path(path))
    if not isinstance(data, dict):
        raise UnreadableFile(f"{Path(path) / TRAIN_STATE} is not a JSON object")
    return data


def saved_step(path: str | Path) -> int:
    return int(saved_train_state(path)["step"])


@dataclass(frozen=True)
class RunDirState:
    """What submitting into a run directory would do."""

    run_dir: str
    resume_step: int | None
    """Step of the newest whole checkpoint (None: starts from step 0)."""
    checkpoint: str | None
    skipped: tuple[str, ...] = ()
    """Newer checkpoints found damaged (``step-000010: __1_0.distcp is missing ...``)."""


def run_dir_state(run_dir: str | Path) -> RunDirState:
    """The newest checkpoint whose files all have their saved sizes (no checksums: cheap)."""
    skipped = []
    for step, path in reversed(complete_checkpoints(run_dir)):
        problem = damage(path)
        if problem is None:
            try:
                step = saved_step(path)
            except (OSError, ValueError, KeyError):
                skipped.append(f"{path.name}: {TRAIN_STATE} unreadable")
                continue
            return RunDirState(run_dir=str(run_dir), resume_step=step, checkpoint=str(path), skipped=tuple(skipped))
        skipped.append(f"{path.name}: {problem}")
    return RunDirState(run_dir=str(run_dir), resume_step=None, checkpoint=None, skipped=tuple(skipped))


def resubmission_note(run_dir: str | Path, *, steps: int, state: RunDirState | None = None) -> str | None:
    """Before submitting into ``run_dir``: raise SpecError when its run already reached
    ``steps`` (nothing would train), else say from which step it resumes (None: fresh).
    ``state``: :func:`run_dir_state` of ``run_dir`` when the caller has read it already."""
    state = state or run_dir_state(run_dir)
    damaged = f" (newer checkpoints damaged: {'; '.join(state.skipped)})" if state.skipped else ""
    if state.resume_step is None:
        if state.skipped:
            raise SpecError(
                f"every checkpoint in {run_dir} is damaged ({'; '.join(state.skipped)}), nothing submitted; restore the "
                f"files, or remove {checkpoint_root(run_dir)} to start from step 0, or choose a new --run-dir"
            )
        return None
    if state.resume_step >= steps:
        raise SpecError(
            f"run directory {run_dir} already completed step {state.resume_step} (--steps {steps}): nothing to train, "
            f"nothing submitted; extend the run with --steps N (N > {state.resume_step}) or choose a new --run-dir"
        )
    return (
        f"run directory {run_dir} has a checkpoint at step {state.resume_step}: the job resumes from step "
        f"{state.resume_step} and trains to step {steps}{damaged}"
    )


def check_data_position(
    saved: dict | None, *, global_batch: int, num_samples: int, seed: int, where: str, sources: dict | None = None
) -> None:
    """A checkpoint's data position (``train_state.json``'s ``data``) must continue this run's
    sample stream exactly: the same global batch, seed and number of samples, and for a
    mixture the same sources, weights and samples of each (``sources``: name -> (weight,
    samples)) (DataError)."""
    if not saved:
        return
    saved_sources = {
        name: (str(entry.get("weight")), entry.get("num_samples"))
        for name, entry in (saved.get("sources") or {}).items()
        if isinstance(entry, dict)
    }
    given = {name: (str(weight), samples) for name, (weight, samples) in (sources or {}).items()}
    if saved_sources != given:

        def words(table: dict) -> str:
            sources = ", ".join(f"{n}:{w} ({s} samples)" for n, (w, s) in table.items())
            return f"the mixture {sources}" if sources else "one dataset"

        raise DataError(
            f"{where} was trained on {words(saved_sources)}, this run has {words(given)}; resuming "
            f"would draw other samples: resume with the same --data sources and weights, or start a new --run-dir"
        )
    if saved["global_batch"] != global_batch:
        raise DataError(
            f"{where} was trained with a global batch of {saved['global_batch']} samples, this run has "
            f"{global_batch}; resuming would repeat or skip samples: resume with --global-batch-size "
            f"{saved['global_batch']} (any number of nodes), or start a new --run-dir"
        )
    if saved["seed"] != seed:
        raise DataError(
            f"{where} was trained with --seed {saved['seed']}, this run has --seed {seed}; the data order "
            f"follows the seed: resume with --seed {saved['seed']}"
        )
    if saved["num_samples"] != num_samples:
        raise DataError(
            f"{where} was trained on {saved['num_samples']} samples ({saved.get('source')}), this run's data "
            f"has {num_samples}; resume on the same data and --seq-len"
        )


# ----------------------------------------------------------------------------- restarts and their causes
# The record itself is hpc_hsdp.rundir.lifecycle.attempts' (attempt.json, restarts.jsonl): the components that
# know why an attempt ends (the watchdog: a hang; the survivors of a node failure) write it there.

FAILURE_REASONS = ("hang", "node_failure", "killed", "error", "unknown")
"""Restart reasons that count against ``--max-restarts`` (not the warning signal, SIGTERM,
a requested stop or a resubmission)."""


def record_restart(run_dir: str | Path, *, reason: str, cause: str, step: int | None = None) -> bool:
    """Why the current attempt ends (the first cause written wins): the next attempt's line in
    restarts.jsonl carries it."""
    return end_attempt(run_dir, reason=reason, step=step, detail=cause)


def failure_restarts(run_dir: str | Path, *, job_id: str = "") -> int:
    """Restarts of this job after failures (hang, node failure, killed, error)."""
    return sum(
        1
        for r in read_restarts(run_dir)
        if r.get("reason") in FAILURE_REASONS and (not job_id or str(r.get("job_id")) == job_id)
    )
