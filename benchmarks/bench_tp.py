"""What tensor parallelism costs a step on CPU: the same job, the same model and global batch, with
the ranks of one node arranged (shard 4, tp 1), (shard 2, tp 2) and (shard 1, tp 4).

    python benchmarks/bench_tp.py [--runs N] [--steps N] [--width W]

Each variant is `hpc-hsdp run` on an emulated 1 x 4 SLURM job step (gloo, one thread a rank),
the built-in model, fp32, `--comm-stats`; the variants interleave round by round, so that machine
noise hits all alike. Printed per variant: the median step time of steps 4..N (each run's median,
then the median over runs), its ratio to (shard 4, tp 1) measured in the same run, and the TP
group's and the shard group's tensor bytes per step from `--comm-stats`.

On CPU a TP step moves activations through gloo (an all-reduce per rank for each reduce-scatter,
pytorch PR 149869) where HSDP moves parameters; what a GPU node's NVLink makes of it is for
`benchmarks/gpu_run.sh` (`gpu_tp_step.py`: tp 1/2/4/8 on one node).
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

VARIANTS = {"shard 4, tp 1": ("4", "1"), "shard 2, tp 2": ("2", "2"), "shard 1, tp 4": ("1", "4")}


def run_variant(shard: str, tp: str, args, root: Path) -> list[dict]:
    run_dir = root / f"s{shard}t{tp}"
    model = ["--width", str(args.width), "--layers", "4", "--heads", "8", "--seq-len", "128", "--vocab-size", "512"]
    argv = [
        *hpc_hsdp_command(),
        *("run", "--shard", shard, "--tp", tp, "--device", "cpu", "--run-dir", str(run_dir), "--comm-stats"),
        *("--steps", str(args.steps), "--global-batch-size", "8", "--batch-size", "8", "--precision", "fp32"),
        *("--straggler-every", "0", "--tracker", "none"),
        *model,
    ]
    job_step(argv, tasks_per_node=(4,), log_dir=run_dir / "bench-logs")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    traffic: dict[str, dict] = {}
    for round_ in range(args.runs):
        for name, (shard, tp) in VARIANTS.items():
            with tempfile.TemporaryDirectory(prefix="bench-tp-") as root:
                records = run_variant(shard, tp, args, Path(root))
            medians[name].append(statistics.median(r["step_time_s"] for r in records[3:]))
            comm = records[-1]["comm"]
            traffic[name] = {
                axis: sum(v["tensor_bytes"] for k, v in comm.get(axis, {}).items() if isinstance(v, dict))
                for axis in ("tp", "shard")
            }
            print(f"round {round_ + 1}: {name}: {medians[name][-1] * 1000:.1f} ms", flush=True)
    base = statistics.median(medians["shard 4, tp 1"])
    print(f"\nwidth {args.width}, 4 blocks, seq 128, global batch 8, fp32, 4 ranks on one node; {args.runs} runs")
    print(f"{'variant':<16}{'step ms':>10}{'/ shard 4':>11}{'tp MiB/step':>14}{'shard MiB/step':>16}")
    for name in VARIANTS:
        step = statistics.median(medians[name])
        tp_mib, shard_mib = (traffic[name][axis] / 2**20 for axis in ("tp", "shard"))
        print(f"{name:<16}{step * 1000:>10.1f}{step / base:>11.3f}{tp_mib:>14.2f}{shard_mib:>16.2f}")


if __name__ == "__main__":
    main()
