"""The dev SLURM cluster (scripts/dev-cluster) for the scheduler benchmarks: up or a reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from _launch import ROOT

DEV_CLUSTER = ROOT / "scripts" / "dev-cluster"


def cluster_env() -> tuple[dict | None, str]:
    """The environment to talk to the dev cluster, or (None, why not)."""
    if shutil.which("sbatch") is None or not DEV_CLUSTER.exists():
        return None, "sbatch not found: the dev cluster is not installed"
    env = dict(os.environ)
    out = subprocess.run([str(DEV_CLUSTER), "env"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            env[key] = value.strip("'\"")
    status = subprocess.run([str(DEV_CLUSTER), "status"], capture_output=True, text=True, env=env)
    if status.returncode != 0:
        return (
            None,
            f"dev cluster is not up ({(status.stdout or status.stderr).strip()[:120]}); start it: scripts/dev-cluster up",
        )
    return env, ""


def job_state(job_id: str, env: dict) -> str:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, env=env)
    return out.stdout.strip() or "GONE"


def wait_state(
    job_id: str, env: dict, states: tuple[str, ...], *, timeout_s: float = 120, poll_s: float = 0.05
) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if job_state(job_id, env) in states:
            return time.time()
        time.sleep(poll_s)
    raise TimeoutError(f"job {job_id} did not reach {states} in {timeout_s} s (now {job_state(job_id, env)})")


def cancel_and_wait_gone(job_id: str, env: dict, timeout_s: float = 60) -> None:
    subprocess.run(["scancel", job_id], env=env, capture_output=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and job_state(job_id, env) != "GONE":
        time.sleep(0.2)
