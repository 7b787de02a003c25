"""The training loop with every option on, against a hand-written FSDP2 loop doing the same.

    python benchmarks/bench_loop.py [--runs N] [--steps N] [--data DIR_OR_BIN]

Each run is one emulated SLURM job step of 4 processes (2 nodes x 2, --shard 2, gloo on
CPU, one thread each), bf16 + --grad-accum 2 + --clip-grad 1.0 + cosine with warm-up:

  handwritten  benchmarks/handwritten_fsdp2.py --precision bf16 --grad-accum 2 --clip-grad 1
               --cosine --warmup-steps 2 --fused-adamw (MixedPrecisionPolicy,
               set_requires_all_reduce, clip_grad_norm_, LambdaLR, np.memmap batches read in
               the step, the same fused AdamW kernel as the loop's on CPU; no hpc-hsdp)
  hpc-hsdp     hpc-hsdp run with the same options (prefetching loader, fused metrics
               all-reduce, layout.json, metrics.jsonl, a final checkpoint)

Reported side by side (medians over the interleaved runs, steps 3..N):
  step time hpc-hsdp / handwritten (target <= 1.02), with the range of the per-pair ratios
  (run i of each variant; a wide range means the machine was busy: measure again);
  CPU time per step hpc-hsdp / handwritten (the process's CPU seconds, all threads): what
  each loop costs, much less sensitive to other load on the machine than the wall time;
  data wait: the step's time waiting for the loader / step time (target <= 2 %);
  loader alone: tokens/s one rank's loader reads (no training) / tokens/s a step consumes
  per rank (target >= 100).
Both read the same token file (the train split's first shard for the hand-written one):
``--data``, else the Python standard library's source tokenised first with
``hpc-hsdp prepare-data --train-tokenizer 512``; ``--synthetic``: hpc-hsdp's synthetic
source against torch.randint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, hpc_hsdp_command, job_step  # noqa: E402

TASKS = (2, 2)
SHARD = 2
MODEL = {"layers": 4, "width": 128, "heads": 4, "seq-len": 64, "batch-size": 8}
OPTIONS = {"precision": "bf16", "grad-accum": "2", "clip-grad": "1.0", "warmup-steps": "2"}
TARGET_STEP, TARGET_WAIT, TARGET_LOADER = 1.02, 0.02, 100.0


def first_bin(data: Path) -> Path:
    """The token file the hand-written loop reads: the file itself, or the train split's first shard."""
    if data.suffix == ".bin":
        return data
    manifest = json.loads((data / "dataset.json").read_text())
    return data / manifest["splits"]["train"][0]


def vocab_of(data: Path | None) -> int:
    if data is None:
        return 512
    return json.loads(first_bin(data).with_suffix(".json").read_text())["vocab_size"]


def run_once(variant: str, steps: int, work: Path, data: Path | None) -> list[dict]:
    out = work / variant
    model = [arg for k, v in {**MODEL, "vocab-size": vocab_of(data)}.items() for arg in (f"--{k}", str(v))]
    options = [arg for k, v in OPTIONS.items() for arg in (f"--{k}", v)]
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
            *model,
            *options,
            "--cosine",
            "--fused-adamw",
            *(["--data", str(first_bin(data))] if data else []),
        ]
        out.mkdir(parents=True, exist_ok=True)
        job_step(argv, tasks_per_node=TASKS, log_dir=out / "logs", torch_env=True)
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
            *model,
            *options,
            "--lr-schedule",
            "cosine",
            "--reshard-after-forward",
            "always",  # as the hand-written loop
            *(["--data", str(data)] if data else []),
        ]
        job_step(argv, tasks_per_node=TASKS, log_dir=work / f"{variant}-logs")
    return [json.loads(line) for line in times.read_text().splitlines()]


