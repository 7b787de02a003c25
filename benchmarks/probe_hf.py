"""Where does `hpc-hsdp run --model hf:` spend more than the hand-written FSDP2 script
(benchmarks/handwritten_hf_fsdp2.py)? One emulated job step (4 processes, 2 x 2, shard 2,
gloo, one thread each) builds bench_hf.py's Llama-style model once per variant and runs
the variants' steps interleaved, one step of each per round (order reversed every round),
so that the machine's load hits every variant alike. Rank 0 prints, per variant, the
median wall and CPU milliseconds of the step, and the ratios to the first variant.

    python benchmarks/probe_hf.py [--rounds N] [--variants hand,hpc,...] [--profile ROWS]
        [--layers 4 --width 1024 --vocab 4096]

Variants (build + step):
  hand            the hand-written script: meta build, fully_shard each _no_split_modules
                  block then the root, to_empty, model.apply(_init_weights), fused AdamW,
                  forward, cross-entropy, backward, step, loss all-reduce
  hpc             hpc-hsdp's resolve_model + build_model + make_optimizer + train_step
  hpc-model       hpc-hsdp's build_model + make_optimizer, the hand-written step
  hand-model      the hand-written build + fused AdamW, hpc-hsdp's train_step
  hpc-nonorm      hpc-hsdp's train_step without the global gradient norm (how much the norm costs)

Host memory: ``--mallopt`` sets glibc malloc parameters in every process first, and
glibc's own variables pass through the environment (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1
python benchmarks/probe_hf.py ...``); each variant's system CPU and page faults per step and
rank 0's peak resident memory say what they change (RESULTS.md section 8).

Also the build's phases, CPU seconds on rank 0 (the first variant built pays the imports:
``--rounds 0 --variants hpc,hand`` and ``hand,hpc`` compare the builds alone).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIG = {
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}  # bench_hf.CONFIG


def usage():
    """(CPU ms, system CPU ms, minor page faults) of this process so far."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return (ru.ru_utime + ru.ru_stime) * 1000, ru.ru_stime * 1000, ru.ru_minflt


def timed(fn, phases: dict, name: str):
    def call(*args, **kwargs):
        t = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.process_time() - t

    return call


def build_hand(config_dir: Path, mesh, phases: dict):
    import torch
    from torch.distributed.fsdp import fully_shard

    t = time.process_time()
    from transformers import AutoConfig, AutoModelForCausalLM

    phases["import"] = time.process_time() - t
    t = time.process_time()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config_dir)), dtype=torch.float32)
    phases["meta"] = time.process_time() - t
    t = time.process_time()
    blocks = tuple(model._no_split_modules)
    for module in reversed(list(model.modules())):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    phases["wrap"] = time.process_time() - t
    t = time.process_time()
    model.to_empty(device="cpu")
    phases["to_empty"] = time.process_time() - t
    t = time.process_time()
    torch.manual_seed(0)
    with torch.no_grad():
        model.apply(model._init_weights)
    phases["init"] = time.process_time() - t
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, fused=True)


def build_hpc(config_dir: Path, mesh, a, phases: dict):
    import torch

    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.plan.topology import RankLayout
    from hpc_hsdp.task.parallelism.dist import RunContext
    from hpc_hsdp.task.training.model import build_model, make_optimizer

    training = TrainingSpec.of(
        model=f"hf:{config_dir}",
        seq_len=a.seq,
        batch_size=a.batch,
        lr=3e-3,
        precision="fp32",
        reshard_after_forward="always",
    )  # as the hand-written script
    layout = RankLayout.from_env(dict(os.environ), shard_size=2)
    ctx = RunContext(layout=layout, mesh=mesh, device=torch.device("cpu"), realized=[], _active=False)
    t = time.process_time()
    adapter = resolve_model(training, data_vocab_size=None)
    phases["adapter"] = time.process_time() - t
    for method in ("build_meta", "init_weights"):  # build_model's parts, timed on the adapter
        setattr(adapter, method, timed(getattr(adapter, method), phases, method))
    t = time.process_time()
    model = build_model(ctx, adapter, training, precision="fp32")
    phases["build_model"] = time.process_time() - t
    model.train()
    return model, make_optimizer(model, training.optimizer), adapter


