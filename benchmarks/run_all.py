"""Run every benchmark, one after another (each prints its own table of side-by-side ratios).

    python benchmarks/run_all.py [--quick]

1 cli        hpc-hsdp render/plan vs python -c "import click, jinja2"     (bench_cli.py)
2+3 runtime  start-up and step time of hpc-hsdp run vs hand-written FSDP2 (bench_runtime.py)
4 traffic    inter-node bytes per step, 2 x 8, shard 1/4/16, vs analytic  (bench_traffic.py)
5 scheduler  hpc-hsdp submit vs sbatch to RUNNING, dev cluster            (bench_scheduler.py)
6 recovery   USR2 -> first resumed step, dev cluster                      (bench_recovery.py)
7 data       prepare-data tokens/s vs tokenizers encode_batch, peak RSS   (bench_data.py)
8 loop       bf16+accum+clip+cosine step vs hand-written FSDP2; data wait  (bench_loop.py)
9 stragglers the per-rank time probe's all-gather vs the step time        (bench_stragglers.py)
10 sizes     plan/render cost from 1 to 65,536 nodes x 8, ratios          (bench_sizes.py)
11 checkpoint save vs disk bandwidth, async stall vs sync save            (bench_checkpoint.py)
14 peers     start-up and step vs hand-written FSDP2 and Lightning Fabric  (bench_peers.py; makes
             benchmarks/.peers-venv with lightning on first use)
26 staging  the data wait with and without --stage-data under read latency  (bench_staging.py)
27 check    the fabric check's time, 2 to 16 emulated nodes                  (bench_check.py)
28 store    --checkpoint-store: step time and save-to-commit at 20 MiB/s     (bench_checkpoint_store.py)
GPU: benchmarks/gpu_hsdp_step.py (tokens/s on one GPU) is not run here; it needs CUDA.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUITE = [
    ("cli", "bench_cli.py", ["--runs", "21"], ["--runs", "7"]),
    ("runtime", "bench_runtime.py", ["--runs", "5", "--steps", "30"], ["--runs", "2", "--steps", "12"]),
    ("traffic", "bench_traffic.py", [], []),
    ("scheduler", "bench_scheduler.py", ["--runs", "5"], ["--runs", "2"]),
    ("recovery", "bench_recovery.py", ["--runs", "3"], ["--runs", "1"]),
    ("data", "bench_data.py", ["--runs", "3", "--megabytes", "4"], ["--runs", "1", "--megabytes", "1"]),
    ("loop", "bench_loop.py", ["--runs", "3", "--steps", "20"], ["--runs", "1", "--steps", "10"]),
    ("stragglers", "bench_stragglers.py", ["--runs", "3", "--steps", "30"], ["--runs", "1", "--steps", "12"]),
    ("sizes", "bench_sizes.py", ["--runs", "5"], ["--runs", "1"]),
    ("checkpoint", "bench_checkpoint.py", ["--runs", "3"], ["--runs", "1", "--width", "256"]),
    (
        "peers",
        "bench_peers.py",
        ["--runs", "5", "--steps", "20"],
        ["--runs", "1", "--steps", "6", "--models", "small", "--startup-phases", "1"],
    ),
    (
        "staging",
        "bench_staging.py",
        ["--runs", "5", "--steps", "12", "--latency-ms", "1,5,20"],
        ["--runs", "1", "--steps", "6", "--latency-ms", "20", "--megabytes", "4"],
    ),
    ("check", "bench_check.py", ["--runs", "3", "--nodes", "2,4,8,16"], ["--runs", "1", "--nodes", "2,4"]),
    ("store", "bench_checkpoint_store.py", ["--runs", "2"], ["--runs", "1", "--steps", "40", "--every", "20"]),
]


def machine() -> str:
    import os

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    try:
        import torch

        torch_version = torch.__version__
    except ImportError:
        torch_version = "not installed"
    return f"{os.cpu_count()} CPUs ({cpu}), Python {platform.python_version()}, torch {torch_version}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run, noisier ratios)")
    parser.add_argument("--only", default=None, help="comma-separated names: " + ",".join(name for name, *_ in SUITE))
    args = parser.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}  {machine()}")
    failed = []
    for name, script, full, quick in SUITE:
        if only and name not in only:
            continue
        print(f"\n## {name}  ({script} {' '.join(quick if args.quick else full)})", flush=True)
        code = subprocess.call([sys.executable, str(HERE / script), *(quick if args.quick else full)])
        if code:
            failed.append(name)
    print("\nGPU: benchmarks/gpu_hsdp_step.py adds tokens/s on one GPU (needs CUDA; not run here).")
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
