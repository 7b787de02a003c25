"""What the real-cluster tests share: hpc-hsdp's CLI in a fresh interpreter, a job's status as
JSON, the tails of its logs, and waits that fail showing both."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from cli_helpers import hpc as cli_hpc

ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
"""A job's final states (held, requeued and pending ones pass on the way back from a requeue)."""


def hpc(
    *args: str, env: dict | None = None, timeout: float = 300, input: str | None = None
) -> subprocess.CompletedProcess:
    """:func:`cli_helpers.hpc` against the dev cluster (its ``SLURM_CONF``)."""
    return cli_hpc(*args, env=env, timeout=timeout, slurm=True, input=input)


def status(run: Path) -> dict:
    """``hpc-hsdp status RUN --json``, which must answer."""
    shown = hpc("status", str(run), "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def log_tails(run: Path, pattern: str = "*_log.*", chars: int = 1500) -> str:
    """The last ``chars`` of each of the job's logs that match ``pattern``, named."""
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}" for p in sorted((Path(run) / "logs").glob(pattern))
    )


def wait_until(what: str, check, timeout_s: float, run: Path, *, poll_s: float = 0.5):
    """``check()``'s first truthy value; after ``timeout_s`` the test fails with the job's status and
    its logs' tails."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached in {timeout_s} s; status {status(run)}\n{log_tails(run)}")
        time.sleep(poll_s)


def wait_ended(run: Path, timeout_s: float = 240) -> dict:
    """The job's status once it is in a final state (:data:`ENDED`)."""
    return wait_until(
        "the end of the job", lambda: (s := status(run))["state"].split()[0] in ENDED and s, timeout_s, run
    )
