"""``<run-dir>/layout.json``: the realized rank layout rank 0 writes after the mesh check.

One entry per rank (``rank``, ``node``, ``slurm_procid``, ...); the readers here answer the
questions ``status``, ``logs`` and ``report`` ask of it. A missing or damaged file is no
answer (None), never an error: a run that has not started yet has none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpc_hsdp.files import read_json
from hpc_hsdp.rundir.files import atomic_write_text

LAYOUT = "layout.json"
RANK_FIELDS = (
    "rank",
    "node",
    "slurm_procid",
    "local_rank",
    "device",
    "shard_group",
    "replicate_group",
    "tp_group",
    "node_switch",
    "pid",
)
"""What each rank's entry holds (``pid``: its process on its node, for ``hpc-hsdp stacks``; ``tp_group``
only with tensor parallelism; ``node_switch``, its node's
leaf switch, only where SLURM's topology says it)."""
MAX_LAYOUT_BYTES = 64 << 20
"""A layout of 100,000 ranks is about 20 MB."""


def layout_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / LAYOUT


def write_layout(run_dir: str | Path, record: dict) -> Path:
    """Rank 0, after the mesh check: the plan, the rendezvous and each rank's entry, durably."""
    path = layout_path(run_dir)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def rank_entries(run_dir: str | Path) -> list[dict] | None:
    """The per-rank entries, in rank order."""
    try:
        layout: Any = read_json(layout_path(run_dir), max_bytes=MAX_LAYOUT_BYTES)  # of another shape: caught below
        ranks = layout["ranks"]
        if not isinstance(ranks, list) or not all(_is_entry(r) for r in ranks):
            return None
        return sorted(ranks, key=lambda r: r["rank"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _is_entry(entry: object) -> bool:
    """A rank's entry as rank 0 writes it: an object whose rank, task id and local rank are small
    integers and whose node, where given, is a string (a reader prints them, draws them, and
    indexes by them)."""
    if not isinstance(entry, dict):
        return False
    for key in ("rank", "slurm_procid", "local_rank"):
        value = entry.get(key)
        if key != "rank" and value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 24:
            return False
    return isinstance(entry.get("node", ""), str)


def nodes_by_rank(run_dir: str | Path) -> list[str] | None:
    """The node of each rank, indexed by rank."""
    entries = rank_entries(run_dir)
    try:
        return None if entries is None else [str(r["node"]) for r in entries]
    except (KeyError, TypeError):
        return None


def procid_of_rank(run_dir: str | Path, rank: int) -> int | None:
    """SLURM's task id of a node-major rank (they differ under cyclic, and under torchrun,
    whose workers all belong to their node's one task)."""
    for entry in rank_entries(run_dir) or []:
        if entry.get("rank") == rank and entry.get("slurm_procid") is not None:
            return int(entry["slurm_procid"])
    return None


def rank_of_task(run_dir: str | Path, task: int) -> int | None:
    """The node-major rank of SLURM task ``task`` (srun launcher)."""
    for entry in rank_entries(run_dir) or []:
        if entry.get("slurm_procid") == task:
            return int(entry["rank"])
    return None
