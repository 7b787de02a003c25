"""The built-in payload: a small transformer trained with HSDP on synthetic tokens.

Recipe: build on the meta device, ``fully_shard`` each block then the root, materialize
(``to_empty`` + seed-determined values), resume from the newest complete checkpoint,
train with AdamW, log one JSON line per step (rank 0), checkpoint every K steps and at
the end.

``<run_dir>/metrics.jsonl``, one record per step: ``step``, ``loss`` (mean over all
ranks), ``tokens_per_s`` (global tokens / step wall time on rank 0), ``step_time_s``,
``peak_mem_bytes`` with ``peak_mem_kind``: ``cuda_max_allocated`` on GPU, on CPU
``ru_maxrss`` (rank 0's resident-set high-water mark, which includes the Python
interpreter and torch; glibc keeps freed memory, so it only grows), ``world_size``,
``shard_size``, ``num_replicas``, ``wall_time`` (Unix time) and ``elapsed_s``; with
``--comm-stats``, ``comm``: the step's collectives of rank 0 per mesh axis (see
``runtime/comm_stats.py``).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from hpc_hsdp.runtime import checkpoint, faults
from hpc_hsdp.runtime.data import rank_batch
from hpc_hsdp.runtime.dist import RunContext
from hpc_hsdp.runtime.files import append_jsonl, truncate_metrics
from hpc_hsdp.runtime.hsdp import wrap_hsdp
from hpc_hsdp.runtime.preemption import restart_count
from hpc_hsdp.runtime.model import ModelConfig, Transformer, TransformerBlock, build_model, init_parameters, loss_fn
from hpc_hsdp.spec import TrainingSpec

OnStep = Callable[[int, dict], None]


@dataclass
class TrainResult:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    start_step: int
    """Step of the checkpoint the run resumed from (0: fresh start)."""
    last_step: int
    """Last step completed (== start_step when nothing was left to do)."""
    losses: dict[int, float] = field(default_factory=dict)
    """Global mean loss of each step this run did."""
    stopped: bool = False
    """True when ``stop_requested()`` or a signal (``ctx.preemption``) ended the run before ``steps``."""
    stop_reason: str | None = None
    """``"USR2"`` (the warning signal), ``"TERM"``, ``"requested"`` (``stop_requested()``) or None."""

    def summary(self, ctx: RunContext) -> dict:
        last = self.losses.get(self.last_step)
        return {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "shard_size": ctx.plan.shard_size,
            "start_step": self.start_step,
            "steps": self.last_step,
            "final_loss": last,
            "stopped": self.stopped,
            "stop_reason": self.stop_reason,
        }


def build_hsdp_model(
    ctx: RunContext, training: TrainingSpec, *, mp_policy: MixedPrecisionPolicy | None = None
) -> Transformer:
    """The payload's model on ``ctx.mesh``: meta build, fully_shard blocks then root, materialize."""
    model = build_model(ModelConfig.from_training(training), device="meta")
    wrap_hsdp(model, ctx.mesh, block=TransformerBlock, mp_policy=mp_policy)
    model.to_empty(device=ctx.device)
    init_parameters(model, seed=training.seed)
    return model


def make_optimizer(model: torch.nn.Module, training: TrainingSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=training.lr, weight_decay=0.0)


