"""One optimizer step of the built-in loop, the held-out evaluation and the per-step seeding."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import cast

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hpc_hsdp.plan.topology import ParallelDims
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.parallelism.tensor_parallel import local_value, loss_context, norm_weights
from hpc_hsdp.task.resilience.preemption import NONE, STOP_CODE_SPAN, TERMINATE, WARNING, split_stop_code
from hpc_hsdp.task.training.loader import MicroBatch, read_rows
from hpc_hsdp.task.training.optimizer import local_shard


def local_grads(model: nn.Module, device: torch.device, dims: ParallelDims) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank's gradient shards and their squared L2 norm, in a few kernels (to sum over the
    ranks; a gradient every rank of a tp group holds whole counts 1/T on each)."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for p in model.parameters():
        if p.grad is not None:
            params.append(p)
            grads.append(local_shard(p.grad))
    if not grads:
        return grads, torch.zeros((), device=device)
    squares = torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]).pow(2)
    if dims.tp > 1:
        squares = squares * torch.tensor(norm_weights(params, dims.tp), device=squares.device)
    return grads, squares.sum()


def clip_grad_norm(model: nn.Module, max_norm: float, dims: ParallelDims) -> torch.Tensor:
    """Collective: the gradient norm over the whole mesh (the replicate, shard and tp axes) and
    the gradients scaled to at most ``max_norm`` (0: only the norm), as the built-in step clips.
    Unlike ``torch.nn.utils.clip_grad_norm_`` it takes gradients on different meshes (a tensor-
    parallel plan that leaves some parameters out)."""
    device = next(model.parameters()).device
    grads, squared = local_grads(model, device, dims)
    dist.all_reduce(squared, op=dist.ReduceOp.SUM)
    norm = (squared / dims.replicate).sqrt()
    if max_norm > 0 and grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    adapter,
    batches: list[MicroBatch],
    *,
    lr: float,
    clip_grad: float,
    dims: ParallelDims,
    stop_code: Callable[[], int] | None = None,
    num_sources: int = 0,
    loss_scope: Callable[[], AbstractContextManager] = nullcontext,
) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; returns a device tensor
    ``[global mean loss, global gradient norm before clipping, agreed stop code]`` (no host
    sync).

    Every micro-batch's gradients are reduce-scattered in the shard group; the all-reduce
    across replicas (``set_requires_all_reduce``) runs only with the last one. Loss, squared
    gradient norm and the stop agreement go through ONE all_reduce over all ranks: each
    rank's local gradient shards cover the model once per replica, so the sum over all ranks
    is R (``dims.replicate``) times the squared norm; ``stop_code()``, this rank's signal code
    (:data:`hpc_hsdp.task.resilience.preemption.WARNING`, ``TERMINATE``), read after the backward,
    is summed as one count per code, so the agreed code is the highest any rank had; the code's
    debugger part (:func:`~hpc_hsdp.task.resilience.preemption.split_stop_code`: ``hpc-hsdp debug``'s
    request, which rank 0 alone sends) is summed apart and comes back in the agreed code.

    With a mixture of ``num_sources`` sources (each batch's ``sources``), the same all_reduce
    carries each source's sum of row losses and its rows, and the result goes on with each
    source's mean loss (nan for a source without rows in the step, or where the adapter's loss
    is not the cross-entropy of its logits: :func:`row_losses`).

    With tensor parallelism (``dims.tp`` T > 1) the T ranks of a tp group train on the same rows:
    their losses are equal, so the mean over all ranks is still the mean over the rows; each
    forward and backward runs under ``loss_scope()`` (the loss on vocabulary shards)."""
    accum = len(batches)
    device = batches[0].inputs.device
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    by_source = torch.zeros(2 * num_sources, device=device, dtype=torch.float32)
    for index, batch in enumerate(batches):
        if accum > 1:
            cast(FSDPModule, model).set_requires_all_reduce(index == accum - 1)  # fully_shard made it one
        with loss_scope():
            rows = (
                row_losses(adapter, model, batch.inputs, batch.targets)
                if num_sources and batch.sources is not None
                else None
            )
            if rows is not None:
                loss = rows.mean()
                where = torch.as_tensor(batch.sources, device=device, dtype=torch.long)
                by_source.index_add_(0, where, local_value(rows.detach()).float())
                by_source.index_add_(0, where + num_sources, torch.ones(where.shape, device=device))
            else:
                loss = adapter.loss(model, batch.inputs, batch.targets)
            (loss / accum).backward()
        loss_sum += local_value(loss.detach()).float()
    grads, squared = local_grads(model, device, dims)
    code = stop_code() if stop_code is not None else NONE
    signal_code, debug_code = split_stop_code(code)
    warned = torch.full((), float(signal_code == WARNING), device=device)  # a fill kernel: no host-to-device copy
    terminated = torch.full((), float(signal_code == TERMINATE), device=device)
    debug = torch.full((), float(debug_code), device=device)  # one rank (0) asks: the sum is its request
    fused = torch.cat([torch.stack([loss_sum, squared, warned, terminated, debug]), by_source])
    dist.all_reduce(fused, op=dist.ReduceOp.SUM)
    mean_loss = fused[0] / (dist.get_world_size() * accum)
    grad_norm = (fused[1] / dims.replicate).sqrt()
    agreed = torch.where(fused[3] > 0, float(TERMINATE), torch.where(fused[2] > 0, float(WARNING), float(NONE)))
    agreed = agreed + STOP_CODE_SPAN * fused[4]
    if clip_grad > 0 and grads:
        torch._foreach_mul_(grads, torch.clamp(clip_grad / (grad_norm + 1e-6), max=1.0))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    head = torch.stack([mean_loss, grad_norm, agreed])
    if not num_sources:
        return head
    sums, rows_seen = fused[5 : 5 + num_sources], fused[5 + num_sources :]
    return torch.cat([head, sums / rows_seen])  # 0/0: nan, a source without rows


