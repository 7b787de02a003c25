"""Tensor parallelism inside a node: the model's plan applied on the ``"tp"`` mesh axis, before
FSDP2 shards the result over ``("replicate", "shard")``.

A model gives its plan through its adapter (``adapter.tp_plan(model, tp_size)``: module name ->
``ParallelStyle``); one without a plan is refused with ``--tp`` > 1. The loss is computed on
vocabulary shards (``loss_parallel``) where the adapter says its plan leaves the logits sharded.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from hpc_hsdp.errors import SpecError
from hpc_hsdp.task.parallelism.dist import RunContext


def apply_tensor_parallel(model: nn.Module, adapter, ctx: RunContext, *, float8: bool = False) -> int:
    """Split ``model`` (on the meta device) over ``ctx``'s tp axis by ``adapter``'s plan (its
    Float8 Linears by torchao's float8 styles with ``float8``); returns how many modules the plan
    names (0 without tensor parallelism)."""
    if ctx.dims.tp == 1:
        return 0
    plan_of = getattr(adapter, "tp_plan", None)
    plan = plan_of(model, ctx.dims.tp) if callable(plan_of) else None
    if not plan:
        raise SpecError(
            f"--tp {ctx.dims.tp}: --model {adapter.name!r} has no tensor-parallel plan; give it one "
            f"(docs/own-model.md#tensor-parallel) or train with --tp 1"
        )
    if float8:
        from hpc_hsdp.task.parallelism.float8 import float8_tp_plan  # noqa: PLC0415 - torchao, only for fp8

        plan = float8_tp_plan(model, plan)
    parallelize_module(model, ctx.tp_mesh, plan)
    return len(plan)


def wait_before_units(model: nn.Module, units: tuple[type, ...]) -> int:
    """For ``--compile`` with tensor parallelism: a forward hook on each module outside the shard
    units that waits for its output's collective (the embeddings' reduce-scatter). A compiled unit
    handed such a pending output (torch's ``AsyncCollectiveTensor``) fails in backward with
    "'Tensor' object has no attribute '_local_tensor'"; returns how many modules got the hook."""
    inside = {id(m) for unit in model.modules() if units and isinstance(unit, units) for m in unit.modules()}
    hooked = 0
    for module in model.modules():
        if id(module) not in inside and module is not model and not list(module.children()):
            module.register_forward_hook(_wait_for_output)
            hooked += 1
    return hooked


def _wait_for_output(module, args, output):
    # clone(), not wait(): wait() hands back the inner tensor, cut off from autograd (the module's
    # parameters would get no gradient); an op on the wrapper waits and stays in the graph
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def loss_context(ctx: RunContext, adapter) -> contextlib.AbstractContextManager:
    """Where the loss and its backward run: on vocabulary shards under tensor parallelism when the
    adapter's plan leaves the logits sharded, else nothing."""
    if ctx.dims.tp > 1 and getattr(adapter, "loss_parallel", False):
        return loss_parallel()
    return contextlib.nullcontext()


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor's value (a loss under ``loss_parallel``) as a plain tensor."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def norm_weights(params: list[torch.Tensor], tp_size: int) -> list[float]:
    """Per parameter, the share of its local squared gradient norm that counts once: a parameter
    that every rank of a tp group holds whole (a norm's weight, or one the plan leaves out, which
    FSDP2 shards over the data axes only) counts 1/T on each, so that the sum over the ranks counts
    it once; one split over the tp axis counts whole."""
    if tp_size == 1:
        return [1.0] * len(params)
    return [1.0 if split_over_tp(param) else 1.0 / tp_size for param in params]


def split_over_tp(param: torch.Tensor) -> bool:
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return "tp" in names and not isinstance(param.placements[names.index("tp")], Replicate)
