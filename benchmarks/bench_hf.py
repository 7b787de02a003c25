"""A transformers model under `hpc-hsdp run --model hf:DIR --data DATA` against a hand-written
FSDP2 HSDP script (benchmarks/handwritten_hf_fsdp2.py) with the same model, data, options and
fused AdamW kernel (the loop's on CPU).

    python benchmarks/bench_hf.py [--runs N] [--steps N]

Each run is one emulated SLURM job step of 4 processes (2 nodes x 2, --shard 2, gloo on CPU,
one thread each); variants interleaved, N times. A Llama-style model (4 layers, width 1024,
vocab 4096: 50M parameters, 200 MB in fp32), on standard-library source prepared by
`hpc-hsdp prepare-data`.

  from a config:  start-up (end of step 1 on rank 0 minus the time before the first process
                  started) and step time (median of steps 3..N on rank 0). Targets:
                  start-up <= 1.05, step <= 1.02 of the hand-written script. Also the CPU
                  seconds per step (all threads), which other load on the machine moves less.
  pretrained:     the same model saved with save_pretrained: hpc-hsdp reads each rank's
                  rows of model.safetensors; the hand-written script loads the whole model
                  on every rank with from_pretrained, then shards it. Time to the end of
                  step 1, and rank 0's peak resident memory (ru_maxrss) at step 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, hpc_hsdp_command, job_step  # noqa: E402

TASKS, SHARD = (2, 2), 2
CONFIG = {
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
SEQ, BATCH = 64, 2
TARGET_STARTUP, TARGET_STEP = 1.05, 1.02
FILES = (
    "argparse.py",
    "ast.py",
    "dataclasses.py",
    "functools.py",
    "inspect.py",
    "pathlib.py",
    "typing.py",
    "collections/__init__.py",
    "enum.py",
    "subprocess.py",
    "tarfile.py",
    "zipfile/__init__.py",
)


def prepare(work: Path) -> tuple[Path, Path, Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = work / "data"
    files = [str(stdlib / f) for f in FILES if (stdlib / f).is_file()]
    subprocess.run(
        [
            *hpc_hsdp_command(),
            "prepare-data",
            *files,
            "-o",
            str(data),
            "--train-tokenizer",
            str(CONFIG["vocab_size"]),
            "--workers",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    manifest = json.loads((data / "dataset.json").read_text())
    model = work / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(dict(CONFIG, vocab_size=manifest["vocab_size"])))
    pretrained = work / "pretrained"
    code = (
        "import os, sys, torch; os.environ['HF_HUB_OFFLINE']='1'\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "torch.manual_seed(0); AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))"
        ".save_pretrained(sys.argv[2])"
    )
    subprocess.run([sys.executable, "-c", code, str(model), str(pretrained)], check=True, capture_output=True)
    return data, model, pretrained


def run_once(variant: str, model: Path, data: Path, steps: int, work: Path, env: dict | None = None) -> dict:
    out = work / f"{variant}-{len(list(work.iterdir()))}"
    pretrained = variant.endswith("pretrained")
    if variant.startswith("handwritten"):
        times = out / "times.jsonl"
        out.mkdir(parents=True)
        argv = [
            sys.executable,
            str(ROOT / "benchmarks" / "handwritten_hf_fsdp2.py"),
            "--model",
            str(model),
            "--tokens",
            str(data / "train" / "00000.bin"),
            "--shard",
            str(SHARD),
            "--steps",
            str(steps),
            "--seq-len",
            str(SEQ),
            "--batch-size",
            str(BATCH),
            "--out",
            str(times),
            "--fused-adamw",
            *(["--pretrained"] if pretrained else []),
        ]
        started = job_step(argv, tasks_per_node=TASKS, log_dir=out / "logs", torch_env=True, extra_env=env)
        records = [json.loads(line) for line in times.read_text().splitlines()]
        peak = records[0]["peak_rss_bytes"]
    else:
        argv = [
            *hpc_hsdp_command(),
            "run",
            "--shard",
            str(SHARD),
            "--device",
            "cpu",
            "--run-dir",
            str(out),
            "--model",
            f"hf:{model}",
            "--data",
            str(data),
            "--steps",
            str(steps),
            "--seq-len",
            str(SEQ),
            "--batch-size",
            str(BATCH),
            "--lr",
            "3e-3",
            "--precision",
            "fp32",
            "--reshard-after-forward",
            "always",
        ]  # the hand-written script reshards too
        started = job_step(argv, tasks_per_node=TASKS, log_dir=out / "logs", extra_env=env)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        peak = records[0]["peak_mem_bytes"]
    return {
        "startup": records[0]["wall_time"] - started,
        "step": statistics.median(r["step_time_s"] for r in records[2:]),
        "cpu": statistics.median(r["cpu_time_s"] for r in records[2:]),
        "peak_rss": peak,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable for every variant's processes, e.g. GLIBC_TUNABLES=glibc.malloc.hugetlb=1 "
        "(what the rendered script exports for --device cpu)",
    )
    args = parser.parse_args(argv)
    env = dict(item.split("=", 1) for item in args.env)
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, model, pretrained = prepare(work)
        runs = work / "runs"
        runs.mkdir()
        variants = (
            ("handwritten", model),
            ("hpc-hsdp", model),
            ("handwritten-pretrained", pretrained),
            ("hpc-hsdp-pretrained", pretrained),
        )
        for i in range(args.runs):
            for variant, path in variants if i % 2 == 0 else variants[::-1]:
                results.setdefault(variant, []).append(run_once(variant, path, data, args.steps, runs, env))
    med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in results.items()}
    startup = med["hpc-hsdp"]["startup"] / med["handwritten"]["startup"]
    step = med["hpc-hsdp"]["step"] / med["handwritten"]["step"]
    print(
        f"{CONFIG['num_hidden_layers']}-layer Llama-style model, 2 nodes x 2 tasks, shard {SHARD}, {args.runs} runs, "
        f"{args.steps} steps, medians" + (f"; every variant with {' '.join(args.env)}" if args.env else "")
    )
    print(f"{'variant':<24}{'start-up s':>11}{'step ms':>9}{'CPU ms':>8}{'rank-0 peak RSS MiB':>21}")
    for variant, m in med.items():
        print(
            f"{variant:<24}{m['startup']:>11.2f}{m['step'] * 1000:>9.1f}{m['cpu'] * 1000:>8.1f}"
            f"{m['peak_rss'] / 2**20:>21.0f}"
        )
    print(
        f"from a config: start-up {startup:.3f} (target <= {TARGET_STARTUP}), step {step:.3f} (target <= {TARGET_STEP}), "
        f"CPU per step {med['hpc-hsdp']['cpu'] / med['handwritten']['cpu']:.3f}"
    )
    hp, hw = med["hpc-hsdp-pretrained"], med["handwritten-pretrained"]
    print(
        f"pretrained: time to step 1 {hp['startup'] / hw['startup']:.3f}, rank-0 peak RSS "
        f"{hp['peak_rss'] / 2**20:.0f} vs {hw['peak_rss'] / 2**20:.0f} MiB ({hp['peak_rss'] / hw['peak_rss']:.3f})"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"medians": med, "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