def loader_tokens_per_s(data: Path | None, steps: int) -> float:
    """One rank's loader alone (rank 0 of 4), no training: tokens per second it delivers."""
    import torch

    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.task.training.loader import BatchLoader
    from hpc_hsdp.task.training.run_data import open_data

    training = TrainingSpec.of(
        seq_len=MODEL["seq-len"],
        batch_size=MODEL["batch-size"],
        grad_accum=2,
        vocab_size=vocab_of(data),
        data=str(data) if data else None,
    )
    spec = open_data(training, world_size=sum(TASKS))
    began = time.perf_counter()
    with BatchLoader(
        spec.train,
        order=spec.order,
        layout=spec.layout,
        rank=0,
        first_step=1,
        last_step=steps,
        device=torch.device("cpu"),
    ) as loader:
        rows = sum(batch.inputs.shape[0] for batch in loader)
    return rows * MODEL["seq-len"] / (time.perf_counter() - began)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--data", type=Path, default=None, help="a prepare-data directory or a .bin token file")
    parser.add_argument("--synthetic", action="store_true", help="no token files: synthetic tokens")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hpc-hsdp-bench-data-") as tmp:
        data = args.data.resolve() if args.data else None if args.synthetic else prepare_stdlib(Path(tmp) / "stdlib")
        return measure(args, data)


def prepare_stdlib(out: Path) -> Path:
    import os
    import subprocess

    files = sorted(str(p) for p in Path(os.__file__).parent.glob("*.py"))
    subprocess.run(
        [
            *hpc_hsdp_command(),
            "prepare-data",
            *files,
            "-o",
            str(out),
            "--train-tokenizer",
            "512",
            "--val-fraction",
            "0.05",
        ],
        check=True,
        capture_output=True,
    )
    return out


def measure(args, data: Path | None) -> int:
    results: dict[str, list[list[dict]]] = {"handwritten": [], "hpc-hsdp": []}
    for i in range(args.runs):
        for variant in ("handwritten", "hpc-hsdp") if i % 2 == 0 else ("hpc-hsdp", "handwritten"):
            with tempfile.TemporaryDirectory(prefix="hpc-hsdp-bench-") as tmp:
                results[variant].append(run_once(variant, args.steps, Path(tmp), data))
    per_run = {v: [statistics.median(r["step_time_s"] for r in run[2:]) for run in runs] for v, runs in results.items()}
    step = {v: statistics.median(times) for v, times in per_run.items()}
    cpu = {
        v: statistics.median(statistics.median(r["cpu_time_s"] for r in run[2:]) for run in runs)
        for v, runs in results.items()
    }
    pairs = [mine / theirs for mine, theirs in zip(per_run["hpc-hsdp"], per_run["handwritten"])]
    wait = statistics.median(r["data_wait_s"] / r["step_time_s"] for run in results["hpc-hsdp"] for r in run[2:])
    rank_tokens_per_step = MODEL["batch-size"] * 2 * MODEL["seq-len"]
    consumed = rank_tokens_per_step / step["hpc-hsdp"]
    loader = statistics.median(loader_tokens_per_s(data, 200) for _ in range(3))
    source = f"data {data}" if data else "synthetic tokens"
    print(
        f"4 procs (2 x 2, shard {SHARD}), bf16 + grad-accum 2 + clip 1.0 + cosine/warm-up, {source}; "
        f"medians of {args.runs} interleaved runs x {args.steps} steps"
    )
    print(f"{'variant':<12} {'step ms':>9} {'ratio':>6} {'CPU ms':>8} {'ratio':>6}")
    for v in results:
        print(
            f"{v:<12} {step[v] * 1000:>9.1f} {step[v] / step['handwritten']:>6.3f} {cpu[v] * 1000:>8.1f} "
            f"{cpu[v] / cpu['handwritten']:>6.3f}"
        )
    ratio = step["hpc-hsdp"] / step["handwritten"]
    print(
        f"step hpc-hsdp / handwritten = {ratio:.3f} (target <= {TARGET_STEP}); pairs {min(pairs):.3f}..{max(pairs):.3f}"
    )
    print(f"CPU per step hpc-hsdp / handwritten = {cpu['hpc-hsdp'] / cpu['handwritten']:.3f}")
    print(f"data wait / step time = {wait:.2%} (target <= {TARGET_WAIT:.0%})")
    print(
        f"loader alone {loader:,.0f} tok/s per rank / a step consumes {consumed:,.0f} tok/s per rank = "
        f"{loader / consumed:,.0f}x (target >= {TARGET_LOADER:.0f}x)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
