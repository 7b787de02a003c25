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
either whole or absent.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from dataclasses import fields
from pathlib import Path

import torch.distributed.checkpoint as dcp

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.models.builtin import BuiltinAdapter
from hpc_hsdp.models.factory import FactoryAdapter
from hpc_hsdp.models.hf import model_from_config_dict
from hpc_hsdp.models.weights import retie_like
from hpc_hsdp.rundir.model_record import MODEL_RECORD
from hpc_hsdp.runtime.checkpoint import complete_checkpoints


def read_model_record(run_dir: Path) -> dict:
    path = run_dir / MODEL_RECORD
    if not path.is_file():
        raise SpecError(
            f"{run_dir} has no {MODEL_RECORD}: it is not a run directory of hpc-hsdp run (or the run is "
            f"older than export); give the --run-dir of a training run"
        )
    return json.loads(path.read_text(encoding="utf-8"))


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
    known = {f.name for f in fields(TrainingSpec)}
    return TrainingSpec(**{k: v for k, v in record.get("training", {}).items() if k in known})


def build_unsharded(record: dict):
    """(model on CPU with empty values, kind) from a run's model record."""
    adapter_record = record.get("adapter", {})
    kind = adapter_record.get("kind")
    if kind == "hf":
        meta = model_from_config_dict(adapter_record["config"])
    else:
        training = _training_from(record)
        if kind == "builtin":
            adapter = BuiltinAdapter.from_training(training, data_vocab_size=record.get("vocab_size"))
        else:
            adapter = FactoryAdapter(training)
        meta = adapter.build_meta()
    model = copy.deepcopy(meta)
    model.to_empty(device="cpu")
    retie_like(model, meta)
    return model, kind


def load_model_values(model, checkpoint_path: Path) -> None:
    """Read the checkpoint's model entries into ``model``'s (full, CPU) tensors, one process."""
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint_path), no_dist=True)
    model.load_state_dict(state["model"])


def export(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None) -> dict:
    """Write the export of ``run_dir``'s checkpoint (newest, or ``step``) to ``out_dir``;
    returns ``{"step", "kind", "files", "out_dir"}``."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not run_dir.is_dir():
        raise SpecError(f"run directory {str(run_dir)!r} does not exist")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise SpecError(f"-o {str(out_dir)!r} exists and is not empty; give a new directory")
    record = read_model_record(run_dir)
    saved_step, checkpoint_path = choose_checkpoint(run_dir, step)
    model, kind = build_unsharded(record)
    load_model_values(model, checkpoint_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        if kind == "hf":
            model.save_pretrained(str(tmp), safe_serialization=True)
            _copy_tokenizer(record, tmp)
        else:
            from safetensors.torch import save_model  # noqa: PLC0415 - safetensors is an optional extra (hf)

            save_model(
                model,
                str(tmp / "model.safetensors"),
                metadata={"hpc_hsdp_model": record["model"], "step": str(saved_step)},
            )
            (tmp / MODEL_RECORD).write_text(json.dumps(dict(record, step=saved_step), indent=1) + "\n")
        files = sorted(p.name for p in tmp.iterdir())
        if out_dir.exists():
            out_dir.rmdir()  # empty (checked above)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"step": saved_step, "kind": kind, "files": files, "out_dir": str(out_dir)}


def _copy_tokenizer(record: dict, out: Path) -> None:
    data = record.get("training", {}).get("data")
    if not data:
        return
    source = Path(data)
    tokenizer_dir = (source if source.is_dir() else source.parent) / "tokenizer"
    if tokenizer_dir.is_dir():
        for path in tokenizer_dir.iterdir():
            if path.is_file():
                shutil.copy2(path, out / path.name)
