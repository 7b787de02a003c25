"""`hpc-hsdp submit` to job RUNNING, against plain `sbatch` of the same rendered script, on
the dev SLURM cluster (scripts/dev-cluster; skipped with a message when it is not up).

    python benchmarks/bench_scheduler.py [--runs N]

Each trial times from the start of the command to the first `squeue` that shows the job
RUNNING (polled every 50 ms), then cancels the job and waits until it has left the queue.
Trials alternate (sbatch, submit, submit, sbatch, ...). Target: submit / sbatch <= 1.5.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _cluster import cancel_and_wait_gone, cluster_env, wait_state  # noqa: E402
from _launch import hpc_hsdp_command  # noqa: E402

TARGET = 1.5
JOB = [
    "--nodes",
    "2",
    "--gpus-per-node",
    "2",
    "--shard",
    "2",
    "--device",
    "cpu",
    "--steps",
    "100000",
    "--width",
    "32",
    "--layers",
    "1",
    "--seq-len",
    "8",
    "--batch-size",
    "2",
]


def trial(kind: str, work: Path, env: dict) -> float:
    run_dir = work / f"{kind}-{time.monotonic_ns()}"
    if kind == "sbatch":
        script = work / f"{run_dir.name}.sbatch"
        subprocess.run(
            [*hpc_hsdp_command(), "render", *JOB, "--run-dir", str(run_dir), "-o", str(script)],
            check=True,
            env=env,
            capture_output=True,
        )
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        cmd = ["sbatch", str(script)]
    else:
        cmd = [*hpc_hsdp_command(), "submit", "--cluster", "slurm", *JOB, "--run-dir", str(run_dir)]
    started = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    match = re.search(r"(?:Submitted batch job|submitted job) (\d+)", out.stdout)
    if out.returncode != 0 or not match:
        raise RuntimeError(f"{kind} failed: {out.stdout}{out.stderr}")
    job_id = match.group(1)
    try:
        running = wait_state(job_id, env, ("RUNNING",))
    finally:
        cancel_and_wait_gone(job_id, env)
    return running - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    env, why = cluster_env()
    if env is None:
        print(f"scheduler benchmark skipped: {why}")
        return 0
    times: dict[str, list[float]] = {"sbatch": [], "submit": []}
    with tempfile.TemporaryDirectory(prefix="hpc-hsdp-sched-") as tmp:
        for i in range(args.runs):
            for kind in ("sbatch", "submit") if i % 2 == 0 else ("submit", "sbatch"):
                times[kind].append(trial(kind, Path(tmp), env))
    base = statistics.median(times["sbatch"])
    print(f"{'command':<8} {'to RUNNING s':>13} {'ratio':>6}   (dev cluster, 2 nodes, n={args.runs}, alternating)")
    for kind, samples in times.items():
        print(f"{kind:<8} {statistics.median(samples):>13.3f} {statistics.median(samples) / base:>6.2f}")
    ratio = statistics.median(times["submit"]) / base
    print(f"submit / sbatch = {ratio:.2f} (target <= {TARGET}): {'ok' if ratio <= TARGET else 'ABOVE TARGET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
