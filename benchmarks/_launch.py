"""Start one emulated SLURM job step on this machine: a process per task, each with the
environment SLURM would give it (hpc_hsdp.plan.slurm_env) plus what a hand-written script
needs (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def hpc_hsdp_command() -> list[str]:
    script = Path(sys.executable).with_name("hpc-hsdp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hpc_hsdp"]


def job_step(
    argv: list[str],
    *,
    tasks_per_node: tuple[int, ...],
    log_dir: Path,
    timeout_s: float = 600,
    threads: int = 1,
    torch_env: bool = False,
    extra_env: dict | None = None,
) -> float:
    """Run ``argv`` once per task; returns the Unix time just before the first process started.
    Raises with the log tail of a failing task. ``extra_env``: more variables for every task."""
    from hpc_hsdp.plan.slurm_env import task_environments

    envs = task_environments(
        tasks_per_node=list(tasks_per_node), node_names=[f"bn{i + 1}" for i in range(len(tasks_per_node))], job_id="777"
    )
    port = str(free_port())
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))
    }
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    started = time.time()
    for i, env in enumerate(envs):
        env = {
            **base,
            **env,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": str(ROOT),
        }
        if torch_env:  # the hand-written baseline reads torch's variables, not SLURM's
            env.update(
                {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_NTASKS"], "LOCAL_RANK": env["SLURM_LOCALID"]}
            )
        env.update(extra_env or {})
        log = open(log_dir / f"task-{i}.log", "w")
        procs.append((subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT)), log))
    deadline = time.monotonic() + timeout_s
    failed = []
    for i, (proc, log) in enumerate(procs):
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            code = "timeout"
        log.close()
        if code != 0:
            failed.append((i, code))
    if failed:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
        i, code = failed[0]
        tail = "\n".join((log_dir / f"task-{i}.log").read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"task {i} of {argv[:4]} ended with {code}:\n{tail}")
    return started
