"""``<run-dir>/trackers.json``: the tracker runs of this run directory, one per tracker.

Rank 0 writes an entry when a tracker's run is created and reads it when the job resumes,
is requeued or is submitted again into the directory, so that every attempt continues the
same run::

    {"tensorboard": {"logged_through": 40},
     "wandb": {"run_id": "k3j2h1g0", "project": "hpc-hsdp", "attempts": 2, "logged_through": 40},
     "mlflow": {"run_id": "9f...", "experiment_id": "1", "tracking_uri": "file:///.../mlruns", "attempts": 2,
                "logged_through": 40}}

A missing or damaged file is no entry (a new run starts), never an error.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from hpc_hsdp.files import read_json
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.rundir.files import atomic_write_text
from hpc_hsdp.rundir.status_section import RunView, StatusSection

TRACKERS_FILE = "trackers.json"
TB_DIR = "tb"
"""TensorBoard's event files: ``<run-dir>/tb``."""
MLFLOW_DIR = "mlruns"
"""MLflow's local file store, where ``MLFLOW_TRACKING_URI`` names none: ``<run-dir>/mlruns``."""
_MAX_TRACKERS_BYTES = 1 << 20


def trackers_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / TRACKERS_FILE


def read_tracker_runs(run_dir: str | Path) -> dict[str, dict]:
    """Every tracker's entry (``{}``: none yet, or a file that cannot be read)."""
    try:
        entries = read_json(trackers_path(run_dir), max_bytes=_MAX_TRACKERS_BYTES)
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}


def tracker_run(run_dir: str | Path, name: str) -> dict | None:
    """The entry of one tracker (``wandb``, ``mlflow``), or None."""
    return read_tracker_runs(run_dir).get(name)


def write_tracker_run(run_dir: str | Path, name: str, entry: dict) -> None:
    """Set one tracker's entry, durably, keeping the others."""
    entries = read_tracker_runs(run_dir)
    entries[name] = entry
    atomic_write_text(trackers_path(run_dir), json.dumps(entries, indent=1, sort_keys=True) + "\n")


def record_progress(run_dir: str | Path, logged_through: dict[str, int]) -> None:
    """Each tracker's ``logged_through``: the last step its run is known to hold (written by the
    tracker thread every few seconds and at the end of an attempt). A later attempt gives the
    tracker the rows of ``metrics.jsonl`` after it, which an attempt that died before the
    tracker took them (a cancelled job, a node lost) never gave."""
    entries = read_tracker_runs(run_dir)
    for name, step in logged_through.items():
        entries.setdefault(name, {})["logged_through"] = step
    atomic_write_text(trackers_path(run_dir), json.dumps(entries, indent=1, sort_keys=True) + "\n")


def record_off(run_dir: str | Path, name: str, reason: str) -> None:
    """A tracker that could not start this attempt, and why (``status`` and ``submit --wait`` say
    it); its run's other fields are kept for a later attempt."""
    entries = read_tracker_runs(run_dir)
    entries[name] = {**entries.get(name, {}), "off": reason, "off_at": time.time()}
    atomic_write_text(trackers_path(run_dir), json.dumps(entries, indent=1, sort_keys=True) + "\n")


def clear_off(run_dir: str | Path, name: str) -> None:
    """The tracker started this attempt: an earlier attempt's ``off`` no longer holds."""
    entries = read_tracker_runs(run_dir)
    entry = entries.get(name)
    if isinstance(entry, dict) and "off" in entry:
        entries[name] = {k: v for k, v in entry.items() if k not in ("off", "off_at")}
        atomic_write_text(trackers_path(run_dir), json.dumps(entries, indent=1, sort_keys=True) + "\n")


def trackers_off(run_dir: str | Path) -> list[str]:
    """``tracker mlflow is off: REASON`` for each tracker that could not start (the latest attempt's)."""
    return [
        f"tracker {name} is off: {entry['off']}"
        for name, entry in sorted(read_tracker_runs(run_dir).items())
        if isinstance(entry, dict) and isinstance(entry.get("off"), str)
    ]


TRACKERS_OFF_SECTION: StatusSection[RunView, list[str]] = StatusSection(
    name="trackers-off",
    read=lambda view: trackers_off(view.run_dir),
    lines=lambda found: [terminal_safe(off) for off in found],
    fields=lambda found: {"trackers_off": found},
)
