"""``hpc-hsdp export RUN_DIR [--step N] -o DIR``: a run's sharded checkpoint as files the
ecosystem loads, converted offline on one process (no process group, any machine that
sees the run directory; the job's node count does not matter).

- ``hf:`` models: a transformers model directory, ``config.json`` + ``model.safetensors``
  (``save_pretrained``), plus the tokenizer files when the run's ``--data`` directory has
  a ``tokenizer/``: ``AutoModelForCausalLM.from_pretrained(DIR)`` loads it.
- ``builtin`` and ``MODULE:FUNCTION`` models: ``DIR/model.safetensors`` (the full state,
  a tied parameter once, ``safetensors.torch.save_model``) and ``DIR/model.json`` (what
  the run recorded: the model, its config, the training options).

The model comes from ``RUN_DIR/model.json`` (written by the loop at start: the ``hf:``
config itself, so the source directory may be gone); the values from the checkpoint's
``model`` entries only (DCP reads them into full tensors; the optimizer is not read).
The output is written to a temporary directory beside ``DIR`` and renamed: ``DIR`` is
either whole or absent. ``DIR/hpc-hsdp-export.json`` names the run it came from: a later
export of the same run may replace it; any other non-empty ``DIR`` is refused.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from hpc_hsdp.data.tokens import DATASET_MANIFEST
from hpc_hsdp.errors import HsdpError, SpecError
from hpc_hsdp.files import UnreadableFile, read_json
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.models.builtin import BuiltinAdapter
from hpc_hsdp.models.factory import FactoryAdapter
from hpc_hsdp.models.hf import model_from_config_dict
from hpc_hsdp.models.third_party_noise import progress_bars_on_a_terminal
from hpc_hsdp.models.weights import retie_like
from hpc_hsdp.plan.mixture import data_paths
from hpc_hsdp.rundir.checkpointing.state import damage
from hpc_hsdp.rundir.training.model_record import MODEL_RECORD
from hpc_hsdp.task.checkpointing.checkpoint import complete_checkpoints
from hpc_hsdp.task.checkpointing.safe_dcp import load_state, unsafe_content


def read_model_record(run_dir: Path) -> dict:
    path = run_dir / MODEL_RECORD
    if not path.is_file():
        raise SpecError(
            f"{run_dir} has no {MODEL_RECORD}: it is not a run directory of hpc-hsdp run (or the run is "
            f"older than export); give the --run-dir of a training run"
        )
    try:
        record = _checked_model_record(read_json(path, max_bytes=_MAX_RECORD_BYTES, finite=False))  # hf: Infinity
    except UnreadableFile as exc:
        raise SpecError(f"{exc}; give the --run-dir of a training run") from None
    except (OSError, ValueError) as exc:
        raise SpecError(
            f"{path} is not a model record written by hpc-hsdp run ({' '.join(str(exc).split())[:120]})"
        ) from None
    return record


def _checked_model_record(record: object) -> dict:
    """``record`` when the fields export uses are of the types the loop writes (else ValueError naming
    the first that is not)."""
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    adapter, training = record.get("adapter", {}), record.get("training", {})
    if not isinstance(adapter, dict) or not isinstance(training, dict):
        raise ValueError("adapter or training is not an object")
    if adapter.get("kind") == "hf" and not isinstance(adapter.get("config"), dict):
        raise ValueError("an hf adapter without a config object")
    if not isinstance(record.get("model", ""), str):
        raise ValueError("model is not a string")
    vocab = record.get("vocab_size")
    if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab < 1 << 31):
        raise ValueError("vocab_size is not a positive integer")
    return record


_MAX_RECORD_BYTES = 16 << 20


def choose_checkpoint(run_dir: Path, step: int | None) -> tuple[int, Path]:
    found = complete_checkpoints(run_dir)
    if not found:
        raise SpecError(f"{run_dir} has no complete checkpoint (checkpoints/step-N/COMPLETE); train first")
    if step is None:
        return found[-1]
    for saved, path in found:
        if saved == step:
            return saved, path
    raise SpecError(
        f"{run_dir} has no complete checkpoint of step {step}; it has steps {', '.join(str(s) for s, _ in found)}"
    )


def _training_from(record: dict):
    known = set(TrainingSpec().options())
    return TrainingSpec.of(**{k: v for k, v in record.get("training", {}).items() if k in known})


def factory_of(record: dict, model: str | None, where: Path) -> str:
    """The ``MODULE:FUNCTION`` that builds a factory run's model for export: the one the user names
    again (``--model``), never the one the record names, which whoever can write the run directory
    could point at any module (one placed in the run directory, ``signal:pause``): export loads
    weights, it runs no code a record names. SpecError, naming the record's, without ``model``."""
    if model is not None:
        return model
    named = record.get("training", {}).get("model") or record.get("model") or "?"
    raise SpecError(
        f"{where / MODEL_RECORD} says the model was built by {str(named)[:120]!r}; export imports no code that a run's "
        f"record names (whoever can write the run directory could name any module): if you trust it, name it "
        f"again with --model MODULE:FUNCTION"
    )


