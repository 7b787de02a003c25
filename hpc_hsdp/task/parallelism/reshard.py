"""``--reshard-after-forward auto|always|never``: whether each block frees its gathered
parameters after its forward (and gathers them again in backward) or keeps them to backward.

``auto`` keeps them when the whole model gathered fits beside the sharded state in the
smallest device memory of the job, by the rule of ``plan --recommend``
(:func:`hpc_hsdp.plan.estimates.gathered_fits`): no backward re-gather, the faster step
(benchmarks/RESULTS.md section 14). Every rank must decide alike (a block that re-gathers
on one rank and not on its shard peers would wait forever), so the memory is agreed on
with one all-reduce (MIN) before anything is wrapped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hpc_hsdp.plan.estimates import PRECISION_BYTES, estimate, gathered_fits
from hpc_hsdp.plan.units import format_bytes


@dataclass(frozen=True, kw_only=True)
class ReshardChoice:
    reshard: bool
    """True: free each block's gathered parameters after its forward (FSDP2's default)."""
    reason: str
    """One line for the job log: the setting, and for ``auto`` the sizes it was decided on."""


def parameter_counts(model: nn.Module, units: tuple[type, ...]) -> tuple[int, int]:
    """(all parameters, those outside every shard unit: the root's), counted on the meta model."""
    in_units: set[int] = set()
    for module in model.modules():
        if module is not model and units and isinstance(module, units):
            in_units.update(id(p) for p in module.parameters())
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if id(p) not in in_units)


def _cgroup_memory_limit() -> int | None:
    """This process's cgroup v2 memory limit (SLURM's ``--mem`` lands there), None when unlimited or unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("0::"):
            try:
                text = (Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.max").read_text().strip()
            except OSError:
                return None
            return int(text) if text.isdigit() else None
    return None


def device_memory_bytes(device: torch.device, *, local_world_size: int) -> int:
    """The memory one rank may use: the GPU's, or on CPU the host's (the smaller of RAM and
    the cgroup limit) divided among the node's ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_memory_limit()
    return min(host, limit or host) // max(1, local_world_size)


def choose_reshard(ctx, model: nn.Module, units: tuple[type, ...], *, setting: str, precision: str) -> ReshardChoice:
    """The block setting for ``fully_shard`` from ``--reshard-after-forward`` (collective
    for ``auto`` with more than one rank in a shard group)."""
    if setting == "always":
        return ReshardChoice(reshard=True, reason="reshard after forward: always (--reshard-after-forward always)")
    if setting == "never":
        return ReshardChoice(
            reshard=False, reason="parameters kept gathered from forward to backward (--reshard-after-forward never)"
        )
    if ctx.plan.shard_size == 1:
        return ReshardChoice(reshard=True, reason="reshard after forward: nothing to gather (shard size 1)")
    params, root = parameter_counts(model, units)
    memory = torch.tensor(
        [device_memory_bytes(ctx.device, local_world_size=ctx.layout.local_world_size)],
        dtype=torch.int64,
        device=ctx.device,
    )
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(memory, op=dist.ReduceOp.MIN)
    memory_bytes = int(memory.item())
    state = estimate(ctx.plan, model_params=params, root_params=root, precision=precision).total_bytes
    gathered = PRECISION_BYTES[precision].gather * params
    sizes = (
        f"the whole model gathered ({format_bytes(gathered)}) beside the sharded state "
        f"({format_bytes(state)}) in {format_bytes(memory_bytes)} per rank"
    )
    if gathered_fits(state_bytes=state, gathered_bytes=gathered, memory_bytes=memory_bytes):
        return ReshardChoice(
            reshard=False,
            reason=f"parameters kept gathered from forward to backward (--reshard-after-forward auto: {sizes} fits)",
        )
    return ReshardChoice(
        reshard=True, reason=f"reshard after forward (--reshard-after-forward auto: {sizes} does not fit)"
    )
