"""``<run-dir>/model.json``: which model a run trains and the data it reads (rank 0 writes it).

``hpc-hsdp export`` rebuilds the model from it without the job's nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc_hsdp.rundir.files import atomic_write_text

MODEL_RECORD = "model.json"


def model_record_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / MODEL_RECORD


def write_model_record(run_dir: str | Path, record: dict) -> None:
    atomic_write_text(model_record_path(run_dir), json.dumps(record, indent=1) + "\n")