def build_unsharded(record: dict, *, model: str | None = None, where: Path = Path(".")):
    """(model on CPU with empty values, kind) from a run's model record; a ``MODULE:FUNCTION``
    model is built by ``model``, which the user named (:func:`factory_of`)."""
    adapter_record = record.get("adapter", {})
    kind = adapter_record.get("kind")
    if kind == "hf":
        meta = model_from_config_dict(adapter_record["config"])
    else:
        training = _training_from(record)
        adapter: BuiltinAdapter | FactoryAdapter
        if kind == "builtin":
            adapter = BuiltinAdapter.from_training(training, data_vocab_size=record.get("vocab_size"))
        else:
            adapter = FactoryAdapter(training.replace(model=factory_of(record, model, where)))
        meta = adapter.build_meta()
    built = copy.deepcopy(meta)
    built.to_empty(device="cpu")
    retie_like(built, meta)
    return built, kind


def load_model_values(model, checkpoint_path: Path) -> None:
    """Read the checkpoint's model entries into ``model``'s (full, CPU) tensors, one process."""
    state = {"model": model.state_dict()}
    load_state(state, checkpoint_path, no_dist=True)
    model.load_state_dict(state["model"])


def export(
    run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None, factory: str | None = None
) -> dict:
    """Write the export of ``run_dir``'s checkpoint (newest, or ``step``) to ``out_dir``;
    returns ``{"step", "kind", "files", "out_dir"}``. ``factory``: the ``MODULE:FUNCTION`` of a
    factory run, named again by the user (the record's is never imported)."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not run_dir.is_dir():
        raise SpecError(f"run directory {str(run_dir)!r} does not exist")
    replaces = _check_output(out_dir, run_dir)
    record = read_model_record(run_dir)
    if record.get("adapter", {}).get("kind") not in ("hf", "builtin"):
        factory_of(record, factory, run_dir)  # refused before anything is read: the user names the factory
    saved_step, checkpoint_path = choose_checkpoint(run_dir, step)
    problem = damage(checkpoint_path, checksum_files=["*"]) or unsafe_content(checkpoint_path)
    if problem:
        raise SpecError(
            f"checkpoint {checkpoint_path} is damaged ({problem}); nothing exported: give the --step of "
            f"another checkpoint, or restore this one"
        )
    try:
        model, kind = build_unsharded(record, model=factory, where=run_dir)
    except HsdpError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as exc:  # what a record of other types makes
        raise SpecError(
            f"{run_dir / MODEL_RECORD} does not describe a model hpc-hsdp can build "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]}); give the --run-dir of a training run"
        ) from None
    skipped: list[str] = []
    load_model_values(model, checkpoint_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        if kind == "hf":
            with progress_bars_on_a_terminal():
                model.save_pretrained(str(tmp), safe_serialization=True)
            skipped = _copy_tokenizer(record, tmp)
        else:
            from safetensors.torch import save_model  # noqa: PLC0415 - safetensors is an optional extra (hf)

            save_model(
                model,
                str(tmp / "model.safetensors"),
                metadata={"hpc_hsdp_model": record["model"], "step": str(saved_step)},
            )
            (tmp / MODEL_RECORD).write_text(json.dumps(dict(record, step=saved_step), indent=1) + "\n")
        (tmp / EXPORT_MARKER).write_text(
            json.dumps({"format": EXPORT_FORMAT, "run_dir": str(run_dir.resolve()), "step": saved_step}) + "\n"
        )
        files = sorted(p.name for p in tmp.iterdir())
        if replaces:
            old = out_dir.rename(out_dir.with_name(f"{tmp.name}.replaced"))
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if out_dir.exists():
                out_dir.rmdir()  # empty (checked above)
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"step": saved_step, "kind": kind, "files": files, "out_dir": str(out_dir), "skipped": skipped}


EXPORT_MARKER = "hpc-hsdp-export.json"
EXPORT_FORMAT = "hpc-hsdp-export"


def _check_output(out_dir: Path, run_dir: Path) -> bool:
    """Whether ``out_dir`` is a previous export of this run, to be replaced (True), or new or
    empty (False); SpecError for anything else: a file, a symlink, another directory's contents."""
    if not out_dir.is_symlink() and (not out_dir.exists() or out_dir.is_dir() and not any(out_dir.iterdir())):
        return False
    if not out_dir.is_symlink() and out_dir.is_dir() and _exported_from(out_dir) == str(run_dir.resolve()):
        return True
    raise SpecError(
        f"-o {str(out_dir)!r} exists and is not empty (and is not an export of this run); give a new directory"
    )


