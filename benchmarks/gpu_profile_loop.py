"""Where the loop's step time goes on one GPU, mesh (1, 1): the built-in model through
``hpc_hsdp.task.training.loop.train`` with the torch profiler over a few steps (the top operators
by self CPU time and by device time), and the step time of the default optimizer (AdamW over the local
shards, multi-tensor kernel on CUDA) against the same with the fused kernel and against
torch's AdamW over FSDP2's DTensors (the optimizer before issue 24), in the same run.

    python benchmarks/gpu_profile_loop.py                 # needs CUDA
    python benchmarks/gpu_profile_loop.py --device cpu    # tiny, checks the code path
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys

from _launch import free_port  # benchmarks/ is on sys.path: these run as scripts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", type=int, default=25)
    args = parser.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile_loop: CUDA is not available; pass --device cpu to exercise the code path", file=sys.stderr)
        return 0
    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.plan.slurm_env import task_environments
    from hpc_hsdp.task.parallelism.device import configure_device
    from hpc_hsdp.task.parallelism.dist import init
    from hpc_hsdp.task.training import engine
    from hpc_hsdp.task.training.loop import train

    gpu = args.device == "cuda"
    sizes = (
        dict(layers=8, width=1024, heads=16, seq_len=1024, batch_size=8, vocab_size=32768)
        if gpu
        else dict(layers=2, width=64, heads=4, seq_len=32, batch_size=2, vocab_size=256)
    )
    env = task_environments(tasks_per_node=[1], node_names=[socket.gethostname().split(".")[0]], job_id="prof")[0]
    env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    ctx = init(1, args.device, env=env, timeout_s=120)
    default_optimizer = engine.make_optimizer  # the engine builds every loop's optimizer through it

    from hpc_hsdp.task.training.optimizer import LocalShardAdamW

    def groups_of(model, optimizer):
        return [
            {"params": g["params"], "weight_decay": g["weight_decay"]}
            for g in default_optimizer(model, optimizer).param_groups
        ]

    def fused_local(model, optimizer):
        return LocalShardAdamW(groups_of(model, optimizer), lr=optimizer.lr, fused=True)

    def dtensor_foreach(model, optimizer):
        return torch.optim.AdamW(groups_of(model, optimizer), lr=optimizer.lr, foreach=True)

    try:
        configure_device(ctx.device)
        training = TrainingSpec.of(
            **sizes,
            steps=args.steps,
            lr=1e-4,
            precision=args.precision,
            clip_grad=1.0,
            lr_schedule="cosine",
            warmup_steps=2,
        )
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
        times: dict[str, list[float]] = {}
        variants = (
            ("local shards (default)", default_optimizer),
            ("local shards, fused", fused_local),
            ("DTensors, foreach (before)", dtensor_foreach),
        )
        for name, make in variants:
            engine.make_optimizer = make
            state: dict = {}
            records: list[dict] = []

            def on_step(step, record, state=state, records=records, name=name):
                records.append(record)
                if name.endswith("(default)") and step == args.steps - 4:
                    state["prof"] = profile(activities=activities)
                    state["prof"].__enter__()
                if "prof" in state and step == args.steps - 1:
                    state["prof"].__exit__(None, None, None)

            train(ctx, training, on_step=on_step, verbose=False)
            times[name] = [r["step_time_s"] for r in records[3:]]
            if "prof" in state:
                averages = state["prof"].key_averages()
                print(
                    f"== profile of steps {args.steps - 3}-{args.steps - 1}, {name}, {args.precision}: top by self CPU time"
                )
                print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
                if gpu:
                    print("== top by device time")
                    print(averages.table(sort_by="self_device_time_total", row_limit=15))
            if gpu:
                torch.cuda.empty_cache()
        base = statistics.median(times["local shards (default)"])
        for name, values in times.items():
            print(
                f"{name:<26} median step {1000 * statistics.median(values):8.1f} ms  ratio {statistics.median(values) / base:.3f}"
            )
    finally:
        engine.make_optimizer = default_optimizer
        ctx.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
