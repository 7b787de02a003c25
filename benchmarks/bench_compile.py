"""``--compile`` on CPU: the steady step against eager, the first compile, and the second
attempt's compile from the run directory's cache.

    python benchmarks/bench_compile.py [--runs N] [--steps N]

Each run is one emulated SLURM job step of 2 processes (1 node x 2, shard 2, gloo, one
thread each) of the built-in model (4 layers, width 128, seq 64, batch 8, vocab 512, fp32):
eager, then ``--compile`` in a fresh run directory (its compile from scratch), then the same
``--compile`` run directory continued for as many steps again (a resumed attempt: the
compile from the cache). Eager and compiled alternate in order across runs. step: median of
the steps after the first two of each attempt, rank 0 (``step_time_s``); compile: the
attempt's ``compile_s`` (metrics.jsonl). Ratios are compile / eager of the same run.
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

MODEL = ["--layers", "4", "--width", "128", "--heads", "4", "--seq-len", "64", "--batch-size", "8"]
MODEL += ["--vocab-size", "512", "--precision", "fp32", "--lr", "3e-3"]


def attempt(run_dir: Path, steps: int, *, compiled: bool, log: Path) -> dict:
    argv = [*hpc_hsdp_command(), "run", "--shard", "2", "--device", "cpu", "--run-dir", str(run_dir), *MODEL]
    argv += ["--steps", str(steps), "--hang-timeout", "3600"] + (["--compile"] if compiled else [])
    before = _records(run_dir)
    job_step(argv, tasks_per_node=(2,), log_dir=log, timeout_s=1800)
    records = _records(run_dir)[len(before) :]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records[2:]),
        "compile_s": sum(r.get("compile_s", 0.0) for r in records),
        "cache": next((r["compile_cache"] for r in records if "compile_cache" in r), None),
    }


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="steps per attempt")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            base = Path(tmp) / f"run{run}"
            order = (False, True) if run % 2 == 0 else (True, False)
            got = {}
            for compiled in order:
                got[compiled] = attempt(base / f"c{int(compiled)}", args.steps, compiled=compiled, log=base / "logs")
            resumed = attempt(base / "c1", 2 * args.steps, compiled=True, log=base / "logs")
            row = {"eager": got[False], "compile": got[True], "resumed": resumed}
            rows.append(row)
            print(
                f"  [run {run + 1}/{args.runs}] eager step {1000 * got[False]['step_s']:.1f} ms, compiled "
                f"{1000 * got[True]['step_s']:.1f} ms (ratio {got[True]['step_s'] / got[False]['step_s']:.3f}), "
                f"compile {got[True]['compile_s']:.1f} s, resumed compile {resumed['compile_s']:.1f} s "
                f"(cache {resumed['cache']})",
                flush=True,
            )
    ratio = statistics.median(r["compile"]["step_s"] / r["eager"]["step_s"] for r in rows)
    resumed_ratio = statistics.median(r["resumed"]["step_s"] / r["eager"]["step_s"] for r in rows)
    first = statistics.median(r["compile"]["compile_s"] for r in rows)
    cached = statistics.median(r["resumed"]["compile_s"] for r in rows)
    print(f"\nsteady step, compiled / eager: {ratio:.3f} (resumed attempt: {resumed_ratio:.3f})")
    print(f"compile: {first:.1f} s from scratch, {cached:.1f} s from the run directory's cache ({cached / first:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
