"""Helpers shared by tests (moved out of tests/processes/test_run_dir_claims.py: no test module imports another)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from cluster_helpers import (
    hpc,
)

from tests.job_helpers import tiny_job

TINY = tiny_job(venv="none")


_AT_THE_BARRIER = """
import os, sys, time
barrier = sys.argv[1]
open(barrier + "." + str(os.getpid()), "w").close()
while not os.path.exists(barrier):
    time.sleep(0.001)
from hpc_hsdp.cli import main
main(sys.argv[2:])
"""


def race(tmp_path: Path, *args: str, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run ``hpc-hsdp ARGS`` in two processes that start it at the same moment: both load,
    wait at a barrier file, and go when it appears."""
    barrier = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _AT_THE_BARRIER, str(barrier), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("go.*"))) < 2:
        assert time.monotonic() < deadline, "the racers did not reach the barrier"
        time.sleep(0.01)
    barrier.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def one_run_one_refusal(results: list[subprocess.CompletedProcess], run: Path) -> tuple[str, str]:
    """The winner's job id and the loser's one line; the loser wrote nothing."""
    codes = sorted(r.returncode for r in results)
    assert codes == [0, 2], [(r.returncode, r.stdout, r.stderr) for r in results]
    won = next(r for r in results if r.returncode == 0)
    lost = next(r for r in results if r.returncode == 2)
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    assert f"submitted job {job_id} " in won.stdout
    assert lost.stdout == ""
    lines = lost.stderr.splitlines()
    assert len(lines) == 1, lost.stderr
    assert lines[0].startswith(f"hpc-hsdp: error: job {job_id} is still "), lines[0]
    assert f"in run directory {run}: nothing submitted" in lines[0]
    return job_id, lines[0]


def wait_state(run: Path, states: tuple[str, ...], timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        shown = hpc("status", str(run), "--json")
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        if status["state"] in states:
            return status
        assert time.monotonic() < deadline, f"job still {status['state']}"
        time.sleep(0.5)


def wait_steps(run: Path, steps: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    metrics = run / "metrics.jsonl"
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < steps:
        assert time.monotonic() < deadline, f"fewer than {steps} steps after {timeout_s:.0f} s"
        time.sleep(0.2)


def _status(run: Path) -> dict:
    shown = hpc("status", str(run), "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)
