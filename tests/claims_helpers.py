"""Helpers shared by tests (moved out of tests/fast/test_run_dir_claims.py: no test module imports another)."""

from __future__ import annotations

import json
from pathlib import Path


def _local_job(run: Path, job_id: str, *, pid: int, state: str = "RUNNING") -> None:
    logs = run / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"{job_id}_local.json").write_text(
        json.dumps({"state": state, "supervisor_pid": pid, "logs_dir": str(logs.absolute())})
    )


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