def hand_step(model, opt, tokens, loss_of=None):
    import torch.distributed as dist
    import torch.nn.functional as F

    if loss_of is None:
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    else:
        loss = loss_of(model, tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss = loss.detach()
    dist.all_reduce(loss)
    return loss.item()


def hpc_step(model, opt, adapter, tokens, *, norm=True):
    import torch

    from hpc_hsdp.plan.topology import ParallelDims
    from hpc_hsdp.task.training.loader import MicroBatch
    from hpc_hsdp.task.training.step import train_step

    batch = MicroBatch(
        step=0, micro=0, inputs=tokens[:, :-1].contiguous(), targets=tokens[:, 1:].contiguous(), sample_ids=None
    )
    if norm:
        return train_step(
            model, opt, adapter, [batch], lr=3e-3, clip_grad=0.0, dims=ParallelDims(replicate=2, shard=2)
        ).tolist()
    saved = torch._foreach_norm
    torch._foreach_norm = lambda grads, p: [torch.zeros(())]  # the norm's cost, measured away
    try:
        return train_step(
            model, opt, adapter, [batch], lr=3e-3, clip_grad=0.0, dims=ParallelDims(replicate=2, shard=2)
        ).tolist()
    finally:
        torch._foreach_norm = saved


def worker(a) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if a.mallopt:  # e.g. -3=1073741824,-1=2147483647 (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD): RESULTS.md section 8
        import ctypes

        for item in a.mallopt.split(","):
            key, value = item.split("=")
            assert ctypes.CDLL("libc.so.6").mallopt(int(key), int(value)), item
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    config_dir = Path(a.config_dir)
    variants = a.variants.split(",")
    built, phases = {}, {}
    for v in variants:
        phases[v] = {}
        dist.barrier()
        t = time.process_time()
        if v in ("hand", "hand-model"):
            model, opt = build_hand(config_dir, mesh, phases[v])
            adapter = None
            if v == "hand-model":
                from hpc_hsdp.job.spec import TrainingSpec
                from hpc_hsdp.models import resolve_model

                adapter = resolve_model(TrainingSpec.of(model=f"hf:{config_dir}"), data_vocab_size=None)
        else:
            model, opt, adapter = build_hpc(config_dir, mesh, a, phases[v])
        phases[v]["total"] = time.process_time() - t
        built[v] = (model, opt, adapter)

    def one(v, tokens):
        model, opt, adapter = built[v]
        if v == "hand":
            return hand_step(model, opt, tokens)
        if v == "hpc-model":
            return hand_step(model, opt, tokens, loss_of=None)
        return hpc_step(model, opt, adapter, tokens, norm=v != "hpc-nonorm")

    gen = torch.Generator().manual_seed(rank)
    times = {v: [] for v in variants}
    for r in range(a.rounds + 2):
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen)
        for v in variants if r % 2 == 0 else variants[::-1]:
            dist.barrier()
            t0, u0 = time.perf_counter(), usage()
            one(v, tokens)
            if r >= 2:
                u1 = usage()
                times[v].append(((time.perf_counter() - t0) * 1000, *(b - a for a, b in zip(u0, u1))))
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for v in variants:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
                for _ in range(a.profile_steps):
                    dist.barrier()
                    one(v, torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen))
            if rank == 0:
                print(f"--- {v}: top ops by self CPU time over {a.profile_steps} steps", flush=True)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.profile), flush=True)
                if a.trace:
                    prof.export_chrome_trace(f"{a.trace}-{v}.json")
    if rank == 0:
        import resource

        print(f"rank 0 peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB", flush=True)
    if rank == 0 and not a.rounds:
        for v in variants:
            print(f"{v:<14} build phases s: " + " ".join(f"{k} {x:.2f}" for k, x in phases[v].items()), flush=True)
    elif rank == 0:
        base_wall = statistics.median(t[0] for t in times[variants[0]])
        base_cpu = statistics.median(t[1] for t in times[variants[0]])
        print(
            f"{'variant':<14}{'wall ms':>9}{'ratio':>7}{'CPU ms':>9}{'ratio':>7}{'sys ms':>8}{'faults':>8}   build phases s"
        )
        rows = {}
        for v in variants:
            wall = statistics.median(t[0] for t in times[v])
            cpu, sys_ms, faults = (statistics.median(t[i] for t in times[v]) for i in (1, 2, 3))
            rows[v] = {
                "wall_ms": wall,
                "cpu_ms": cpu,
                "sys_ms": sys_ms,
                "minor_faults": faults,
                "phases": phases[v],
                "steps": times[v],
            }
            ph = " ".join(f"{k} {x:.2f}" for k, x in phases[v].items())
            print(
                f"{v:<14}{wall:>9.1f}{wall / base_wall:>7.3f}{cpu:>9.1f}{cpu / base_cpu:>7.3f}{sys_ms:>8.0f}{faults:>8.0f}"
                f"   {ph}",
                flush=True,
            )
        if a.out:
            Path(a.out).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--variants", default="hand,hpc")
    p.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    p.add_argument("--width", type=int, default=CONFIG["hidden_size"])
    p.add_argument("--vocab", type=int, default=CONFIG["vocab_size"])
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--profile", type=int, default=0, metavar="ROWS")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--trace", default=None, help="with --profile: chrome traces to TRACE-<variant>.json")
    p.add_argument("--out", default=None)
    p.add_argument("--mallopt", default="", help="PARAM=VALUE,... glibc mallopt calls first (numeric M_* codes)")
    p.add_argument("--config-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if "RANK" in os.environ:
        worker(a)
        return 0
    from _launch import job_step

    with tempfile.TemporaryDirectory() as tmp:
        config_dir = Path(tmp) / "model"
        config_dir.mkdir()
        width = a.width
        config = dict(
            CONFIG,
            vocab_size=a.vocab,
            hidden_size=width,
            num_hidden_layers=a.layers,
            intermediate_size=CONFIG["intermediate_size"] * width // CONFIG["hidden_size"],
        )
        (config_dir / "config.json").write_text(json.dumps(config))
        argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--config-dir", str(config_dir)]
        job_step(argv, tasks_per_node=(2, 2), log_dir=Path(tmp) / "logs", torch_env=True, timeout_s=3000)
        print((Path(tmp) / "logs" / "task-0.log").read_text(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
