"""The host's share of a step: the loop against the same model unwrapped, where every op is tiny.

    python benchmarks/bench_host_step.py [--runs N] [--steps N] [--width W]

The built-in 169M model's structure (8 blocks, 16 heads: the same modules, parameters and
FSDP units as on the H200) at a width so small that the device's work is negligible: what
is left of a step is the host's, which is what made the 169M loop 0.40x of the unwrapped
model on the H200 (64 ms against 26 ms; 24 ms of GPU work). Gloo on CPU, one thread per rank.

Variants, interleaved, each an emulated SLURM job step of its own:
  unwrapped   one process: the plain model, torch's AdamW, gradient clipping, a host read
              of the loss per step (the baseline; what ``gpu_hsdp_step.py`` calls unwrapped)
  before      the loop as it was: torch's AdamW over FSDP2's DTensors, every block an FSDP
              unit at every size, the 2-D mesh with one replica
  loop        the loop as it is: AdamW over the local shards, one FSDP unit in a job of one
              rank, the shard axis alone with one replica
``before`` and ``loop`` run on 1 rank (mesh (1, 1)) and on 2 (one node, --shard 2, mesh (1, 2)).
Printed: median host milliseconds per step (steps 6..N) and CPU milliseconds per step (the
process's, all threads), each as a ratio to ``unwrapped`` and ``loop`` to ``before``.
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
from _launch import job_step  # noqa: E402

SIZES = dict(layers=8, heads=16, seq_len=32, batch_size=2, vocab_size=512)


def _training(args):
    from hpc_hsdp.job.spec import TrainingSpec

    return TrainingSpec.of(
        **SIZES,
        width=args.width,
        steps=args.steps,
        precision="fp32",
        clip_grad=1.0,
        lr_schedule="cosine",
        warmup_steps=2,
        eval_every=0,
    )


def _unwrapped(args) -> dict:
    import torch

    from hpc_hsdp.models.builtin import ModelConfig, build_model, init_parameters, loss_fn

    torch.set_num_threads(1)
    training = _training(args)
    model = build_model(ModelConfig.from_training(training), device="cpu")
    init_parameters(model, seed=0)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": training.optimizer.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=training.optimizer.lr,
    )
    generator = torch.Generator().manual_seed(0)
    shape = (training.dataset.batch_size, training.dataset.seq_len)
    walls, cpus = [], []
    for _ in range(training.optimizer.steps):
        inputs = torch.randint(0, training.model.vocab_size, shape, generator=generator)
        targets = torch.randint(0, training.model.vocab_size, shape, generator=generator)
        wall, cpu = time.perf_counter(), time.process_time()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, training.optimizer.clip_grad, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return {"step_s": walls, "cpu_s": cpus}


def _loop(args, *, before: bool) -> dict | None:
    import torch

    from hpc_hsdp.task.parallelism import hsdp
    from hpc_hsdp.task.parallelism.dist import init
    from hpc_hsdp.task.training import engine, model
    from hpc_hsdp.task.training.loop import train

    torch.set_num_threads(1)
    if before:

        def dtensor_adamw(module, optimizer):
            groups = [
                {"params": g["params"], "weight_decay": g["weight_decay"]}
                for g in model.make_optimizer(module, optimizer).param_groups
            ]
            return torch.optim.AdamW(groups, lr=optimizer.lr, fused=True)  # the old default on CPU

        engine.make_optimizer = dtensor_adamw
        model.units_to_wrap = lambda units, world_size: units
        hsdp.fsdp_mesh = lambda mesh: mesh
    world = int(os.environ["SLURM_NTASKS"])
    ctx = init(world, "cpu", timeout_s=120)
    records: list[dict] = []
    try:
        train(ctx, _training(args), on_step=lambda step, record: records.append(record), verbose=False)
    finally:
        ctx.shutdown()
    if ctx.rank != 0:
        return None
    return {"step_s": [r["step_time_s"] for r in records], "cpu_s": [r["cpu_time_s"] for r in records]}


def _worker(args) -> int:
    out = _unwrapped(args) if args.worker == "unwrapped" else _loop(args, before=args.worker == "before")
    if out is not None:
        Path(args.out).write_text(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--worker", choices=["unwrapped", "before", "loop"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    variants = [("unwrapped", 1), ("before", 1), ("loop", 1), ("before", 2), ("loop", 2)]
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-host-step-") as scratch:
        for run in range(args.runs):
            for name, ranks in variants:
                out = Path(scratch) / f"{name}-{ranks}-{run}.json"
                argv = [sys.executable, __file__, "--worker", name, "--out", str(out)]
                argv += ["--steps", str(args.steps), "--width", str(args.width)]
                job_step(argv, tasks_per_node=(ranks,), log_dir=Path(scratch) / f"logs-{name}-{ranks}-{run}")
                timed = json.loads(out.read_text())
                for key, values in timed.items():
                    results.setdefault((name, ranks), {}).setdefault(key, []).append(statistics.median(values[5:]))
    median = {key: {k: statistics.median(v) for k, v in value.items()} for key, value in results.items()}
    base = median[("unwrapped", 1)]
    print(
        f"built-in model, {SIZES['layers']} blocks of width {args.width}, fp32, {args.runs} runs x {args.steps} steps"
    )
    print(
        f"{'variant':<12} {'ranks':>5} {'step ms':>9} {'/unwrapped':>10} {'cpu ms':>8} {'/unwrapped':>10} {'/before':>8}"
    )
    for name, ranks in variants:
        row = median[(name, ranks)]
        earlier = median.get(("before", ranks)) if name == "loop" else None
        against = f"{row['step_s'] / earlier['step_s']:8.3f}" if earlier else f"{'':>8}"
        print(
            f"{name:<12} {ranks:>5} {1000 * row['step_s']:9.2f} {row['step_s'] / base['step_s']:10.3f} "
            f"{1000 * row['cpu_s']:8.2f} {row['cpu_s'] / base['cpu_s']:10.3f} {against}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
