"""Helpers shared by tests (moved out of tests/cluster/test_slurm.py: no test module imports another)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from tests.job_helpers import tiny_job

TINY = tiny_job(vocab_size=None, device="cpu", steps=2)


def job_fields(job_id: str) -> dict[str, str]:
    """The job's ``KEY=VALUE`` fields from ``scontrol -o show job`` (empty once SLURM forgot it)."""
    shown = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    return dict(item.split("=", 1) for item in shown.split() if "=" in item)


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def sbatch_wait(args: list[str], *, timeout_s: float = 240) -> subprocess.CompletedProcess:
    """``sbatch --wait ARGS``, without its polling: sbatch sleeps 2, 8, then 32 s between looks
    at the job (SLURM's sbatch.c, with the default MinJobAge of 300 s), so a job of 12 s took
    42 s to be seen ending. Submits, then looks every half second; the return code is the
    job's exit code, as sbatch's."""
    submitted = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=30)
    if submitted.returncode != 0:
        return submitted
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout_s
    while True:
        fields = job_fields(job_id)
        if fields.get("JobState") in FINAL_STATES:  # COMPLETING (the output not yet closed) is not final
            code = int(fields.get("ExitCode", "1:0").split(":")[0]) or (0 if fields["JobState"] == "COMPLETED" else 1)
            return subprocess.CompletedProcess(submitted.args, code, f"job {job_id} {fields['JobState']}\n", "")
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            raise subprocess.TimeoutExpired(submitted.args, timeout_s)
        time.sleep(0.5)


def _ranks(run_dir: Path) -> tuple[dict, list[dict]]:
    layout = json.loads((run_dir / "layout.json").read_text())
    return layout, sorted(layout["ranks"], key=lambda r: r["rank"])


def _logs(run: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run / "logs").glob("*")) if p.is_file())
