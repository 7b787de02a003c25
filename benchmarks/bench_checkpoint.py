"""Checkpoint saves against the physical limit and against each other.

    python benchmarks/bench_checkpoint.py [--runs N] [--width W] [--layers L]

In one emulated job step (1 node x 2 tasks, --shard 2, gloo on CPU) on a model of about
W*W*12*L + 2*8192*W parameters (AdamW, fp32), measured in the same run:

  disk         sequential write bandwidth of the checkpoint's disk: 512 MiB in 8 MiB writes
               and an fsync, by this process (the physical limit a save cannot beat)
  sync save    checkpoint.save (DCP writes, fsync, manifest with CRC-32, rename): bytes of the
               checkpoint / wall time -> ratio to the disk's bandwidth
  crc32        the CRC-32 part of that (each rank over its own files)
  async save   AsyncSaver.save: the time it holds training (host copy of the state, space
               check), then training steps while the background write runs; "stall" = the
               blocking time + the steps' extra time over the median step without a save,
               -> ratio to the synchronous save of the same state (goal <= 0.10)

Each rank measures; rank 0 reports the medians of N repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, job_step  # noqa: E402

TASKS = (2,)


def disk_bandwidth(directory: Path, size: int = 512 << 20, chunk: int = 8 << 20) -> float:
    path = directory / "bandwidth.bin"
    data = os.urandom(chunk)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(size // chunk):
            os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - start
    path.unlink()
    return size / elapsed


def task(args) -> None:
    """What each task of the job step runs."""
    import torch
    import torch.distributed as dist

    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.rundir.checkpointing.state import crc32_of, read_manifest
    from hpc_hsdp.task.checkpointing import checkpoint
    from hpc_hsdp.task.parallelism.dist import init
    from hpc_hsdp.task.training.model import build_model, make_optimizer

    torch.set_num_threads(1)
    work = Path(args.work)
    ctx = init(shard_size=2, device="cpu", run_dir=None)
    training = TrainingSpec.of(layers=args.layers, width=args.width, heads=8, vocab_size=8192, seq_len=32, batch_size=2)
    model = build_model(ctx, resolve_model(training, data_vocab_size=None), training)
    optimizer = make_optimizer(model, training.optimizer)
    ids = torch.randint(0, 8192, (2, 33), generator=torch.Generator().manual_seed(ctx.rank))

    def step() -> float:
        t0 = time.perf_counter()
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss.detach())
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    plain = statistics.median(step() for _ in range(5))
    results = {"sync_s": [], "crc_s": [], "bytes": [], "block_s": [], "extra_s": [], "steps_during": [], "commit_s": []}
    for rep in range(args.runs):
        run = work / f"sync-{rep}"
        dist.barrier()
        t0 = time.perf_counter()
        path = checkpoint.save(run, model, optimizer, step=1, train_state={}, keep=1)
        dist.barrier()
        results["sync_s"].append(time.perf_counter() - t0)
        manifest = read_manifest(path)
        results["bytes"].append(manifest["total_bytes"])
        own = sorted(p for p in path.glob(f"__{ctx.rank}_*.distcp"))
        t0 = time.perf_counter()
        for p in own:
            crc32_of(p)
        results["crc_s"].append(time.perf_counter() - t0)

        saver = checkpoint.AsyncSaver(work / f"async-{rep}", keep=1)
        dist.barrier()
        t0 = time.perf_counter()
        saver.save(model, optimizer, step=1, train_state={})
        blocked = time.perf_counter() - t0
        extra, steps = 0.0, 0
        while saver.in_flight is not None:
            extra += step() - plain
            steps += 1
        t_commit = time.perf_counter() - t0
        saver.close()
        results["block_s"].append(blocked)
        results["extra_s"].append(max(extra, 0.0))
        results["steps_during"].append(steps)
        results["commit_s"].append(t_commit)
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, results)
    if ctx.rank == 0:
        worst = {k: [max(r[k][i] for r in gathered) for i in range(args.runs)] for k in results}
        worst["plain_step_s"] = plain
        worst["params"] = sum(p.numel() for p in model.parameters())
        (work / "results.json").write_text(json.dumps(worst))
    ctx.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--task", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        task(args)
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR") or str(ROOT)) as tmp:
        work = Path(tmp)
        disk = statistics.median(disk_bandwidth(work) for _ in range(3))
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--task",
            "--work",
            str(work),
            "--runs",
            str(args.runs),
            "--width",
            str(args.width),
            "--layers",
            str(args.layers),
        ]
        job_step(argv, tasks_per_node=TASKS, log_dir=work / "logs", timeout_s=1200)
        r = json.loads((work / "results.json").read_text())
    size = statistics.median(r["bytes"])
    sync = statistics.median(r["sync_s"])
    crc = statistics.median(r["crc_s"])
    block = statistics.median(r["block_s"])
    extra = statistics.median(r["extra_s"])
    print(
        f"model: width {args.width}, layers {args.layers}, {r['params']:,} parameters; checkpoint {size / 2**20:,.0f} MiB "
        f"= {size / r['params']:.1f} bytes per parameter (fp32 + AdamW: 12 once); 2 ranks, medians of {args.runs}"
    )
    print(f"disk sequential write (8 MiB writes + fsync)   {disk / 2**20:8.0f} MiB/s   1.00")
    print(
        f"synchronous save                               {size / sync / 2**20:8.0f} MiB/s   {size / sync / disk:.2f}"
        f"   ({sync:.2f} s, of which CRC-32 {crc:.2f} s = {crc / sync:.0%})"
    )
    print(f"async save: blocks training                     {block:8.3f} s      {block / sync:.3f} of the sync save")
    print(
        f"async save: extra step time while writing       {extra:8.3f} s      ({statistics.median(r['steps_during']):.0f} "
        f"steps of {r['plain_step_s'] * 1000:.0f} ms; committed after {statistics.median(r['commit_s']):.2f} s)"
    )
    print(
        f"async save: training stall (blocked + extra)    {block + extra:8.3f} s      {(block + extra) / sync:.3f} of the "
        f"sync save (goal <= 0.10)"
    )


if __name__ == "__main__":
    main()
