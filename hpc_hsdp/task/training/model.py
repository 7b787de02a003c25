"""The model of a run: built from its adapter on the meta device, sharded, materialized and
initialised; its optimizer; ``model.json``, the record ``hpc-hsdp export`` rebuilds it from."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.job.training_sections import OptimizerSection
from hpc_hsdp.rundir.training.model_record import MODEL_RECORD, write_model_record  # noqa: F401 - loop re-exports it
from hpc_hsdp.task.observation.log import say
from hpc_hsdp.task.parallelism.compile import compile_units
from hpc_hsdp.task.parallelism.device import compute_precision, resolve_precision
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.parallelism.hsdp import wrap_hsdp
from hpc_hsdp.task.parallelism.reshard import choose_reshard
from hpc_hsdp.task.parallelism.tensor_parallel import apply_tensor_parallel, wait_before_units
from hpc_hsdp.task.training.optimizer import LocalShardAdamW


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16: bf16 parameters (all-gathered in bf16) and compute, fp32 gradient reduction."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def checkpoint_activations(model: nn.Module, units: tuple[type, ...]) -> int:
    """Recompute each shard unit's activations in backward (``torch.utils.checkpoint``,
    non-reentrant) without renaming a parameter; returns how many units."""
    count = 0
    for module in model.modules():
        if units and isinstance(module, units):
            module.forward = functools.partial(torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False)
            count += 1
    return count


def units_to_wrap(units: tuple[type, ...], world_size: int) -> tuple[type, ...] | None:
    """The shard units ``fully_shard`` wraps before the root: none in a job of one rank."""
    return units if world_size > 1 else None


def build_model(
    ctx: RunContext, adapter, training: TrainingSpec, *, precision: str | None = None, verbose: bool = False
) -> nn.Module:
    """The adapter's model on ``ctx.mesh``: meta build, Float8 Linears (``--precision fp8``), tensor
    parallelism (``--tp``: the adapter's plan on the tp axis), activation checkpointing (if asked),
    ``torch.compile`` of each shard unit (``--compile``), ``fully_shard`` per shard unit then the
    root (``--reshard-after-forward``, resolved by :func:`~hpc_hsdp.task.parallelism.reshard.choose_reshard`;
    rank 0 says what it chose when ``verbose``; a job of one rank has nothing to gather or reduce,
    so its root is its only unit and FSDP2's hooks run once a step, not once per block), ``to_empty``, pretrained weights or a seed-determined initialisation (the
    same on every mesh shape)."""
    precision = precision or resolve_precision(training.compute.precision, ctx.device)
    model = adapter.build_meta()
    units = tuple(adapter.shard_units(model))
    fp8 = precision == "fp8"
    if fp8:  # on meta, before tensor parallelism (its float8 styles), compile and fully_shard
        from hpc_hsdp.task.parallelism.float8 import convert_linears  # noqa: PLC0415 - torchao, only for fp8

        choices = convert_linears(model)
        if verbose and ctx.is_rank0:
            converted = sum(c.convert for c in choices)
            say(f"--precision fp8: {converted} of {len(choices)} Linear layers in Float8 (the rest in bf16)")
        precision = compute_precision(precision)
    split = apply_tensor_parallel(model, adapter, ctx, float8=fp8)  # on meta, before compile and fully_shard
    if split and verbose and ctx.is_rank0:
        say(f"--tp {ctx.dims.tp}: {split} module(s) split over each node's tp groups (the plan of {adapter.name})")
    if training.compute.activation_checkpointing:
        checkpoint_activations(model, units)
    if training.compute.compile:  # before fully_shard: its hooks stay outside the graphs
        if split:
            wait_before_units(model, units)
        compiled = compile_units(model, units)
        if verbose and ctx.is_rank0:
            say(f"--compile: torch.compile of {compiled} shard unit(s) ({', '.join(u.__name__ for u in units)})")
    choice = choose_reshard(ctx, model, units, setting=training.compute.reshard_after_forward, precision=precision)
    fsdp_units = units_to_wrap(units, ctx.data_world_size)
    if verbose and ctx.is_rank0:
        say(choice.reason if fsdp_units else "one rank: the whole model is one FSDP unit (nothing to gather or reduce)")
    wrap_hsdp(
        model,
        ctx.data_mesh,
        block=fsdp_units,
        mp_policy=mixed_precision_policy(precision),
        reshard_after_forward=choice.reshard,
    )
    model.to_empty(device=ctx.device)
    if adapter.has_pretrained_weights:
        adapter.load_pretrained(model)
    else:
        adapter.init_weights(model, seed=training.optimizer.seed)
    return model


def make_optimizer(model: nn.Module, optimizer: OptimizerSection) -> torch.optim.Optimizer:
    """AdamW over the local shards (:class:`~hpc_hsdp.task.training.optimizer.LocalShardAdamW`);
    the learning rate is set every step from the schedule. Weight decay applies to matrices
    and embeddings only (not to biases and norms).

    On CPU the fused kernel (one op per parameter group); on CUDA the multi-tensor one, the
    kernel measured on the H200 (the fused one, then over DTensors, made the loop step 1.31x
    slower: RESULTS.md, GPU); ``benchmarks/gpu_profile_loop.py`` measures both on local shards."""
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": optimizer.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    device = params[0].device if params else torch.device("cpu")
    on_cpu = device.type == "cpu"
    return LocalShardAdamW(
        [g for g in groups if g["params"]],
        lr=optimizer.lr,
        fused=True if on_cpu else None,
        foreach=None if on_cpu else True,
    )


def record_model(ctx: RunContext, adapter, training: TrainingSpec) -> None:
    """``<run_dir>/model.json`` (rank 0): which model this run trains (``adapter.describe()``:
    for ``hf:`` models the whole config) and the data it reads; ``hpc-hsdp export`` rebuilds
    the model from it without the job's nodes."""
    if ctx.run_dir is None or not ctx.is_rank0:
        return
    describe = getattr(adapter, "describe", None)
    record = {
        "model": adapter.name,
        "vocab_size": adapter.vocab_size,
        "training": training.options(),
        "adapter": describe() if callable(describe) else {"kind": adapter.name},
    }
    write_model_record(ctx.run_dir, record)
