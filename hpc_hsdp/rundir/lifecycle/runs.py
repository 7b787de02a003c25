"""Finding run directories under a directory (``hpc-hsdp runs``)."""

from __future__ import annotations

from pathlib import Path

from hpc_hsdp.rundir.lifecycle.attempts import ATTEMPT
from hpc_hsdp.rundir.lifecycle.job_record import JOB_RECORD
from hpc_hsdp.rundir.training.metrics import METRICS

RUN_MARKERS = (METRICS, ATTEMPT, JOB_RECORD)
"""A directory holding any of these is a run directory."""


def find_run_dirs(root: Path, depth: int) -> list[Path]:
    """Directories holding a run's files, not looking inside a run (checkpoints, tb, logs)."""
    found: list[Path] = []

    def visit(path: Path, level: int) -> None:
        if any((path / marker).is_file() for marker in RUN_MARKERS):
            found.append(path)
            return
        if level >= depth:
            return
        try:
            children = sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        for child in children:
            visit(child, level + 1)

    visit(root, 0)
    return found
