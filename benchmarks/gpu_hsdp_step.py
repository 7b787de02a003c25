"""One GPU, mesh (1, 1): tokens per second of the HSDP-wrapped built-in model vs the same
model unwrapped, both in bf16 (FSDP2 MixedPrecisionPolicy vs torch.autocast).

    python benchmarks/gpu_hsdp_step.py                  # needs CUDA
    python benchmarks/gpu_hsdp_step.py --device cpu     # CPU fallback (tiny defaults), checks the code path

It sets up a single-task SLURM-like environment itself, so it runs standalone. The ratio
shows what FSDP2's machinery (hooks, all-gather/reduce-scatter on a one-rank group, DTensor
optimizer step) costs when there is nothing to shard.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--vocab-size", type=int)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_hsdp_step: CUDA is not available on this machine; nothing to measure "
              "(run on a GPU node, or pass --device cpu to exercise the code path)", file=sys.stderr)  # fmt: skip
        return 0
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hpc_hsdp.runtime.data import rank_batch
    from hpc_hsdp.runtime.dist import init
    from hpc_hsdp.runtime.model import ModelConfig, build_model, init_parameters, loss_fn
    from hpc_hsdp.runtime.train import build_hsdp_model, make_optimizer
    from hpc_hsdp.slurm_env import task_environments
    from hpc_hsdp.spec import TrainingSpec

    gpu = args.device == "cuda"
    defaults = (dict(layers=8, width=1024, heads=16, seq_len=1024, batch_size=8, vocab_size=32768) if gpu
                else dict(layers=2, width=64, heads=4, seq_len=64, batch_size=4, vocab_size=256))  # fmt: skip
    sizes = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    training = TrainingSpec(**sizes, steps=args.steps, lr=1e-4)
    if not gpu:
        torch.set_num_threads(1)

    env = task_environments(tasks_per_node=[1], node_names=[socket.gethostname().split(".")[0]], job_id="bench")[0]
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    ctx = init(1, args.device, env=env, timeout_s=120)
    try:
        device = ctx.device
        bf16 = args.precision == "bf16"
        tokens = training.batch_size * training.seq_len
        batches = [rank_batch(seed=0, step=s, rank=0, world_size=1, batch_size=training.batch_size,
                              seq_len=training.seq_len, vocab_size=training.vocab_size)
                   for s in range(1, args.warmup + args.steps + 1)]  # fmt: skip
        batches = [(x.to(device), y.to(device)) for x, y in batches]

        def sync() -> None:
            if gpu:
                torch.cuda.synchronize(device)

        def measure(model, optimizer, autocast: bool) -> tuple[float, int, float]:
            if gpu:
                torch.cuda.reset_peak_memory_stats(device)
            loss = None
            for i, (x, y) in enumerate(batches):
                if i == args.warmup:
                    sync()
                    start = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            sync()
            elapsed = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(device) if gpu else 0
            return tokens * args.steps / elapsed, peak, float(loss.detach())

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        hsdp_model = build_hsdp_model(ctx, training, mp_policy=policy)
        hsdp = measure(hsdp_model, make_optimizer(hsdp_model, training), autocast=False)
        del hsdp_model
        if gpu:
            torch.cuda.empty_cache()

        plain_model = build_model(ModelConfig.from_training(training), device=device)
        init_parameters(plain_model, seed=training.seed)
        plain = measure(plain_model, make_optimizer(plain_model, training), autocast=bf16)

        params = sum(p.numel() for p in plain_model.parameters())
        print(f"device {device}  precision {args.precision}  params {params / 1e6:.1f}M  "
              f"batch {training.batch_size}x{training.seq_len} tokens  {args.steps} steps after {args.warmup} warm-up")  # fmt: skip
        print(f"{'variant':<22}{'tokens/s':>14}{'peak MiB':>12}{'last loss':>12}")
        for name, (rate, peak, loss) in (("HSDP mesh (1,1)", hsdp), ("unwrapped", plain)):
            print(f"{name:<22}{rate:>14,.0f}{peak / 2**20:>12,.0f}{loss:>12.4f}")
        print(f"HSDP / unwrapped throughput: {hsdp[0] / plain[0]:.3f}")
    finally:
        ctx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
