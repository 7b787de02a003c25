"""Issue 24 on one GPU: eager, ``--compile`` and ``--compile --precision fp8`` under
``hpc-hsdp run`` for the 169M built-in model and the 1.1B Llama-style model, against the same
models unwrapped (eager and per-block compiled) and, at 1.1B, the hand-written FSDP2 +
per-block compile script (``handwritten_fsdp2_compile.py``): tokens/s, MFU, peak memory,
compile time and the loss at the end of the run; a JSON file and a markdown table.

    python benchmarks/gpu_compile_fp8.py --out gpu-out/compile_fp8     # needs CUDA (an H100/H200)
    python benchmarks/gpu_compile_fp8.py --tiny --only eager,compile   # the code path on CPU
    python benchmarks/gpu_compile_fp8.py --dry-run                     # the variants and their commands

Each variant is its own process (fresh CUDA memory statistics, a fresh compile cache in its
own run directory). ``hpc-hsdp run`` variants are the real CLI on a one-task SLURM-like
environment (mesh (1, 1)); their tokens/s is the median of the loop's ``tokens_per_s`` over the
timed steps, their compile time the first step's ``compile_s`` (metrics.jsonl). The 1.1B
``--compile`` runs, bf16 and fp8, train ``--curve-steps`` steps on the same synthetic data so
that their losses at the end (the mean of the last 10 steps) compare. MFU = tokens/s x
(6 N + 12 L d T) / peak bf16 FLOP/s (989 TFLOP/s for H100/H200 unless ``--peak-tflops``;
the fp8 rows use the same bf16 peak, as torchtitan reports them). On a GPU of compute
capability < 8.9 (or the CPU) the fp8 rows say ``refused``: hpc-hsdp refuses them in one
line. Budget: about 7 minutes on an H200 with the defaults (not measured yet: no GPU was
lent to the session that wrote it).
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
from gpu_llama_1b import LLAMA_1B, PEAK_TFLOPS
from gpu_llama_1b import TINY as TINY_LLAMA

HERE = Path(__file__).resolve().parent
BUILTIN_169M = dict(layers=8, width=1024, heads=16, seq_len=1024, batch_size=8, vocab_size=32768)
BUILTIN_TINY = dict(layers=2, width=64, heads=4, seq_len=32, batch_size=2, vocab_size=256)
KINDS = ("eager", "compile", "fp8", "unwrapped", "unwrapped-compile", "handwritten-compile")


def builtin_flops_per_token(sizes: dict) -> float:
    w, layers, t = sizes["width"], sizes["layers"], sizes["seq_len"]
    n = layers * 12 * w * w + w * sizes["vocab_size"]  # blocks and head; the embeddings do no matmul
    return 6 * n + 12 * layers * w * t


def llama_flops_per_token(config: dict, seq_len: int) -> float:
    from gpu_llama_1b import flops_per_token

    return flops_per_token(config, seq_len)


def task_env(extra: dict | None = None) -> dict:
    from hpc_hsdp.plan.slurm_env import task_environments

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(
        task_environments(tasks_per_node=[1], node_names=[socket.gethostname().split(".")[0]], job_id="bench")[0]
    )
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "HF_HUB_OFFLINE": "1"})
    env.update(extra or {})
    return env


def variants(args, model_dir: Path) -> list[dict]:
    """Every row of the table: its model, kind and command."""
    rows = []
    for model in ("169m", "1.1b"):
        builtin = model == "169m"
        sizes = BUILTIN_TINY if args.tiny and builtin else BUILTIN_169M
        seq = sizes["seq_len"] if builtin else args.llama_seq_len
        batch = sizes["batch_size"] if builtin else args.llama_batch_size
        for kind in KINDS:
            if kind == "handwritten-compile" and builtin:
                continue
            curve = not builtin and kind in ("compile", "fp8")
            steps = args.curve_steps if curve else args.steps
            row = {"model": model, "kind": kind, "seq_len": seq, "batch_size": batch, "steps": steps}
            if kind in ("eager", "compile", "fp8"):
                shape = (
                    ["--layers", sizes["layers"], "--width", sizes["width"], "--heads", sizes["heads"]]
                    if builtin
                    else ["--model", f"hf:{model_dir}"]
                )
                vocab = sizes["vocab_size"] if builtin else (TINY_LLAMA if args.tiny else LLAMA_1B)["vocab_size"]
                cmd = [sys.executable, "-m", "hpc_hsdp", "run", "--shard", "1", "--device", args.device]
                cmd += [*map(str, shape), "--seq-len", str(seq), "--batch-size", str(batch)]
                cmd += ["--vocab-size", str(vocab), "--steps", str(args.warmup + steps), "--lr", "3e-4"]
                cmd += ["--warmup-steps", "20", "--lr-schedule", "cosine", "--clip-grad", "1.0"]
                cmd += ["--precision", "fp8" if kind == "fp8" else "bf16", "--timeout", "600"]
                cmd += ["--compile"] if kind in ("compile", "fp8") else []
                row["cmd"] = cmd
            elif kind.startswith("unwrapped"):
                cmd = [sys.executable, __file__, "--unwrapped-worker", "--model", model, "--device", args.device]
                cmd += ["--seq-len", str(seq), "--batch-size", str(batch), "--steps", str(steps)]
                cmd += ["--warmup", str(args.warmup), "--model-dir", str(model_dir)]
                cmd += ["--compile"] if kind == "unwrapped-compile" else []
                cmd += ["--tiny"] if args.tiny else []
                row["cmd"] = cmd
            else:
                cmd = [sys.executable, str(HERE / "handwritten_fsdp2_compile.py"), "--device", args.device]
                cmd += ["--seq-len", str(seq), "--batch-size", str(batch), "--steps", str(steps)]
                cmd += ["--warmup", str(args.warmup)]
                cmd += ["--tiny"] if args.tiny else ["--config", str(model_dir / "config.json")]
                row["cmd"] = cmd
            if not args.only or kind in args.only:
                rows.append(row)
    return rows


def run_variant(row: dict, run_dir: Path, timeout: int) -> dict:
    cmd = list(row["cmd"])
    if "hpc_hsdp" in cmd:
        cmd[cmd.index("run") + 1 : cmd.index("run") + 1] = ["--run-dir", str(run_dir)]
    started = time.time()
    done = subprocess.run(cmd, env=task_env(), capture_output=True, text=True, timeout=timeout)
    wall = time.time() - started
    if done.returncode == 2 and row["kind"] == "fp8":
        line = next((x for x in done.stderr.splitlines() if "error" in x), done.stderr.strip()[-200:])
        return {"refused": line, "wall_s": wall}
    if done.returncode != 0:
        return {"failed": f"exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}", "wall_s": wall}
    if "hpc_hsdp" not in cmd:
        result = json.loads(done.stdout.strip().splitlines()[-1])
        return dict(result, wall_s=wall)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    warmup = len(records) - row["steps"]
    timed = [r for r in records[max(warmup, 1) :] if "compile_s" not in r] or records[-1:]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "compile_s": sum(r.get("compile_s", 0.0) for r in records),
        "peak_bytes": max(r["peak_mem_bytes"] for r in timed),
        "loss_end": statistics.fmean(r["loss"] for r in records[-10:]),
        "wall_s": wall,
    }


def unwrapped_worker(args) -> dict:
    """The model without FSDP on the device: fp32 weights, autocast bf16, AdamW (foreach);
    ``--compile``: each block compiled, as hpc-hsdp's --compile does."""
    import torch
    import torch.nn.functional as F

    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.model == "169m":
        from hpc_hsdp.models.builtin import ModelConfig, Transformer

        sizes = BUILTIN_TINY if args.tiny else BUILTIN_169M
        cfg = ModelConfig(**{k: sizes[k] for k in ("layers", "width", "heads", "seq_len", "vocab_size")})
        with torch.device(device):
            model = Transformer(cfg)
        blocks, vocab = model.blocks, sizes["vocab_size"]

        def forward(tokens):
            return model(tokens)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        values = dict(json.loads(Path(args.model_dir, "config.json").read_text()))
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        blocks, vocab = model.model.layers, config.vocab_size

        def forward(tokens):
            return model(input_ids=tokens, use_cache=False).logits

    if args.compile:
        for block in blocks:
            block.forward = torch.compile(block.forward)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=device.type == "cuda")
    generator = torch.Generator().manual_seed(1)
    times, loss = [], None
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=generator).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(loss)  # one host sync per step, as the loop has
        times.append(time.perf_counter() - t0)
    timed = times[args.warmup :]
    return {
        "tokens_per_s": args.batch_size * args.seq_len / statistics.median(timed),
        "step_time_s": statistics.median(timed),
        "compile_s": max(0.0, times[0] - statistics.median(timed)) if args.compile else 0.0,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
        "loss_end": value,
    }


