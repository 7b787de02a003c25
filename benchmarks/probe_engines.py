"""Where does FSDP1 HYBRID_SHARD's step advantage over FSDP2 come from? One emulated job step
(4 processes, 2 x 2, shard 2) builds the same model once per variant and then runs the
variants' steps interleaved, one step of each per round, so that the machine's load hits
every variant alike. Per variant, rank 0 prints the median of forward+backward, optimizer
step and the whole step, and the ratio to FSDP1.

    python benchmarks/probe_engines.py [--rounds N] [--width 128 --layers 4 --vocab 512]
        [--variants fsdp1,fsdp2,fsdp2-foreach,...]

Variants (one change at a time against ``fsdp2``, hpc-hsdp's wrap_hsdp defaults; the fsdp2
flags combine, e.g. ``fsdp2-fused-noreshard``):
  fsdp1              FSDP1 HYBRID_SHARD, use_orig_params=True, each block a unit (Lightning's)
  fsdp1-flat         the same with use_orig_params=False (the optimizer on the flat parameters)
  fsdp2              fully_shard per block (reshard after forward) + root (kept), AdamW default
  fsdp2-noreshard    blocks keep their parameters after forward (no re-gather in backward)
  fsdp2-foreach      AdamW(foreach=True)
  fsdp2-fused        AdamW(fused=True)
  hpc-hsdp           hpc-hsdp's build_model + make_optimizer + train_step (the loop's step
                     without its per-step bookkeeping); hpc-hsdp-kept: --reshard-after-forward never;
                     hpc-hsdp-unfused: with torch's default AdamW (hpc-hsdp before issue 14)
  fsdp2-lastkept     the last block keeps its parameters (backward needs them first)
  fsdp2-prefetch2    explicit set_modules_to_forward/backward_prefetch one block ahead
                     (FSDP2's default: implicit, the next block's all-gather issued in pre-forward)
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from handwritten_fsdp2 import Block, Model, init_weights  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


def build_hpc_hsdp(variant, a, mesh):
    """hpc-hsdp's own build_model + make_optimizer (+ train_step in one_step)."""
    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.plan.topology import RankLayout
    from hpc_hsdp.task.parallelism.dist import RunContext
    from hpc_hsdp.task.training.model import build_model, make_optimizer

    training = TrainingSpec.of(
        layers=a.layers,
        width=a.width,
        heads=a.heads,
        seq_len=a.seq,
        batch_size=a.batch,
        vocab_size=a.vocab,
        reshard_after_forward="never" if variant.endswith("-kept") else "always",
    )
    layout = RankLayout.from_env(dict(os.environ), shard_size=2)
    ctx = RunContext(layout=layout, mesh=mesh, device=torch.device("cpu"), realized=[], _active=False)
    adapter = resolve_model(training, data_vocab_size=None)
    model = build_model(ctx, adapter, training)
    optimizer = make_optimizer(model, training.optimizer)
    if variant.endswith("-unfused"):  # the optimizer before issue 14: torch's default (single-tensor on CPU)
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
        optimizer = torch.optim.AdamW(groups, lr=training.optimizer.lr)
    return model, optimizer, adapter


def build(variant, a, mesh):
    opt_kwargs = {"lr": 3e-3, "weight_decay": 0.0}
    if variant.startswith("hpc-hsdp"):
        return build_hpc_hsdp(variant, a, mesh)
    if variant.startswith("fsdp1"):
        from functools import partial

        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        model = Model(a.vocab, a.seq, a.width, a.heads, a.layers)
        init_weights(model)
        model = FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            device_mesh=mesh,
            device_id=torch.device("cpu"),
            use_orig_params=variant != "fsdp1-flat",
            auto_wrap_policy=partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block)),
        )
    else:
        with torch.device("meta"):
            model = Model(a.vocab, a.seq, a.width, a.heads, a.layers)
        flags = set(variant.split("-")[1:])  # e.g. fsdp2-fused-noreshard
        reshard = "noreshard" not in flags
        for i, block in enumerate(model.blocks):
            last_kept = "lastkept" in flags and i == len(model.blocks) - 1
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard and not last_kept)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        model.to_empty(device="cpu")
        init_weights(model)
        if "foreach" in flags:
            opt_kwargs["foreach"] = True
        if "fused" in flags:
            opt_kwargs["fused"] = True
        if "prefetch2" in flags:
            blocks = list(model.blocks)
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 2])
                block.set_modules_to_backward_prefetch(blocks[max(0, i - 1) : i][::-1])
    return model, torch.optim.AdamW(model.parameters(), **opt_kwargs), None


def one_step(model, opt, adapter, tokens):
    t0 = time.perf_counter()
    if adapter is not None:  # hpc-hsdp's train_step: forward, backward, fused loss/norm all-reduce, optimizer
        from hpc_hsdp.plan.topology import ParallelDims
        from hpc_hsdp.task.training.loader import MicroBatch
        from hpc_hsdp.task.training.step import train_step

        batch = MicroBatch(step=0, micro=0, inputs=tokens[:, :-1], targets=tokens[:, 1:], sample_ids=None)
        train_step(
            model, opt, adapter, [batch], lr=3e-3, clip_grad=0.0, dims=ParallelDims(replicate=2, shard=2)
        ).tolist()
        t3 = time.perf_counter()
        return float("nan"), float("nan"), t3 - t0
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    loss = loss.detach()
    dist.all_reduce(loss)
    loss.item()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--variants", default="fsdp1,fsdp2,fsdp2-foreach,fsdp2-fused,fsdp2-noreshard")
    p.add_argument("--out", default=None)
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="ROWS",
        help="then profile 5 steps of each variant (torch.profiler) and print the top ROWS ops",
    )
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    variants = a.variants.split(",")
    built = {v: build(v, a, mesh) for v in variants}
    gen = torch.Generator().manual_seed(rank)
    times = {v: [] for v in variants}
    for r in range(a.rounds + 2):
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen)
        order = variants if r % 2 == 0 else variants[::-1]
        for v in order:
            dist.barrier()
            t = one_step(*built[v], tokens)
            if r >= 2:
                times[v].append(t)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for v in variants:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    dist.barrier()
                    one_step(*built[v], torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen))
            if rank == 0:
                print(f"--- {v}: top ops by self CPU time over 5 steps")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.profile))
    if rank == 0:
        base = statistics.median(t[2] for t in times[variants[0]])
        print(f"{'variant':<18} {'fwd+bwd ms':>10} {'opt ms':>8} {'step ms':>8} {'ratio':>6}")
        rows = {}
        for v in variants:
            fb, op, st = (statistics.median(t[i] for t in times[v]) for i in range(3))
            rows[v] = {"fwd_bwd_s": fb, "opt_s": op, "step_s": st}
            print(f"{v:<18} {fb * 1000:>10.1f} {op * 1000:>8.1f} {st * 1000:>8.1f} {st / base:>6.3f}")
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