def _exported_from(out_dir: Path) -> str | None:
    """The run directory a previous export names in its marker (untrusted: size-capped, type-checked)."""
    marker = out_dir / EXPORT_MARKER
    try:
        record = read_json(marker, max_bytes=65536)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("format") != EXPORT_FORMAT:
        return None
    return record.get("run_dir") if isinstance(record.get("run_dir"), str) else None


def _copy_tokenizer(record: dict, out: Path) -> list[str]:
    """Copy the regular files of the run's ``<data>/tokenizer/`` (a mixture's first source's) into ``out``; returns the
    entries skipped (symlinks, which could point anywhere, devices, directories), by path."""
    training = record.get("training", {})
    data = training.get("data") if isinstance(training, dict) else None
    if not data or not isinstance(data, str):
        return []
    try:
        source = Path(data_paths(data)[0][1])  # a mixture's sources share one tokenizer: the first one's
    except SpecError:
        return []
    dataset_dir = source if source.is_dir() else source.parent
    tokenizer_dir = dataset_dir / "tokenizer"
    if not _is_regular(dataset_dir / DATASET_MANIFEST):
        # only a dataset prepare-data wrote: a data path edited into model.json (or a directory above it
        # swapped for a symlink) that leads elsewhere, to a tokenizer/ of someone else's, copies nothing
        return [str(tokenizer_dir)] if os.path.lexists(tokenizer_dir) else []
    try:  # the directory itself, not where a symlink of that name leads (~/.ssh)
        dir_fd = os.open(tokenizer_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError:  # ELOOP or ENOTDIR: a symlink, or not a directory
        return [str(tokenizer_dir)] if os.path.lexists(tokenizer_dir) else []
    skipped = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            if not _copy_regular_file(dir_fd, name, out / name):
                skipped.append(str(tokenizer_dir / name))
    finally:
        os.close(dir_fd)
    return skipped


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _copy_regular_file(dir_fd: int, name: str, destination: Path) -> bool:
    """Copy the entry ``name`` of the directory ``dir_fd`` when it is a regular file itself
    (opened there without following a symlink, so a link swapped in after a check is refused
    too, and without blocking on a FIFO); False when it is not."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:  # ELOOP: a symlink; or unreadable
        return False
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return False
    with os.fdopen(fd, "rb") as src, open(destination, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return True