def table(rows: list[dict], peak_tflops: float | None) -> str:
    lines = [
        "| model | variant | tokens/s | MFU | peak GiB | compile s | x unwrapped eager | loss end |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = {r["model"]: r["result"].get("tokens_per_s") for r in rows if r["kind"] == "unwrapped"}
    for r in rows:
        res = r["result"]
        if "tokens_per_s" not in res:
            lines.append(f"| {r['model']} | {r['kind']} | {res.get('refused') or res.get('failed', '')[:80]} |||||")
            continue
        mfu = res["tokens_per_s"] * r["flops_per_token"] / (peak_tflops * 1e12) if peak_tflops else None
        res["mfu"] = mfu
        ratio = res["tokens_per_s"] / base[r["model"]] if base.get(r["model"]) else None
        lines.append(
            f"| {r['model']} | {r['kind']} | {res['tokens_per_s']:,.0f} | {f'{mfu:.1%}' if mfu else 'n/a'} | "
            f"{res['peak_bytes'] / 2**30:.2f} | {res.get('compile_s', 0.0):.1f} | "
            f"{f'{ratio:.3f}' if ratio else 'n/a'} | {res.get('loss_end', float('nan')):.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU: checks the code path")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed steps of the throughput rows")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--curve-steps", type=int, default=None, help="steps of the 1.1B compile rows (bf16, fp8)")
    parser.add_argument("--llama-seq-len", type=int, default=None)
    parser.add_argument("--llama-batch-size", type=int, default=None)
    parser.add_argument("--only", default="", help=f"comma-separated kinds of {', '.join(KINDS)}")
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per variant")
    parser.add_argument("--budget-s", type=float, default=450, help="start no variant after this many seconds")
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    parser.add_argument("--dry-run", action="store_true", help="print the variants' commands, run nothing")
    parser.add_argument("--unwrapped-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="169m", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.steps = args.steps or (2 if args.tiny else 15)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.curve_steps = args.curve_steps or (3 if args.tiny else 200)
    args.llama_seq_len = args.llama_seq_len or (32 if args.tiny else 2048)
    args.llama_batch_size = args.llama_batch_size or (2 if args.tiny else 4)
    args.only = [k for k in args.only.split(",") if k]
    unknown = sorted(set(args.only) - set(KINDS))
    if unknown:
        parser.error(f"--only {','.join(unknown)}: choose from {', '.join(KINDS)}")
    if args.unwrapped_worker:
        print(json.dumps(unwrapped_worker(args)))
        return 0
    llama = TINY_LLAMA if args.tiny else LLAMA_1B
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(llama, indent=1))
        rows = variants(args, model_dir)
        if args.dry_run:
            for row in rows:
                print(f"{row['model']:<5} {row['kind']:<20} {' '.join(row['cmd'])}")
            return 0
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            print("gpu_compile_fp8: CUDA is not available; --tiny runs the code path on the CPU", file=sys.stderr)
            return 0
        gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
        peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
        began = time.time()
        for index, row in enumerate(rows):
            if time.time() - began > args.budget_s:
                row["flops_per_token"], row["result"] = None, {"failed": f"skipped: past --budget-s {args.budget_s}"}
                continue
            sizes = BUILTIN_TINY if args.tiny else BUILTIN_169M
            row["flops_per_token"] = (
                builtin_flops_per_token(sizes)
                if row["model"] == "169m"
                else llama_flops_per_token(llama, row["seq_len"])
            )
            row["result"] = run_variant(row, Path(tmp) / f"run-{index}", args.timeout)
            print(
                f"[{time.time() - began:6.0f} s] {row['model']} {row['kind']}: {json.dumps(row['result'])}", flush=True
            )
    markdown = table(rows, peak)
    print(markdown)
    summary = {
        "gpu": gpu,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "peak_tflops": peak,
        "wall_s": time.time() - began,
        "rows": [{k: v for k, v in r.items() if k != "cmd"} for r in rows],
    }
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(summary, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(markdown + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
