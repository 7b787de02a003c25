"""hpc-hsdp against its peers on the same HSDP job: start-up and step time, ratios to the fastest peer.

    python benchmarks/bench_peers.py [--runs N] [--steps N] [--models small,10m,hf] [--variants a,b,...]
                                     [--startup-phases N]

Each run is one emulated SLURM job step of 4 processes (2 nodes x 2, shard 2, gloo on CPU,
one thread each); all variants of a model run interleaved (the order alternates), N times.
Same model, initialisation, synthetic data (random tokens), AdamW (lr 3e-3, no weight
decay), fp32, and per step the global loss and gradient norm read on the host:

  handwritten      benchmarks/handwritten_fsdp2.py (torch only: fully_shard per block + root)
  lightning-fsdp2  Lightning Fabric, ModelParallelStrategy (FSDP2) (benchmarks/peer_lightning.py)
  lightning-fsdp1  Lightning Fabric, FSDPStrategy HYBRID_SHARD, device_mesh=(2, 2)
  hpc-hsdp         hpc-hsdp run --shard 2 (its defaults: --reshard-after-forward auto, which keeps
                   the gathered parameters to backward here, since the model fits many times)
  hpc-hsdp-always  hpc-hsdp run --shard 2 --reshard-after-forward always (resharding after
                   forward, as every peer does)

Models: ``small`` (the built-in architecture: 4 layers, width 128, seq 64, batch 8, vocab 512,
0.9M parameters), ``10m`` (4 layers, width 320, vocab 8192: 10.2M), ``hf`` (a transformers
Llama from a config: 4 layers, width 256, vocab 4096, 5.0M; hpc-hsdp with --model hf:DIR).

start-up: Unix time at the end of step 1 on rank 0 minus the time just before the first
process started. step: median step time of steps 3..N on rank 0. Each variant's figure is
the median over the runs; ratios are to the fastest PEER (handwritten, Lightning) of the
same model. Lightning runs in its own virtual environment, benchmarks/.peers-venv, made on
first use: lightning==2.6.6 with torch pinned to this interpreter's torch (the venv sees this
interpreter's site-packages through a .pth file, so torch is not installed twice).
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
LIGHTNING = "lightning==2.6.6"
PEERS_VENV = ROOT / "benchmarks" / ".peers-venv"
MODELS = {
    "small": {"layers": 4, "width": 128, "heads": 4, "seq-len": 64, "batch-size": 8, "vocab-size": 512},
    "10m": {"layers": 4, "width": 320, "heads": 4, "seq-len": 64, "batch-size": 8, "vocab-size": 8192},
    "hf": {"seq-len": 64, "batch-size": 8, "vocab-size": 4096},
}
HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
PEERS = ("handwritten", "lightning-fsdp2", "lightning-fsdp1")
DEFAULT_VARIANTS = ("handwritten", "hpc-hsdp", "lightning-fsdp2", "lightning-fsdp1")


def peers_python() -> Path:
    """The peers' interpreter; creates the venv on first use (torch pinned, never upgraded)."""
    python = PEERS_VENV / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import lightning"], capture_output=True).returncode == 0:
        return python
    import torch

    print(f"creating {PEERS_VENV} ({LIGHTNING}, torch {torch.__version__} from this interpreter) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(PEERS_VENV)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "_hpc_hsdp_base.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", LIGHTNING, torch_pin], check=True
    )
    return python


def run_once(variant: str, model: str, steps: int, work: Path, hf_dir: Path | None) -> tuple[float, float]:
    out = work / variant
    out.mkdir(parents=True, exist_ok=True)
    shape = MODELS[model]
    args = [arg for k, v in shape.items() for arg in (f"--{k}", str(v))]
    times = out / "times.jsonl"
    if variant == "handwritten":
        argv = [
            sys.executable,
            str(ROOT / "benchmarks" / "handwritten_fsdp2.py"),
            "--shard",
            str(SHARD),
            "--steps",
            str(steps),
            "--out",
            str(times),
            *args,
        ]
        if model == "hf":  # benchmarks/handwritten_hf_fsdp2.py reads its batches from a token file
            argv = [
                sys.executable,
                str(ROOT / "benchmarks" / "handwritten_hf_fsdp2.py"),
                "--model",
                str(hf_dir),
                "--tokens",
                str(hf_dir / "tokens.bin"),
                "--shard",
                str(SHARD),
                "--steps",
                str(steps),
                "--seq-len",
                str(shape["seq-len"]),
                "--batch-size",
                str(shape["batch-size"]),
                "--out",
                str(times),
            ]
        started = job_step(argv, tasks_per_node=TASKS, log_dir=out / "logs", torch_env=True)
    elif variant.startswith("lightning-"):
        argv = [
            str(peers_python()),
            str(ROOT / "benchmarks" / "peer_lightning.py"),
            "--strategy",
            variant.removeprefix("lightning-"),
            "--shard",
            str(SHARD),
            "--steps",
            str(steps),
            "--out",
            str(times),
            *args,
            *(["--hf-config", str(hf_dir)] if model == "hf" else []),
        ]
        started = job_step(
            argv, tasks_per_node=TASKS, log_dir=out / "logs", extra_env={"SLURM_NTASKS_PER_NODE": str(TASKS[0])}
        )
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
            "--lr",
            "3e-3",
            "--weight-decay",
            "0",
            *args,
            *(["--model", f"hf:{hf_dir}"] if model == "hf" else []),
            *(["--reshard-after-forward", "always"] if variant == "hpc-hsdp-always" else []),
        ]
        started = job_step(argv, tasks_per_node=TASKS, log_dir=out / "logs")
    records = [json.loads(line) for line in times.read_text().splitlines()]
    return records[0]["wall_time"] - started, statistics.median(r["step_time_s"] for r in records[2:])


