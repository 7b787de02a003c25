"""The readers of a run directory against the run's length: time and peak memory of `status`,
`runs`, `report` and `logs` on synthetic runs of 10k to 10M steps and logs of 10 MB to 2 GB.

    python benchmarks/bench_rundir.py                 # 10k and 100k steps, 10 MB and 100 MB logs
    python benchmarks/bench_rundir.py --large         # and 1M steps, 1 GB and 2 GB logs (~2 GB of disk)
    python benchmarks/bench_rundir.py --steps 10k,1M,10M --log-sizes 10M,2G   # any sizes (10M steps: ~5.5 GB)
    python benchmarks/bench_rundir.py --dir /scratch/x --keep                 # where; keep the files

Each run's metrics.jsonl is written by the project's own writer (``MetricsLog``), rows shaped as
the loop writes them (~550 bytes: loss that varies step to step, with a spike every 99,991 steps,
lr, grad norm, tokens, clocks, peak memory, mesh; straggler times of 8 ranks every 50 steps, an
eval loss every 500). Every command runs in its own process (``python -m hpc_hsdp ...``) and its
peak RSS is that process's ``ru_maxrss`` (os.wait4). The baselines, measured in the same run on
the same files: ``json pass`` (one plain ``json.loads`` per line over the file: the time `report`
must not exceed) and ``orjson pass``. The goal: memory flat in the run's length, time growing no
faster than the bytes that must be read (the tail for status/runs/logs --tail, the file for report).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_STEPS = "10k,100k"
DEFAULT_LOGS = "10M,100M"
LARGE_STEPS = "10k,100k,1M"
LARGE_LOGS = "10M,100M,1G,2G"
UNITS = {"": 1, "k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}


def size(text: str) -> int:
    """``10k`` -> 10000, ``2G`` -> 2e9."""
    text = text.strip()
    unit = text[-1] if text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def label(n: int) -> str:
    for unit in ("G", "M", "k"):
        if n >= UNITS[unit] and n % UNITS[unit] == 0:
            return f"{n // UNITS[unit]}{unit}"
    return str(n)


def rows(steps: int, *, world: int = 8, probe_every: int = 50, eval_every: int = 500):
    """Records shaped as the built-in loop writes them (task/training/engine.py step_record + publish)."""
    rnd = random.Random(0)
    began = 1.7e9
    for s in range(1, steps + 1):
        step_time = 0.25 + 0.02 * rnd.random()
        record = {
            "step": s,
            "loss": 2.0 + 8.0 / math.sqrt(s) + 0.05 * rnd.gauss(0, 1) + (3.0 if s % 99_991 == 0 else 0.0),
            "lr": 3e-4 * min(1, s / 2000),
            "grad_norm": 0.5 + rnd.random(),
            "tokens_seen": s * 524_288,
            "tokens_per_s": 524_288 / step_time,
            "step_time_s": step_time,
            "cpu_time_s": step_time * 0.9,
            "data_wait_s": 0.001 * rnd.random(),
            "peak_mem_bytes": 60_000_000_000 + rnd.randrange(1 << 20),
            "peak_mem_kind": "cuda_max_allocated",
            "peak_mem_reserved_bytes": 70_000_000_000,
            "world_size": world,
            "shard_size": 8,
            "num_replicas": 1,
            "grad_accum": 1,
            "global_batch": 256,
            "precision": "bf16",
        }
        if probe_every and s % probe_every == 0:
            times = [round(0.2 + 0.01 * rnd.random(), 6) for _ in range(world)]
            record["stragglers"] = {"own_time_s": times, "median_s": sorted(times)[world // 2 - 1], "slowest_rank": 0}
        if eval_every and s % eval_every == 0:
            record["eval_loss"] = record["loss"] + 0.1
            record["eval_time_s"] = 1.5
        record["wall_time"] = began + s * step_time
        record["elapsed_s"] = s * step_time
        yield record


JOB_ID = "4242"


def make_run(run_dir: Path, steps: int) -> Path:
    """A finished run directory: metrics.jsonl (MetricsLog), attempt.json, layout.json, job.json."""
    from hpc_hsdp.rundir.training.metrics import MetricsLog

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    log = MetricsLog(run_dir, start_step=0)
    for record in rows(steps):
        log.write(record)
    (run_dir / "attempt.json").write_text(json.dumps({"total_steps": steps, "ended": {"reason": "completed"}}))
    ranks = [{"rank": r, "node": f"n{r // 4 + 1}", "slurm_procid": r} for r in range(8)]
    (run_dir / "layout.json").write_text(json.dumps({"ranks": ranks}))
    job = {
        "job_id": JOB_ID,
        "cluster": "local",
        "run_dir": str(run_dir),
        "logs_dir": str(run_dir / "logs"),
        "job_name": run_dir.name,
        "ntasks": 1,
        "launcher": "srun",
        "submitted_at": time.time(),
    }
    (run_dir / "job.json").write_text(json.dumps(job))
    return run_dir


def make_log(path: Path, nbytes: int) -> None:
    """A task log of ``nbytes``: lines as a training job prints them, written a MiB at a time."""
    lines = []
    for i in range(12_000):
        lines.append(f"[rank 0] step {i:>8} loss {2 + 1 / (1 + i):.4f} 1953640 tok/s 268.4 ms/step lr 3.00e-04\n")
    block = "".join(lines).encode()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(block[:left])
            left -= len(block)


def measure(cmd: list[str]) -> tuple[float, float, float]:
    """(wall s, cpu s, peak RSS MB) of ``cmd`` in its own process (stdout discarded)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    err = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpc_hsdp", *args]