def _peak_memory(device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"


def train(
    ctx: RunContext,
    training: TrainingSpec | None = None,
    *,
    stop_requested: Callable[[], bool] | None = None,
    on_step: OnStep | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    verbose: bool = True,
) -> TrainResult:
    """Train the built-in model to ``training.steps`` (resuming from ``ctx.run_dir``'s newest
    complete checkpoint). At every step boundary the ranks agree on the task signals
    (``ctx.preemption.should_stop``: one all_reduce) and ``stop_requested()`` is asked (it
    must answer the same on every rank); on a stop every rank saves a checkpoint. ``on_step(step, metrics)`` runs on every rank after
    each step (metrics: the step's record; loss is the global mean)."""
    if training is None:
        training = getattr(ctx.spec, "training", None) or TrainingSpec()
    run_dir = ctx.run_dir
    model = build_hsdp_model(ctx, training, mp_policy=mp_policy)
    optimizer = make_optimizer(model, training)

    start_step = 0
    if run_dir is not None:
        found = checkpoint.latest_checkpoint(run_dir)
        if found is not None:
            state = checkpoint.load(found[1], model, optimizer)
            start_step = int(state["step"])
            if ctx.is_rank0 and verbose:
                restart = getattr(ctx.preemption, "restart_count", None)
                restart = restart if restart is not None else restart_count(os.environ)
                print(f"[hpc-hsdp] resumed from step {start_step} (restart {restart}): {found[1]}, saved on mesh "
                      f"{state.get('mesh_shape')}, now {list(ctx.plan.mesh_shape)}", flush=True)  # fmt: skip
    metrics_path = run_dir / "metrics.jsonl" if run_dir is not None else None
    if metrics_path is not None and ctx.is_rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_metrics(metrics_path, keep_through_step=start_step)

    result = TrainResult(model=model, optimizer=optimizer, start_step=start_step, last_step=start_step)
    world, rank = ctx.world_size, ctx.rank
    tokens_per_step = world * training.batch_size * training.seq_len
    saved_step = start_step if start_step else None
    began = time.time()
    loss_sum = torch.zeros((), device=ctx.device)

    saver = None
    if run_dir is not None and training.checkpoint_every:
        saver = checkpoint.AsyncSaver(run_dir, keep=training.keep_checkpoints,
                                      timeout_s=getattr(getattr(ctx, "spec", None), "timeout_s", 300))  # fmt: skip

    def save(step: int, *, periodic: bool = False) -> None:
        nonlocal saved_step
        # the data position is the step: batches depend on (seed, step, rank, world size, batch size)
        train_state = {"seed": training.seed, "world_size": world, "batch_size": training.batch_size,
                       "mesh_shape": list(ctx.plan.mesh_shape)}  # fmt: skip
        if periodic and saver is not None:  # written in the background while training goes on
            saver.save(model, optimizer, step=step, train_state=train_state)
            path = f"{checkpoint.checkpoint_root(run_dir) / checkpoint.step_dir_name(step)} (writing in the background)"
        else:  # on a stop signal and at the end: written before the task goes on
            if saver is not None:
                saver.wait()
            path = checkpoint.save(run_dir, model, optimizer, step=step, train_state=train_state,
                                   keep=training.keep_checkpoints)  # fmt: skip
        saved_step = step
        if ctx.is_rank0 and verbose:
            print(f"[hpc-hsdp] checkpoint {path}", flush=True)

    model.train()
    preemption = ctx.preemption
    for step in range(start_step + 1, training.steps + 1):
        # every rank calls the agreement every step (a collective), before anything else
        if preemption is not None and preemption.should_stop(step - 1, device=ctx.device):
            result.stopped, result.stop_reason = True, preemption.stop_reason
            if ctx.is_rank0 and verbose:
                got = ", ".join(f"{name} {time.time() - at:.2f} s ago" for name, at in preemption.received.items())
                print(f"[hpc-hsdp] {result.stop_reason}: every rank stops after step {step - 1} and saves "
                      f"(on rank 0: {got or 'none'})", flush=True)  # fmt: skip
            break
        if stop_requested is not None and stop_requested():
            result.stopped, result.stop_reason = True, "requested"
            break
        faults.at_step(rank, step)  # test hooks (HPC_HSDP_FAULT_*); no-ops otherwise
        t0 = time.perf_counter()
        if ctx.comm_stats is not None:
            ctx.comm_stats.reset()
        inputs, targets = rank_batch(seed=training.seed, step=step, rank=rank, world_size=world,
                                     batch_size=training.batch_size, seq_len=training.seq_len,
                                     vocab_size=training.vocab_size)  # fmt: skip
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum.copy_(loss.detach())
        dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        global_loss = loss_sum.item() / world
        step_time = time.perf_counter() - t0
        peak, peak_kind = _peak_memory(ctx.device)
        record = {
            "step": step,
            "loss": global_loss,
            "tokens_per_s": tokens_per_step / step_time,
            "step_time_s": step_time,
            "peak_mem_bytes": peak,
            "peak_mem_kind": peak_kind,
            "world_size": world,
            "shard_size": ctx.plan.shard_size,
            "num_replicas": ctx.plan.num_replicas,
            "wall_time": time.time(),
            "elapsed_s": time.time() - began,
        }
        if ctx.comm_stats is not None:
            record["comm"] = ctx.comm_stats.take()
        result.losses[step] = global_loss
        result.last_step = step
        if ctx.is_rank0:
            if metrics_path is not None:
                append_jsonl(metrics_path, record)
            if verbose:
                print(f"step {step:>5}/{training.steps}  loss {global_loss:.4f}  "
                      f"{record['tokens_per_s']:,.0f} tok/s  {step_time * 1000:.0f} ms  "
                      f"peak {peak / 2**20:.0f} MiB ({peak_kind})", flush=True)  # fmt: skip
        if on_step is not None:
            on_step(step, record)
        every = training.checkpoint_every
        if run_dir is not None and every and step % every == 0 and step != training.steps:
            save(step, periodic=True)

    if run_dir is not None and result.last_step > 0 and saved_step != result.last_step:
        save(result.last_step)
    if saver is not None:
        saver.close()
    sys.stdout.flush()
    return result


def payload(ctx: RunContext) -> dict:
    """The built-in payload of ``hpc-hsdp run`` (no ``--entry``): train, return the summary."""
    return train(ctx).summary(ctx)
