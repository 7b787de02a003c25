"""One node's GPUs, the built-in model under `hpc-hsdp run` at tp 1, 2, 4 and 8 (shard = GPUs / tp):
tokens per second per GPU, peak memory, the TP group's bytes per step, each against tp 1.

    python benchmarks/gpu_tp_step.py [--width 2048 --layers 8 --heads 16 --seq-len 2048]
    python benchmarks/gpu_tp_step.py --device cpu --gpus 4     # CPU, tiny: checks the code path

A tp that needs more GPUs than the node has is listed as skipped, with how many it needs (one
H200 runs tp 1 only: NCCL refuses two ranks on one GPU). Each variant is an emulated one-node
SLURM job step of `--gpus` tasks (benchmarks/_launch.py); the loop's own `step_time_s` of the
steps after the warm-up is timed; bf16 on CUDA.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpus", type=int, default=None, help="tasks on the node (default: the GPUs CUDA sees)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=8, help="global batch (rows) per step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        args.width, args.layers, args.heads, args.seq_len = min(args.width, 64), min(args.layers, 2), 4, 32
    gpus = args.gpus
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if args.device == "cuda" else 4
    precision = "bf16" if args.device == "cuda" else "fp32"
    rows: list[tuple] = []
    base = None
    for tp in (1, 2, 4, 8):
        if tp > gpus or gpus % tp:
            rows.append((tp, None, f"skipped: needs {tp} GPUs on the node, it has {gpus}"))
            continue
        with tempfile.TemporaryDirectory(prefix="gpu-tp-") as root:
            run_dir = Path(root) / f"tp{tp}"
            argv_ = [
                *hpc_hsdp_command(),
                *("run", "--shard", str(gpus // tp), "--tp", str(tp), "--device", args.device),
                *("--run-dir", str(run_dir), "--comm-stats", "--tracker", "none", "--precision", precision),
                *("--steps", str(args.steps + args.warmup), "--global-batch-size", str(args.rows)),
                *("--width", str(args.width), "--layers", str(args.layers), "--heads", str(args.heads)),
                *("--seq-len", str(args.seq_len), "--vocab-size", "32768", "--straggler-every", "0"),
            ]
            job_step(argv_, tasks_per_node=(gpus,), log_dir=run_dir / "bench-logs", timeout_s=900)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        timed = records[args.warmup :]
        step = statistics.median(r["step_time_s"] for r in timed)
        tokens_per_gpu = args.rows * args.seq_len / step / gpus
        tp_bytes = sum(v["tensor_bytes"] for v in timed[-1]["comm"].get("tp", {}).values() if isinstance(v, dict))
        peak = max(r.get("peak_mem_bytes") or 0 for r in timed)
        base = base or tokens_per_gpu
        rows.append((tp, (step, tokens_per_gpu, tokens_per_gpu / base, peak, tp_bytes), ""))
    print(f"{args.device}, {gpus} ranks on one node, width {args.width}, {args.layers} blocks, seq {args.seq_len}")
    print(f"{'tp':>3}{'step ms':>10}{'tok/s/GPU':>12}{'/ tp 1':>8}{'peak GiB':>10}{'tp MiB/step':>13}")
    for tp, got, why in rows:
        if got is None:
            print(f"{tp:>3}  {why}")
            continue
        step, tokens, ratio, peak, tp_bytes = got
        print(f"{tp:>3}{step * 1000:>10.1f}{tokens:>12.0f}{ratio:>8.3f}{peak / 2**30:>10.2f}{tp_bytes / 2**20:>13.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
