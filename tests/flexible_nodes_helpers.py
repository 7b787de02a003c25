"""Helpers shared by tests (moved out of tests/fast/test_flexible_nodes.py: no test module imports another)."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_hsdp", *args], capture_output=True, text=True, timeout=120)
