"""Start-up and step time of `hpc-hsdp run` against a minimal hand-written FSDP2 script.

    python benchmarks/bench_runtime.py [--runs N] [--steps N]

Each run is one emulated SLURM job step of 4 processes (2 nodes x 2, --shard 2, gloo on
CPU, one thread each) on the same model; the three variants run interleaved, N times:

  handwritten  benchmarks/handwritten_fsdp2.py (init_process_group, init_device_mesh,
               fully_shard, AdamW, the same loop and loss all-reduce; no hpc-hsdp)
  hpc-hsdp     hpc-hsdp run --shard 2 --device cpu (layout, verified groups, layout.json,
               metrics.jsonl, a final checkpoint)
  comm-stats   the same with --comm-stats

start-up: Unix time at the end of step 1 on rank 0 minus the time just before the first
process was started (so it includes the first step). step: the median step time of
steps 3..N on rank 0. Ratios are medians over the runs (targets: start-up <= 1.05,
step <= 1.02; comm-stats overhead shown against hpc-hsdp).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, hpc_hsdp_command, job_step  # noqa: E402

TASKS = (2, 2)
SHARD = 2
MODEL = {"layers": 4, "width": 128, "heads": 4, "seq-len": 64, "batch-size": 8, "vocab-size": 512}
TARGET_STARTUP, TARGET_STEP = 1.05, 1.02


def model_args() -> list[str]:
    return [arg for k, v in MODEL.items() for arg in (f"--{k}", str(v))]


def run_once(variant: str, steps: int, work: Path) -> tuple[float, float]:
    out = work / variant
    if variant == "handwritten":
        times = out / "times.jsonl"
        argv = [
            sys.executable,
            str(ROOT / "benchmarks" / "handwritten_fsdp2.py"),
            "--shard",
            str(SHARD),
            "--steps",
            str(steps),
            "--out",
            str(times),
            *model_args(),
        ]
        out.mkdir(parents=True, exist_ok=True)
        started = job_step(argv, tasks_per_node=TASKS, log_dir=out / "logs", torch_env=True)
    else:
        times = out / "metrics.jsonl"
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
            *model_args(),
            "--reshard-after-forward",
            "always",  # as the hand-written script
            *(["--comm-stats"] if variant == "comm-stats" else []),
        ]
        started = job_step(argv, tasks_per_node=TASKS, log_dir=work / f"{variant}-logs")
    records = [json.loads(line) for line in times.read_text().splitlines()]
    startup = records[0]["wall_time"] - started
    step = statistics.median(r["step_time_s"] for r in records[2:])
    return startup, step


def measure(runs: int, steps: int) -> dict[str, dict[str, list[float]]]:
    variants = ("handwritten", "hpc-hsdp", "comm-stats")
    results = {v: {"startup": [], "step": []} for v in variants}
    import compileall

    compileall.compile_dir(str(ROOT / "hpc_hsdp"), quiet=1)
    for i in range(runs):
        order = variants if i % 2 == 0 else tuple(reversed(variants))
        for variant in order:
            with tempfile.TemporaryDirectory(prefix="hpc-hsdp-bench-") as tmp:
                startup, step = run_once(variant, steps, Path(tmp))
            results[variant]["startup"].append(startup)
            results[variant]["step"].append(step)
    return results


def report(results, runs: int) -> dict:
    med = {v: {k: statistics.median(x) for k, x in r.items()} for v, r in results.items()}
    base = med["handwritten"]
    print(
        f"{'variant':<12} {'start-up s':>11} {'ratio':>6} {'step ms':>9} {'ratio':>6}   "
        f"(4 procs, 2 x 2, shard {SHARD}; medians of {runs} interleaved runs)"
    )
    for v, m in med.items():
        print(
            f"{v:<12} {m['startup']:>11.2f} {m['startup'] / base['startup']:>6.3f} {m['step'] * 1000:>9.1f} "
            f"{m['step'] / base['step']:>6.3f}"
        )
    ratios = {
        "startup": med["hpc-hsdp"]["startup"] / base["startup"],
        "step": med["hpc-hsdp"]["step"] / base["step"],
        "comm_stats_step_overhead": med["comm-stats"]["step"] / med["hpc-hsdp"]["step"],
    }
    print(
        f"start-up hpc-hsdp / handwritten = {ratios['startup']:.3f} (target <= {TARGET_STARTUP}); "
        f"step = {ratios['step']:.3f} (target <= {TARGET_STEP}); "
        f"--comm-stats step / plain = {ratios['comm_stats_step_overhead']:.3f}"
    )
    return ratios


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    report(measure(args.runs, args.steps), args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
