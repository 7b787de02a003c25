"""A Llama-style model of about 1B parameters from a config, bf16, on one GPU: tokens/s,
MFU and peak memory under `hpc-hsdp run --model hf:DIR` (mesh (1, 1), shard 1) against the
same model unwrapped (plain transformers model, fp32 weights, torch.autocast bf16, the
same AdamW), side by side in the same run.

    python benchmarks/gpu_llama_1b.py                 # needs CUDA; about 2 minutes on an H100/H200
    python benchmarks/gpu_llama_1b.py --tiny          # CPU smoke test of the same code path

Each variant runs in its own process (fresh CUDA memory statistics). The ``hpc-hsdp run``
variant is the real CLI on a one-task SLURM-like environment: the meta build, the
model's own initialisation unit by unit, FSDP2 with bf16 parameters and fp32 gradient
reduction, the loop's metrics (its ``tokens_per_s``; the median of the timed steps).
MFU = tokens/s x (6 N + 12 L d T) / peak bf16 FLOP/s, N the parameters without the input
embedding, L layers, d width, T sequence length; the peak is 989 TFLOP/s for H100/H200
(dense bf16) unless ``--peak-tflops`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _launch import free_port  # benchmarks/ is on sys.path: these run as scripts

LLAMA_1B = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}
TINY = dict(
    LLAMA_1B,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def flops_per_token(config: dict, seq_len: int) -> float:
    from hpc_hsdp.models.hf_shapes import shapes_from_config

    shapes = shapes_from_config(config)
    embedding = config["vocab_size"] * config["hidden_size"]
    n = shapes.params - embedding
    return 6 * n + 12 * config["num_hidden_layers"] * config["hidden_size"] * seq_len


def _task_env() -> dict:
    from hpc_hsdp.plan.slurm_env import task_environments

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(
        task_environments(tasks_per_node=[1], node_names=[socket.gethostname().split(".")[0]], job_id="bench")[0]
    )
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "HF_HUB_OFFLINE": "1"})
    return env


def run_hpc_hsdp(model_dir: Path, run_dir: Path, args) -> dict:
    """The real `hpc-hsdp run` on one task; tokens/s and peak memory from its metrics.jsonl."""
    cmd = [
        sys.executable,
        "-m",
        "hpc_hsdp",
        "run",
        "--shard",
        "1",
        "--run-dir",
        str(run_dir),
        "--device",
        args.device,
        "--model",
        f"hf:{model_dir}",
        "--precision",
        args.precision,
        "--steps",
        str(args.warmup + args.steps),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--vocab-size",
        str(args.vocab_size),
        "--lr",
        "1e-4",
        "--checkpoint-every",
        "0",
        "--timeout",
        "600",
    ]
    started = time.time()
    done = subprocess.run(cmd, env=_task_env(), capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise SystemExit(f"hpc-hsdp run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    timed = records[args.warmup :]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "peak_bytes": max(r["peak_mem_bytes"] for r in timed),
        "peak_kind": timed[-1]["peak_mem_kind"],
        "last_loss": records[-1]["loss"],
        "first_step_after_s": records[0]["wall_time"] - started,
        "wall_s": time.time() - started,
    }


def unwrapped_worker(args) -> dict:
    """The same model, no FSDP: fp32 weights on the device, autocast bf16, the loop's AdamW groups."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(args.device)
    values = dict(json.loads(Path(args.model_dir, "config.json").read_text()))
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    started = time.time()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.0}], lr=1e-4
    )
    generator = torch.Generator().manual_seed(1)
    rates, loss = [], None
    bf16 = args.precision == "bf16"
    for step in range(args.warmup + args.steps):
        tokens = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss)  # one host sync per step, as the loop has
        rates.append(args.batch_size * args.seq_len / (time.perf_counter() - t0))
        if step == 0:
            first_wall = time.time()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {
        "tokens_per_s": statistics.median(rates[args.warmup :]),
        "peak_bytes": peak,
        "peak_kind": "cuda_max_allocated" if peak else "n/a (cpu)",
        "last_loss": value,
        "first_step_wall": first_wall,
        "wall_s": time.time() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: checks the code path")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--unwrapped-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    config = TINY if args.tiny else LLAMA_1B
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.seq_len = args.seq_len or (32 if args.tiny else 2048)
    args.batch_size = args.batch_size or (2 if args.tiny else 4)
    args.steps = args.steps or (3 if args.tiny else 15)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 5)
    args.vocab_size = args.vocab_size or config["vocab_size"]
    if args.unwrapped_worker:
        print(json.dumps(unwrapped_worker(args)))
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_llama_1b: CUDA is not available here; run it on a GPU node, or pass --tiny for the CPU smoke test",
            file=sys.stderr,
        )
        return 0
    gpu_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    peak_tflops = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in gpu_name), None)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config, indent=1))
        hsdp = run_hpc_hsdp(model_dir, Path(tmp) / "run", args)
        worker = [
            sys.executable,
            __file__,
            "--unwrapped-worker",
            "--model-dir",
            str(model_dir),
            "--device",
            args.device,
            "--precision",
            args.precision,
            "--seq-len",
            str(args.seq_len),
            "--batch-size",
            str(args.batch_size),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--vocab-size",
            str(args.vocab_size),
        ]
        if args.tiny:
            worker.append("--tiny")
        launched = time.time()
        done = subprocess.run(worker, capture_output=True, text=True, timeout=args.timeout, env=_task_env())
        if done.returncode != 0:
            raise SystemExit(f"unwrapped worker failed:\n{done.stderr[-3000:]}")
        plain = json.loads(done.stdout.strip().splitlines()[-1])
        plain["first_step_after_s"] = plain.pop("first_step_wall") - launched  # from the process's start, as for run
    from hpc_hsdp.models.hf_shapes import shapes_from_config

    params = shapes_from_config(config).params
    per_token = flops_per_token(config, args.seq_len)
    print(
        f"{gpu_name}  {params / 1e9:.3f}B parameters (Llama-style, from a config)  {args.precision}  "
        f"batch {args.batch_size} x {args.seq_len} tokens  median of {args.steps} steps after {args.warmup}"
    )
    print(f"{'variant':<28}{'tokens/s':>12}{'MFU':>8}{'peak GiB':>10}{'step 1 at s':>12}{'last loss':>11}")
    results = {
        "gpu": gpu_name,
        "params": params,
        "flops_per_token": per_token,
        "peak_tflops": peak_tflops,
        "config": config,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
    }
    for name, r in (("hpc-hsdp run, mesh (1,1)", hsdp), ("unwrapped (autocast)", plain)):
        mfu = r["tokens_per_s"] * per_token / (peak_tflops * 1e12) if peak_tflops else None
        r["mfu"] = mfu
        print(
            f"{name:<28}{r['tokens_per_s']:>12,.0f}{(f'{mfu:.1%}' if mfu is not None else 'n/a'):>8}"
            f"{r['peak_bytes'] / 2**30:>10.2f}{r['first_step_after_s']:>12.1f}{r['last_loss']:>11.4f}"
        )
    print(f"hpc-hsdp run / unwrapped tokens/s: {hsdp['tokens_per_s'] / plain['tokens_per_s']:.3f}")
    results.update(hpc_hsdp=hsdp, unwrapped=plain)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
