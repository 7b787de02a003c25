"""Checkpoints uploaded to object storage (--checkpoint-store) against local checkpoints alone.

    python benchmarks/bench_checkpoint_store.py [--runs N] [--bwlimit 20M] [--steps 90] [--every 30]

One emulated job step (1 node x 2 tasks, --shard 2, gloo on CPU) of `hpc-hsdp run` with the
built-in model (width 256, 4 layers, vocabulary 8192: about 88 MB per checkpoint, AdamW, fp32)
and a periodic checkpoint every --every steps, run alternately without and with
--checkpoint-store against rclone's S3 server (`rclone serve s3 --bwlimit`, disk-backed, on
loopback), measured in the same run:

  step time        median step_time_s of metrics.jsonl (steps after the first 5), store / local
                   (goal <= 1.05)
  save -> commit   for each periodic save: from the end of its step (its record's wall_time,
                   when the save starts) to COMPLETE in the store (the object's file on the
                   server's disk), against (the local save: the same step to COMPLETE in the
                   run directory) + the checkpoint's bytes / --bwlimit (goal <= 1.2)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _launch import hpc_hsdp_command, job_step  # noqa: E402
from s3_helpers import S3Server  # noqa: E402

TASKS = (2,)
MODEL = ["--width", "256", "--layers", "4", "--heads", "8", "--vocab-size", "8192", "--seq-len", "32"]


def rate_of(text: str) -> float:
    """rclone's --bwlimit (``20M``: 20 MiB/s) in bytes per second."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return float(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else float(text) * 1024


def one_run(work: Path, *, store: S3Server | None, url: str | None, args) -> dict:
    run = work / "run"
    argv = [*hpc_hsdp_command(), "run", "--shard", "2", "--device", "cpu", "--run-dir", str(run), *MODEL]
    argv += ["--batch-size", "2", "--steps", str(args.steps), "--checkpoint-every", str(args.every)]
    argv += ["--keep-checkpoints", str(args.steps), "--tracker", "none"]
    if url is not None:
        argv += ["--checkpoint-store", url]
    env = {"HPC_HSDP_FAULT_STEP_DELAY_S": str(args.delay), **(store.env if store else {})}
    job_step(argv, tasks_per_node=TASKS, log_dir=work / "logs", extra_env=env, timeout_s=900)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = {r["step"]: r for r in records}
    out = {"step_s": statistics.median(r["step_time_s"] for r in records if r["step"] > 5), "saves": []}
    for step in range(args.every, args.steps, args.every):
        name = f"step-{step:06d}"
        local = run / "checkpoints" / name
        begun = steps[step]["wall_time"]
        save = {"step": step, "local_s": (local / "COMPLETE").stat().st_mtime - begun}
        save["bytes"] = json.loads((local / "manifest.json").read_text())["total_bytes"]
        if store is not None:
            committed = store.root / url.removeprefix("s3://") / name / "COMPLETE"
            save["commit_s"] = committed.stat().st_mtime - begun
        out["saves"].append(save)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--bwlimit", default="20M", help="rclone's --bwlimit of the store (20M: 20 MiB/s)")
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--every", type=int, default=30)
    parser.add_argument("--delay", type=float, default=0.1, help="seconds each step sleeps besides its work")
    args = parser.parse_args()
    rate = rate_of(args.bwlimit)
    with tempfile.TemporaryDirectory(prefix="bench-store-", dir=os.environ.get("BENCH_DIR")) as tmp:
        server = S3Server(Path(tmp) / "s3-root", bwlimit=args.bwlimit).start()
        server.bucket("bench")
        try:
            local_steps, store_steps, ratios = [], [], []
            for rep in range(args.runs):  # alternately, so that the machine's load falls on both alike
                local = one_run(Path(tmp) / f"local-{rep}", store=None, url=None, args=args)
                stored = one_run(Path(tmp) / f"store-{rep}", store=server, url=f"s3://bench/run-{rep}", args=args)
                local_steps.append(local["step_s"])
                store_steps.append(stored["step_s"])
                for save in stored["saves"]:
                    expected = save["local_s"] + save["bytes"] / rate
                    ratios.append(save["commit_s"] / expected)
                    print(
                        f"run {rep} step {save['step']}: {save['bytes'] / 1e6:.1f} MB, local save {save['local_s']:.2f} s, "
                        f"commit in the store after {save['commit_s']:.2f} s; local + bytes/bandwidth "
                        f"{expected:.2f} s -> {save['commit_s'] / expected:.2f}x"
                    )
        finally:
            server.stop()
    step_ratio = statistics.median(store_steps) / statistics.median(local_steps)
    print(
        f"median step: local checkpoints {statistics.median(local_steps) * 1e3:.1f} ms, with --checkpoint-store "
        f"{statistics.median(store_steps) * 1e3:.1f} ms -> {step_ratio:.3f}x (goal <= 1.05)"
    )
    print(
        f"save -> commit against local save + bytes / {args.bwlimit}iB/s: median {statistics.median(ratios):.2f}x, "
        f"worst {max(ratios):.2f}x (goal <= 1.2)"
    )


if __name__ == "__main__":
    main()