def row_losses(adapter, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
    """Each row's mean cross-entropy, from one forward, where the adapter's loss is the mean
    cross-entropy of its logits (the built-in model, a transformers model, a factory's model
    without a ``loss`` of its own): their mean is that loss. None for any other loss."""
    logits_of = getattr(adapter, "logits", None)
    if logits_of is None or callable(getattr(model, "loss", None)):
        return None
    logits = logits_of(model, inputs)
    tokens = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return tokens.view(targets.shape).mean(dim=1)


@torch.no_grad()
def evaluate(
    ctx: RunContext, model: nn.Module, adapter, source, sample_ids: np.ndarray, *, rows_per_rank: int
) -> float:
    """Mean loss per token over ``sample_ids`` of ``source`` (collective). The ranks split the
    samples in chunks of ``rows_per_rank``; a rank with no rows left in a chunk still runs
    the forward (FSDP gathers are collectives) with weight 0. The mean is over the same
    samples on every mesh shape."""
    was_training = model.training
    model.eval()
    world, rank = ctx.data_world_size, ctx.data_rank  # a tp group reads the same rows
    per_chunk = world * rows_per_rank
    totals = torch.zeros(2, device=ctx.device, dtype=torch.float64)
    for start in range(0, len(sample_ids), per_chunk):
        mine = sample_ids[start + rank * rows_per_rank : start + (rank + 1) * rows_per_rank]
        weight = len(mine)
        inputs, targets = read_rows(source, mine if weight else sample_ids[:1])
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
        with loss_context(ctx, adapter):
            loss = local_value(adapter.loss(model, inputs, targets)).double()
        tokens = weight * targets.shape[1]
        totals += torch.stack([loss * tokens, torch.tensor(float(tokens), device=ctx.device, dtype=torch.float64)])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    totals /= ctx.dims.tp  # each tp group's T ranks counted the same rows
    model.train(was_training)
    total, tokens = totals.tolist()
    return total / tokens


def seed_step(seed: int, step: int, rank: int) -> None:
    """Seed torch's RNGs (CPU and CUDA) from ``(seed, step, rank)`` before a step, so that
    dropout draws the same masks in a resumed run as in an uninterrupted one."""
    torch.manual_seed((seed * 1_000_003 + step * 65_537 + rank) % (2**63))
