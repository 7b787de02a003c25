"""Helpers shared by tests (moved out of tests/fast/test_bounds_and_resubmit.py: no test module imports another)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

MEMORY_LIMIT = 1 << 30  # 1 GiB of address space: more than a 4,096-node plan needs, far less than a runaway one


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def hpc(
    *args: str, cwd: Path | None = None, limit_memory: bool = False, timeout: float = 240
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MASTER_"))}
    return subprocess.run(
        [sys.executable, "-m", "hpc_hsdp", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
        preexec_fn=_limited if limit_memory else None,
    )
