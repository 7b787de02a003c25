"""The fabric check's wall time against the node count (issue 37).

    python benchmarks/bench_check.py [--runs N] [--nodes 2,4,8,16] [--cluster local|slurm]

Each run is ``hpc-hsdp check --nodes N --gpus-per-node 1 --device cpu`` (one task per node, gloo):
on the local emulator every node is a process of this machine; on the dev SLURM cluster
(``--cluster slurm``, under its lock) a node is one of its slurmds. Reported per node count
(medians over the runs, the counts interleaved run by run): the check's own time as rank 0
measured it (``check.json``'s ``seconds``: from the first figure to the verdict, past the process
group's start), the whole job's wall time (submit to the end, the table printed), and each as a
ratio to the smallest count's in the same run. The check is built to cost two or three rounds of
pairs whatever the node count; on the emulator the processes share this machine's cores, so
there the time per node grows with the count for want of cores, not of rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_check(nodes: int, cluster: str, work: Path) -> tuple[float, float]:
    run_dir = work / f"check-{nodes}-{time.time_ns()}"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "hpc_hsdp", "check", "--cluster", cluster, "--nodes", str(nodes),
         "--gpus-per-node", "1", "--device", "cpu", "--run-dir", str(run_dir), "--check-threshold", "0.3"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    wall = time.perf_counter() - start
    record = json.loads((run_dir / "check.json").read_text())
    if done.returncode not in (0, 1):
        raise SystemExit(f"check at {nodes} nodes failed: {done.stderr[-2000:]}")
    return record["seconds"], wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--nodes", default="2,4,8,16")
    parser.add_argument("--cluster", default="local", choices=("local", "slurm"))
    args = parser.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    seconds: dict[int, list[float]] = {n: [] for n in counts}
    walls: dict[int, list[float]] = {n: [] for n in counts}
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        for run in range(args.runs):
            for n in counts:
                check_s, wall_s = one_check(n, args.cluster, Path(tmp))
                seconds[n].append(check_s)
                walls[n].append(wall_s)
                print(f"run {run + 1} nodes {n:>3}: check {check_s:6.2f} s, job {wall_s:6.1f} s", flush=True)
    base_check, base_wall = statistics.median(seconds[counts[0]]), statistics.median(walls[counts[0]])
    print(f"\n{args.cluster}: {'nodes':>5} {'check s':>8} {'x':>5} {'job s':>7} {'x':>5} {'rounds':>6}")
    for n in counts:
        check_s, wall_s = statistics.median(seconds[n]), statistics.median(walls[n])
        rounds = 1 if n == 2 else (2 if n % 2 == 0 else 3)
        print(
            f"{'':>{len(args.cluster) + 1}} {n:>5} {check_s:>8.2f} {check_s / base_check:>5.2f} "
            f"{wall_s:>7.1f} {wall_s / base_wall:>5.2f} {rounds:>6}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
