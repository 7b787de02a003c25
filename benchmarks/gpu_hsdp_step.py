"""One GPU, mesh (1, 1): the training loop's tokens per second in bf16 and in fp32, the
time it waits for data with the pinned-memory prefetch, and the loop against the same model
unwrapped (no FSDP, no loader: batches already on the GPU, torch.autocast for bf16).

    python benchmarks/gpu_hsdp_step.py                         # needs CUDA; bf16 and fp32
    python benchmarks/gpu_hsdp_step.py --precision bf16
    python benchmarks/gpu_hsdp_step.py --device cpu            # CPU (tiny defaults): checks the code path

It sets up a single-task SLURM-like environment itself, so it runs standalone. The loop
variant is ``hpc_hsdp.task.training.loop.train`` itself (synthetic tokens through the prefetching
loader, the fused metrics all-reduce and its one host sync per step, TF32 on CUDA); its
step time is the loop's own ``step_time_s`` of the timed steps. The unwrapped ratio shows
what FSDP2's machinery and the loop cost when there is nothing to shard.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

from _launch import free_port  # benchmarks/ is on sys.path: these run as scripts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", choices=["both", "bf16", "fp32"], default="both")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_hsdp_step: CUDA is not available on this machine; nothing to measure "
            "(run on a GPU node, or pass --device cpu to exercise the code path)",
            file=sys.stderr,
        )
        return 0
    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.models.builtin import ModelConfig, build_model, init_parameters, loss_fn
    from hpc_hsdp.plan.slurm_env import task_environments
    from hpc_hsdp.task.parallelism.device import configure_device
    from hpc_hsdp.task.parallelism.dist import init
    from hpc_hsdp.task.training.loader import read_rows
    from hpc_hsdp.task.training.loop import train
    from hpc_hsdp.task.training.run_data import open_data

    gpu = args.device == "cuda"
    defaults = (
        dict(layers=8, width=1024, heads=16, seq_len=1024, batch_size=8, vocab_size=32768)
        if gpu
        else dict(layers=2, width=64, heads=4, seq_len=64, batch_size=4, vocab_size=256)
    )
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    precisions = ("bf16", "fp32") if args.precision == "both" else (args.precision,)
    if not gpu:
        torch.set_num_threads(1)

    env = task_environments(tasks_per_node=[1], node_names=[socket.gethostname().split(".")[0]], job_id="bench")[0]
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    ctx = init(1, args.device, env=env, timeout_s=120)
    rows = []
    try:
        device = ctx.device
        configure_device(device)
        total = args.warmup + args.steps

        def sync() -> None:
            if gpu:
                torch.cuda.synchronize(device)

        for precision in precisions:
            training = TrainingSpec.of(
                **sizes,
                steps=total,
                lr=1e-4,
                precision=precision,
                grad_accum=args.grad_accum,
                clip_grad=1.0,
                lr_schedule="cosine",
                warmup_steps=2,
            )
            tokens_per_step = training.dataset.global_batch(1) * training.dataset.seq_len
            records = []
            result = train(ctx, training, on_step=lambda _step, record, out=records: out.append(record), verbose=False)
            timed = records[args.warmup :]
            step_time = sum(r["step_time_s"] for r in timed)
            rows.append(
                {
                    "variant": "loop (HSDP (1,1))",
                    "precision": precision,
                    "tokens_per_s": tokens_per_step * len(timed) / step_time,
                    "step_ms": 1000 * step_time / len(timed),
                    "data_wait": sum(r["data_wait_s"] for r in timed) / step_time,
                    "peak": max(r["peak_mem_bytes"] for r in timed) if gpu else 0,
                    "reserved": max(r.get("peak_mem_reserved_bytes", 0) for r in timed),
                    "loss": timed[-1]["loss"],
                }
            )
            del result
            if gpu:
                torch.cuda.empty_cache()

            data = open_data(training, 1)
            batches = []
            for step in range(1, total + 1):
                for micro in range(training.dataset.grad_accum):
                    x, y = read_rows(data.train, data.order.sample_ids(data.layout.positions(step, micro, 0)))
                    batches.append((x.to(device), y.to(device)))
            model = build_model(ModelConfig.from_training(training), device=device)
            init_parameters(model, seed=training.optimizer.seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=training.optimizer.lr)
            if gpu:
                torch.cuda.reset_peak_memory_stats(device)
            for step in range(total):
                if step == args.warmup:
                    sync()
                    start = time.perf_counter()
                for x, y in batches[step * training.dataset.grad_accum : (step + 1) * training.dataset.grad_accum]:
                    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                        loss = loss_fn(model(x), y)
                    (loss / training.dataset.grad_accum).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            sync()
            elapsed = time.perf_counter() - start
            rows.append(
                {
                    "variant": "unwrapped",
                    "precision": precision,
                    "tokens_per_s": tokens_per_step * args.steps / elapsed,
                    "step_ms": 1000 * elapsed / args.steps,
                    "data_wait": 0.0,
                    "peak": torch.cuda.max_memory_allocated(device) if gpu else 0,
                    "reserved": torch.cuda.max_memory_reserved(device) if gpu else 0,
                    "loss": loss.item(),
                }
            )
            del model, optimizer, batches
            if gpu:
                torch.cuda.empty_cache()

        name = torch.cuda.get_device_name(device) if gpu else "cpu"
        params = sum(p.numel() for p in build_model(ModelConfig.from_training(training), device="meta").parameters())
        print(
            f"device {device} ({name})  torch {torch.__version__}  params {params / 1e6:.1f}M  batch "
            f"{training.dataset.batch_size}x{training.dataset.seq_len} x {training.dataset.grad_accum} micro  {args.steps} steps after "
            f"{args.warmup} warm-up; clip 1.0, cosine"
        )
        print(
            f"{'variant':<20}{'precision':>10}{'tokens/s':>14}{'step ms':>10}{'data wait':>11}{'peak MiB':>10}"
            f"{'reserved MiB':>14}{'last loss':>11}"
        )
        for r in rows:
            print(
                f"{r['variant']:<20}{r['precision']:>10}{r['tokens_per_s']:>14,.0f}{r['step_ms']:>10.1f}"
                f"{r['data_wait']:>10.2%}{r['peak'] / 2**20:>10,.0f}{r['reserved'] / 2**20:>14,.0f}"
                f"{r['loss']:>11.4f}"
            )
        loop = {r["precision"]: r for r in rows if r["variant"].startswith("loop")}
        plain = {r["precision"]: r for r in rows if r["variant"] == "unwrapped"}
        if len(loop) == 2:
            print(f"loop bf16 / fp32 tokens/s: {loop['bf16']['tokens_per_s'] / loop['fp32']['tokens_per_s']:.2f}x")
        for p in loop:
            print(
                f"{p}: loop / unwrapped tokens/s {loop[p]['tokens_per_s'] / plain[p]['tokens_per_s']:.3f}; "
                f"data wait {loop[p]['data_wait']:.2%} of step time (pinned prefetch)"
            )
    finally:
        ctx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
