"""``--stage-data``: the loader's data wait on a shared file system with added latency, with and
without staging (issue 37).

    python benchmarks/bench_staging.py [--runs N] [--steps N] [--latency-ms 2,10] [--megabytes MB]

The "shared file system" is a directory whose every token-file read first waits L ms: the test
hook ``HPC_HSDP_FAULT_READ_LATENCY=<seconds>@<dir>`` (hpc_hsdp.data.tokens), which the loader's
row reads and the staging copy's 8 MiB chunk reads both pay, as a round trip to a loaded
parallel file system would (no FUSE, no root). The dataset is random tokens, MB megabytes in two
train shards. Each run is one emulated SLURM job step of 4 processes (2 nodes x 2, --shard 2, gloo
on CPU, one thread each), the built-in model, --batch-size 8, --seq-len 64; three variants,
interleaved run by run, at each latency:

  shared       hpc-hsdp run --data DIR (every row read from the slow directory): the baseline
  staged cold  --stage-data FRESH_DIR: the job copies the data first (the copy's time is in
               staging.json), then reads the copy
  staged warm  --stage-data of the previous cold run: a second job on the node, which verifies
               the copy (one SHA-256 pass) and reads it

Reported per latency (medians over the runs of steps 2..N of rank 0): the data wait per step
(``data_wait_s``), the step time, the wait as a share of the step, the staging time, and each
staged variant's ratio to the shared one in the same run (data wait, step time, time to the end
of the last step from the first process's start). The losses of the three are checked equal.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, hpc_hsdp_command, job_step  # noqa: E402

sys.path.insert(0, str(ROOT))
TASKS = (2, 2)
MODEL = ["--layers", "2", "--width", "64", "--heads", "4", "--seq-len", "64", "--batch-size", "8"]


def make_dataset(root: Path, megabytes: float) -> Path:
    import numpy as np

    from hpc_hsdp.data.tokens import write_dataset_manifest, write_token_file

    tokens = int(megabytes * 2**20 / 2)
    rng = np.random.default_rng(0)
    (root / "train").mkdir(parents=True)
    names = []
    for i, size in enumerate((tokens // 2, tokens - tokens // 2)):
        write_token_file(root / "train" / f"{i:05d}.bin", rng.integers(0, 512, size), vocab_size=512)
        names.append(f"train/{i:05d}.bin")
    write_dataset_manifest(root, vocab_size=512, dtype="uint16", tokenizer={}, splits={"train": names})
    return root


def one_job(work: Path, name: str, data: Path, steps: int, latency_s: float, stage: Path | None) -> dict:
    run_dir = work / name
    argv = [*hpc_hsdp_command(), "run", "--shard", "2", "--run-dir", str(run_dir), "--device", "cpu"]
    argv += ["--data", str(data), "--steps", str(steps), "--seed", "1", "--tracker", "none", *MODEL]
    argv += ["--straggler-every", "0"]
    if stage is not None:
        argv += ["--stage-data", str(stage)]
    env = {"HPC_HSDP_FAULT_READ_LATENCY": f"{latency_s}@{data}"}
    started = job_step(argv, tasks_per_node=TASKS, log_dir=work / f"{name}-logs", extra_env=env)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    staging = run_dir / "staging.json"
    body = records[1:]
    return {
        "wait": statistics.median(r["data_wait_s"] for r in body),
        "step": statistics.median(r["step_time_s"] for r in body),
        "end": records[-1]["wall_time"] - started,
        "stage_s": json.loads(staging.read_text())["seconds"] if staging.exists() else 0.0,
        "losses": [r["loss"] for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--latency-ms", default="2,10")
    parser.add_argument("--megabytes", type=float, default=16)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-staging-"))
    try:
        data = make_dataset(work / "shared" / "corpus", args.megabytes)
        print(f"dataset: {args.megabytes:g} MB in 2 shards; 2 nodes x 2 ranks, {args.steps} steps, {args.runs} runs")
        header = (
            f"{'latency':>8} {'variant':>12} {'wait ms':>8} {'step ms':>8} {'wait/step':>9} {'stage s':>8} "
            f"{'end s':>7} {'wait/shared':>11} {'step/shared':>11} {'end/shared':>10}"
        )
        print(header)
        for latency_ms in (float(x) for x in args.latency_ms.split(",")):
            rows = {"shared": [], "staged cold": [], "staged warm": []}
            for run in range(args.runs):
                stage = work / f"local-{latency_ms:g}-{run}"
                tag = f"{latency_ms:g}ms-{run}"
                rows["shared"].append(one_job(work, f"shared-{tag}", data, args.steps, latency_ms / 1000, None))
                rows["staged cold"].append(one_job(work, f"cold-{tag}", data, args.steps, latency_ms / 1000, stage))
                rows["staged warm"].append(one_job(work, f"warm-{tag}", data, args.steps, latency_ms / 1000, stage))
                losses = {tuple(r[-1]["losses"]) for r in rows.values()}
                assert len(losses) == 1, f"the variants trained to different losses: {losses}"
            for variant, results in rows.items():
                base = rows["shared"]

                def median(key, results=results):
                    return statistics.median(r[key] for r in results)

                def ratio(key, results=results, base=base):
                    ratios = [r[key] / b[key] if b[key] else float("nan") for r, b in zip(results, base)]
                    return statistics.median(ratios)

                print(
                    f"{latency_ms:>6g}ms {variant:>12} {median('wait') * 1e3:>8.1f} {median('step') * 1e3:>8.1f} "
                    f"{median('wait') / median('step'):>9.1%} {median('stage_s'):>8.2f} {median('end'):>7.1f} "
                    f"{ratio('wait'):>11.3f} {ratio('step'):>11.3f} {ratio('end'):>10.3f}"
                )
            time.sleep(0.1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
