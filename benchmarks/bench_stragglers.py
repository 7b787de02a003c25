"""What finding stragglers costs: `hpc-hsdp run` with --straggler-every 0, 10 and 1.

    python benchmarks/bench_stragglers.py [--runs N] [--steps N]

Each run is one emulated SLURM job step of 4 processes (2 nodes x 2, --shard 2, gloo on
CPU, one thread each), the same model as bench_runtime.py; the variants run interleaved,
N times. The cost of a step is the median gap between consecutive steps' wall times on
rank 0 (steps 3..N): it holds the step, the probe's all-gather and the wrappers that time
every collective. Reported: each variant against --straggler-every 0 (nothing measured,
no wrapper); and, from the records themselves, the probe's all-gather as rank 0 timed it
(``stragglers.share_s``) over the step time, per probe and at the default of every 10
steps (target < 1%). On a loaded machine every extra collective waits for four processes
to be scheduled: the in-record share is the steadier number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import hpc_hsdp_command, job_step  # noqa: E402
from bench_runtime import MODEL, SHARD, TASKS  # noqa: E402

VARIANTS = (0, 10, 1)
TARGET_SHARE = 0.01


def run_once(every: int, steps: int, work: Path) -> tuple[float, float, list[float]]:
    out = work / f"every-{every}"
    argv = [
        *hpc_hsdp_command(),
        "run",
        "--shard",
        str(SHARD),
        "--device",
        "cpu",
        "--run-dir",
        str(out),
        "--steps",
        str(steps),
        "--straggler-every",
        str(every),
        *[arg for k, v in MODEL.items() for arg in (f"--{k}", str(v))],
    ]
    job_step(argv, tasks_per_node=TASKS, log_dir=work / f"every-{every}-logs")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    gaps = [b["wall_time"] - a["wall_time"] for a, b in zip(records[2:], records[3:])]
    shares = [r["stragglers"]["share_s"] / r["step_time_s"] for r in records[2:] if "stragglers" in r]
    return statistics.median(gaps), statistics.median(r["step_time_s"] for r in records[2:]), shares


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    gaps: dict[int, list[float]] = {v: [] for v in VARIANTS}
    steps: dict[int, list[float]] = {v: [] for v in VARIANTS}
    shares: list[float] = []
    for i in range(args.runs):
        for every in VARIANTS if i % 2 == 0 else tuple(reversed(VARIANTS)):
            with tempfile.TemporaryDirectory(prefix="hpc-hsdp-bench-") as tmp:
                gap, step, share = run_once(every, args.steps, Path(tmp))
            gaps[every].append(gap)
            shares += share
            steps[every].append(step)
    med = {v: statistics.median(g) for v, g in gaps.items()}
    base = med[0]
    print(
        f"{'--straggler-every':<18} {'step-to-step ms':>16} {'ratio':>7}   (4 procs, 2 x 2, shard {SHARD}; "
        f"medians of {args.runs} interleaved runs of {args.steps} steps)"
    )
    for v in VARIANTS:
        print(f"{v:<18} {med[v] * 1000:>16.2f} {med[v] / base:>7.4f}")
    probe = med[1] - base
    print(f"one probe, step-to-step (every 1 - every 0): {probe * 1000:.2f} ms = {probe / base:.2%} of a step")
    share = statistics.median(shares)
    print(
        f"one probe's all-gather in the records: median {share:.3%} of the step time ({len(shares)} probes); "
        f"at every 10: {share / 10:.3%} of step time (target < {TARGET_SHARE:.0%})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
