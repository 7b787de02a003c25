"""Helpers shared by tests (moved out of tests/processes/test_preemption.py: no test module imports another)."""

from __future__ import annotations

from pathlib import Path

from hpc_hsdp.rundir.files import read_jsonl


def steps(run: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(run / "metrics.jsonl")]
