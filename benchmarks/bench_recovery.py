"""Recovery: from the preemption signal to the first resumed training step, on the dev
SLURM cluster (scripts/dev-cluster; skipped with a message when it is not up).

    python benchmarks/bench_recovery.py [--runs N]

Per trial: `hpc-hsdp submit --cluster slurm` a long 2 x 2 CPU job (requeue on), wait for
step 3 in metrics.jsonl, send `scancel --signal=USR2 <job>` (every task gets USR2: every
rank saves, rank 0 requeues), then time

  requeued   the job leaves RUNNING (requeue: PENDING/REQUEUED/...)
  running    the job RUNNING again
  resumed    rank 0's log says "[hpc-hsdp] resumed from step N"
  step       metrics.jsonl holds step N+1 written after the signal (its wall_time)

all from the signal; then the job is cancelled. No baseline exists for this one: the
number is absolute (seconds), reported with the scheduler's own share (signal -> RUNNING).
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
from _cluster import cancel_and_wait_gone, cluster_env, job_state  # noqa: E402
from _launch import hpc_hsdp_command  # noqa: E402

from hpc_hsdp.rundir.files import read_jsonl  # noqa: E402

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
    "--requeue",
]
RESUMED = re.compile(r"\[hpc-hsdp\] resumed from (?:step (\d+)|.*\(step (\d+))")


def _metrics(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "metrics.jsonl")  # stops at a line being written


def _resumed_step(run_dir: Path) -> int | None:
    for log in sorted((run_dir / "logs").glob("*.out")):
        for match in RESUMED.finditer(log.read_text(errors="replace")):
            return int(match.group(1) or match.group(2))
    return None


def _until(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"no {what} within {timeout_s} s")


def trial(work: Path, env: dict) -> dict[str, float]:
    run_dir = work / f"rec-{time.monotonic_ns()}"
    out = subprocess.run(
        [*hpc_hsdp_command(), "submit", "--cluster", "slurm", *JOB, "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        env=env,
    )
    match = re.search(r"submitted job (\d+)", out.stdout)
    if out.returncode != 0 or not match:
        raise RuntimeError(f"submit failed: {out.stdout}{out.stderr}")
    job = match.group(1)
    try:
        _until(lambda: any(r["step"] >= 3 for r in _metrics(run_dir)), 180, "step 3")
        signalled = time.time()
        subprocess.run(["scancel", "--signal=USR2", job], check=True, env=env)
        t = {}
        t["requeued"] = _until(lambda: job_state(job, env) != "RUNNING" and time.time(), 120, "requeue") - signalled
        t["running"] = _until(lambda: job_state(job, env) == "RUNNING" and time.time(), 300, "restart") - signalled
        resumed = _until(lambda: _resumed_step(run_dir), 300, "'resumed from' line in the logs")
        t["resumed"] = time.time() - signalled
        record = _until(
            lambda: next(
                (r for r in _metrics(run_dir) if r["step"] == resumed + 1 and r["wall_time"] > signalled), None
            ),
            300,
            f"step {resumed + 1}",
        )
        t["step"] = record["wall_time"] - signalled
        t["resume_step"] = resumed
        return t
    finally:
        cancel_and_wait_gone(job, env)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    env, why = cluster_env()
    if env is None:
        print(f"recovery benchmark skipped: {why}")
        return 0
    trials = []
    with tempfile.TemporaryDirectory(prefix="hpc-hsdp-recovery-") as tmp:
        for _ in range(args.runs):
            try:
                trials.append(trial(Path(tmp), env))
            except (TimeoutError, RuntimeError) as exc:
                print(f"recovery benchmark could not complete a trial: {exc}")
                print(
                    "(it needs preemption/requeue on USR2 and the resume line; see hpc_hsdp/task/resilience/preemption.py)"
                )
                return 1
    print(f"{'from USR2 to':<28} {'median s':>9}   (dev cluster, 2 x 2 CPU tasks, n={args.runs})")
    for key, label in (
        ("requeued", "job left RUNNING (requeue)"),
        ("running", "job RUNNING again"),
        ("resumed", "'resumed from' logged"),
        ("step", "first resumed step done"),
    ):
        print(f"{label:<28} {statistics.median(t[key] for t in trials):>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
