"""What each tracker costs rank 0 per metrics row: TensorBoard, W&B (offline), MLflow (file store).

    python benchmarks/bench_trackers.py [--rows N] [--runs N]

In one process, as rank 0's tracker thread runs them: each tracker is opened on a fresh run
directory (its import included, measured once), then given N rows of a full record (loss,
eval loss, lr, grad norm, throughput, clocks, memory, comm bytes per axis, stragglers: 17
scalars), then closed. Reported per tracker: ms per row in its ``log`` (the time the tracker
thread spends, off the training step), the open and the close; against the baseline measured
in the same run, the append of the same record to metrics.jsonl. And what the step itself
pays with the trackers on: ``Trackers.log`` (the row's scalars taken and queued).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpc_hsdp.rundir.training.metrics import MetricsLog  # noqa: E402
from hpc_hsdp.rundir.training.scalars import record_scalars  # noqa: E402


def record(step: int) -> dict:
    return {
        "step": step,
        "loss": 4.0 / step,
        "eval_loss": 4.1 / step,
        "lr": 3e-3,
        "grad_norm": 1.2,
        "tokens_seen": step * 512,
        "tokens_per_s": 5000.0,
        "step_time_s": 0.05,
        "cpu_time_s": 0.04,
        "data_wait_s": 0.0001,
        "peak_mem_bytes": 400 << 20,
        "peak_mem_kind": "ru_maxrss",
        "world_size": 4,
        "comm": {
            "intra_node_wire_bytes": 1 << 20,
            "inter_node_wire_bytes": 1 << 19,
            "shard": {"all_gather": {"wire_bytes": 1 << 20}},
            "replicate": {"all_reduce": {"wire_bytes": 1 << 19}},
        },
        "stragglers": {"spread": 1.1, "slowest_rank": 3, "median_s": 0.04},
        "wall_time": time.time(),
    }


def measure(name: str, rows: int, work: Path) -> dict:
    import importlib

    from hpc_hsdp.task.observation.trackers import MODULES, TrackerStart

    run_dir = work / name
    run_dir.mkdir()
    start = TrackerStart(run_dir=run_dir, start_step=0, last_logged=None, total_steps=rows, config={"steps": rows})
    began = time.perf_counter()
    tracker = importlib.import_module(MODULES[name]).open_tracker(start)
    opened = time.perf_counter() - began
    rows_scalars = [(s, record_scalars(record(s)), time.time()) for s in range(1, rows + 1)]
    began = time.perf_counter()
    for step, scalars, wall in rows_scalars:
        tracker.log(step, scalars, wall)
    per_row = (time.perf_counter() - began) / rows
    began = time.perf_counter()
    tracker.close("completed")
    return {"open_s": opened, "row_ms": per_row * 1000, "close_s": time.perf_counter() - began}


def baseline(rows: int, work: Path) -> float:
    log = MetricsLog(work / "metrics", start_step=0)
    records = [record(s) for s in range(1, rows + 1)]
    began = time.perf_counter()
    for r in records:
        log.write(r)
    return (time.perf_counter() - began) / rows * 1000


def step_side(rows: int, work: Path) -> float:
    """ms per row that the training step pays: Trackers.log with no tracker behind it (``()``)."""
    from hpc_hsdp.task.observation.trackers import Trackers, TrackerStart

    start = TrackerStart(run_dir=work, start_step=0, last_logged=None, total_steps=rows, config={})
    trackers = Trackers((), start)
    records = [record(s) for s in range(1, rows + 1)]
    began = time.perf_counter()
    for r in records:
        trackers.log(r)
    cost = (time.perf_counter() - began) / rows * 1000
    trackers.close("completed")
    return cost


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    import os

    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ.pop("WANDB_MODE", None)
    results: dict[str, list[dict]] = {n: [] for n in ("tensorboard", "wandb", "mlflow")}
    base, queued = [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            base.append(baseline(args.rows, work))
            queued.append(step_side(args.rows, work))
            for name in results:
                results[name].append(measure(name, args.rows, work))
    b = statistics.median(base)
    print(f"{args.rows} rows x {args.runs} runs; 17 scalars per row")
    print("| tracker | ms per row (tracker thread) | ratio to metrics.jsonl append | open s (1st: import) | close s |")
    print("|---|---:|---:|---:|---:|")
    print(f"| metrics.jsonl append (baseline) | {b:.3f} | 1.00 | | |")
    for name, runs in results.items():
        row = statistics.median(r["row_ms"] for r in runs)
        print(
            f"| {name} | {row:.3f} | {row / b:.1f} | {runs[0]['open_s']:.2f} "
            f"({statistics.median(r['open_s'] for r in runs[1:]) if len(runs) > 1 else float('nan'):.2f} after) "
            f"| {statistics.median(r['close_s'] for r in runs):.2f} |"
        )
    print(f"on the step: Trackers.log (scalars taken, queued) {statistics.median(queued):.4f} ms per row")
    return 0


if __name__ == "__main__":
    sys.exit(main())