def measure(model: str, variants: list[str], runs: int, steps: int, hf_dir: Path | None) -> dict:
    results = {v: {"startup": [], "step": []} for v in variants}
    for i in range(runs):
        for variant in variants if i % 2 == 0 else list(reversed(variants)):
            with tempfile.TemporaryDirectory(prefix="hpc-hsdp-peers-") as tmp:
                startup, step = run_once(variant, model, steps, Path(tmp), hf_dir)
            results[variant]["startup"].append(startup)
            results[variant]["step"].append(step)
            print(
                f"  [{model} run {i + 1}/{runs}] {variant:<16} start-up {startup:6.2f} s  step {step * 1000:7.1f} ms",
                flush=True,
            )
    return {v: {k: statistics.median(x) for k, x in r.items()} for v, r in results.items()}


def report(model: str, med: dict, runs: int, steps: int) -> None:
    peers = [v for v in med if v in PEERS] or list(med)
    fastest_startup = min(med[v]["startup"] for v in peers)
    fastest_step = min(med[v]["step"] for v in peers)
    print(
        f"\n{model}: 4 procs (2 x 2, shard {SHARD}), fp32, medians of {runs} interleaved runs x {steps} steps; "
        f"ratios to the fastest peer"
    )
    print(f"| {'variant':<16} | {'start-up s':>10} | {'ratio':>6} | {'step ms':>8} | {'ratio':>6} |")
    print(f"|{'-' * 18}|{'-' * 12}:|{'-' * 7}:|{'-' * 9}:|{'-' * 7}:|")
    for v, m in med.items():
        print(
            f"| {v:<16} | {m['startup']:>10.2f} | {m['startup'] / fastest_startup:>6.3f} | "
            f"{m['step'] * 1000:>8.1f} | {m['step'] / fastest_step:>6.3f} |"
        )
    sys.stdout.flush()


def startup_phases(model: str, runs: int) -> dict[str, float]:
    """Medians over ``runs`` of benchmarks/startup_phases.py: seconds from the launch to the end of each phase."""
    import time

    shape = {k.replace("-", "_"): v for k, v in MODELS[model].items()}
    found: dict[str, list[float]] = {}
    for _ in range(runs):
        with tempfile.TemporaryDirectory(prefix="hpc-hsdp-peers-") as tmp:
            argv = [sys.executable, str(ROOT / "benchmarks" / "startup_phases.py"), json.dumps(shape)]
            job_step(argv, tasks_per_node=TASKS, log_dir=Path(tmp), extra_env={"BENCH_LAUNCHED_AT": repr(time.time())})
            line = next(x for x in (Path(tmp) / "task-0.log").read_text().splitlines() if x.startswith("PHASES "))
        for name, at in json.loads(line.removeprefix("PHASES ")).items():
            found.setdefault(name, []).append(at)
    ends = {name: statistics.median(x) for name, x in found.items()}
    print(f"\nhpc-hsdp start-up by phase ({model}, medians of {runs} runs): phase, its own seconds, end since launch")
    before = 0.0
    for name, end in ends.items():
        print(f"  {name:<12} {end - before:6.2f} s   {end:6.2f} s")
        before = end
    return ends


def write_hf_config(work: Path) -> Path:
    hf_dir = work / "hf-llama"
    hf_dir.mkdir(parents=True, exist_ok=True)
    (hf_dir / "config.json").write_text(json.dumps(HF_CONFIG))
    import numpy as np  # random tokens for the hand-written HF script, which reads a uint16 token file

    np.random.default_rng(0).integers(0, HF_CONFIG["vocab_size"], 1 << 18, dtype=np.uint16).tofile(
        hf_dir / "tokens.bin"
    )
    return hf_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--models", default="small,10m,hf", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help="comma-separated: handwritten, hpc-hsdp, hpc-hsdp-always, lightning-fsdp1, lightning-fsdp2",
    )
    parser.add_argument(
        "--startup-phases",
        type=int,
        default=3,
        metavar="N",
        help="then N runs of benchmarks/startup_phases.py on the small model (0: none)",
    )
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if any(v.startswith("lightning-") for v in variants):
        peers_python()
    import compileall

    compileall.compile_dir(str(ROOT / "hpc_hsdp"), quiet=1)
    tables = {}
    with tempfile.TemporaryDirectory(prefix="hpc-hsdp-peers-hf-") as tmp:
        hf_dir = write_hf_config(Path(tmp)) if "hf" in models else None
        for model in models:
            tables[model] = measure(model, variants, args.runs, args.steps, hf_dir)
            report(model, tables[model], args.runs, args.steps)
    print("\n(each ratio: the variant's median / the fastest peer's median of the same model, same run)")
    if args.startup_phases:
        startup_phases("small", args.startup_phases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
