"""Distributed checkpoints: torch.distributed.checkpoint, atomic, keep the last K.

Layout: ``<run_dir>/checkpoints/step-000010/`` holds DCP's files (``.metadata``,
``__<rank>_0.distcp``), ``train_state.json`` (step, seed, world size, batch size, the
mesh it was written from) and ``COMPLETE``. A save goes to ``step-000010.tmp`` (first
removing any ``.tmp`` a crash left); after every rank has written, rank 0 writes
``train_state.json`` and ``COMPLETE`` and renames the directory: a directory without
``.tmp`` and with ``COMPLETE`` is always whole. DCP stores
replicated shards once and reshards on load, so a checkpoint loads into another mesh
shape or world size.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpc_hsdp.runtime import faults
from hpc_hsdp.runtime.files import atomic_write_text

COMPLETE = "COMPLETE"
TRAIN_STATE = "train_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def complete_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints, oldest first (filesystem only, no torch)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir() and (path / COMPLETE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint as seen by rank 0, agreed by every rank."""
    choice = [None]
    if dist.get_rank() == 0:
        found = complete_checkpoints(run_dir)
        choice[0] = (found[-1][0], str(found[-1][1])) if found else None
    dist.broadcast_object_list(choice, src=0)
    return None if choice[0] is None else (choice[0][0], Path(choice[0][1]))


def save(run_dir: str | Path, model, optimizer, *, step: int, train_state: dict, keep: int) -> Path:
    """Collective: every rank writes its shards; returns the final directory."""
    root = checkpoint_root(run_dir)
    final = root / step_dir_name(step)
    tmp = root / (step_dir_name(step) + ".tmp")
    rank0 = dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.tmp"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    faults.in_save(dist.get_rank(), step)  # test hook: a rank dies with the checkpoint half written
    dist.barrier()  # every rank's files are written
    if rank0:
        atomic_write_text(tmp / TRAIN_STATE, json.dumps(dict(train_state, step=step), indent=1) + "\n")
        atomic_write_text(tmp / COMPLETE, f"step {step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        prune(run_dir, keep=keep)
    dist.barrier()  # nobody reads checkpoints/ while rank 0 renames and prunes
    return final


def prune(run_dir: str | Path, *, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (rank 0 only)."""
    found = complete_checkpoints(run_dir)
    doomed = [path for _, path in found[: max(0, len(found) - keep)]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def load(path: str | Path, model, optimizer) -> dict:
    """Collective: load model and optimizer state into the (possibly resharded) model;
    returns the saved ``train_state.json``."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((path / TRAIN_STATE).read_text(encoding="utf-8"))