def baseline(path: Path, parser: str) -> list[str]:
    """One plain pass of ``parser``'s loads over every line of ``path``."""
    if parser == "json":
        code = "import json,sys\nfor line in open(sys.argv[1], encoding='utf-8'): json.loads(line)"
    else:
        code = "import orjson,sys\nfor line in open(sys.argv[1], 'rb'): orjson.loads(line)"
    return [sys.executable, "-c", code, str(path)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", default=None, help=f"run lengths (default {DEFAULT_STEPS}; --large: {LARGE_STEPS})")
    parser.add_argument("--log-sizes", default=None, help=f"log sizes (default {DEFAULT_LOGS}; --large: {LARGE_LOGS})")
    parser.add_argument("--large", action="store_true", help="the big sizes too (about 2.6 GB of disk, minutes)")
    parser.add_argument("--dir", default=None, help="where to write the runs (default: a new directory in /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    parser.add_argument("--tail", type=int, default=100, help="lines for logs --tail")
    args = parser.parse_args()
    steps = [size(s) for s in (args.steps or (LARGE_STEPS if args.large else DEFAULT_STEPS)).split(",")]
    log_sizes = [size(s) for s in (args.log_sizes or (LARGE_LOGS if args.large else DEFAULT_LOGS)).split(",")]
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-rundir-"))
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    needed = sum(steps) * 560 + max(log_sizes, default=0) + (1 << 30)
    if needed > free:
        raise SystemExit(f"{base}: {free / 1e9:.1f} GB free, these sizes need about {needed / 1e9:.1f} GB")
    table: list[tuple[str, str, float, float, float]] = []

    def record(what: str, command: str, cmd: list[str]) -> None:
        wall, cpu, rss = measure(cmd)
        table.append((what, command, wall, cpu, rss))
        print(f"{what:>10}  {command:<22} {wall:8.2f} s  cpu {cpu:8.2f} s  {rss:8.1f} MB", flush=True)

    try:
        small = [make_run(base / "runs" / f"small-{i}", 100) for i in range(3)]
        del small
        for n in steps:
            run = base / "runs" / f"run-{label(n)}"
            started = time.perf_counter()
            make_run(run, n)
            mb = (run / "metrics.jsonl").stat().st_size / 1e6
            print(f"{label(n)} steps: metrics.jsonl {mb:.0f} MB written in {time.perf_counter() - started:.0f} s")
            what = f"{label(n)} st"
            metrics = run / "metrics.jsonl"
            record(what, "json pass (baseline)", baseline(metrics, "json"))
            try:
                import orjson  # noqa: F401

                record(what, "orjson pass", baseline(metrics, "orjson"))
            except ImportError:
                pass
            record(what, "status", cli("status", str(run)))
            record(what, "runs (4 runs)", cli("runs", str(base / "runs")))
            record(what, "report -o r.png", cli("report", str(run), "-o", str(base / "r.png")))
            record(what, "report -o r.html", cli("report", str(run), "-o", str(base / "r.html")))
            shutil.rmtree(run)  # one long run at a time: `runs` sees it and the three short ones
        logs_run = make_run(base / "logs-run", 10)
        for nbytes in log_sizes:
            log = logs_run / "logs" / f"{JOB_ID}_0_log.out"
            make_log(log, nbytes)
            what = f"{label(nbytes)}B log"
            record(what, f"logs --tail {args.tail}", cli("logs", str(logs_run), "--tail", str(args.tail)))
            record(what, "logs (all, streamed)", cli("logs", str(logs_run), "--rank", "0"))
            log.unlink()
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    print()
    print("| size | command | wall s | cpu s | peak RSS MB |")
    print("|---|---|---|---|---|")
    for what, command, wall, cpu, rss in table:
        print(f"| {what} | {command} | {wall:.2f} | {cpu:.2f} | {rss:.0f} |")


if __name__ == "__main__":
    main()
