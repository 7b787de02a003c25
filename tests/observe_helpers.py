"""Helpers shared by tests (moved out of tests/fast/test_observe.py: no test module imports another)."""

from __future__ import annotations

import os
import subprocess
import sys

NODES = ["n1", "n1", "n2", "n2"]


def hpc(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k == "SLURM_CONF" or not k.startswith(("SLURM", "MASTER_"))}
    return subprocess.run(
        [sys.executable, "-m", "hpc_hsdp", *args], capture_output=True, text=True, timeout=timeout, env=base
    )
