"""Helpers shared by tests (moved out of tests/fast/test_trackers.py: no test module imports another)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.job_helpers import tiny_job

ROOT = Path(__file__).resolve().parents[1]


def hpc(*args: str, env: dict | None = None, prelude: str = "", timeout: float = 200) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k == "SLURM_CONF" or not k.startswith(("SLURM", "MASTER_"))}
    base = {k: v for k, v in {**base, **(env or {})}.items() if v is not None}  # None: unset
    code = prelude + "import sys\nfrom hpc_hsdp.cli import main\nsys.argv[0] = 'hpc-hsdp'\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=base,
        cwd=ROOT,
    )


TINY = tiny_job(venv="none")
