"""Wrap a model for HSDP on the 2-D ``("replicate", "shard")`` mesh.

``wrap_hsdp`` uses FSDP2 (``fully_shard``): each block, then the root; parameters become
DTensors placed ``(Replicate(), Shard(0))`` (with one replica, ``(Shard(0),)`` on the shard
axis alone: plain FSDP, without an all-reduce of one rank per unit and step).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

BlockSpec = type | tuple[type, ...] | Callable[[nn.Module], bool]


def _matcher(block: BlockSpec | None) -> Callable[[nn.Module], bool]:
    if block is None:
        return lambda module: False
    if isinstance(block, type) or (isinstance(block, tuple) and all(isinstance(b, type) for b in block)):
        return lambda module: isinstance(module, block)
    if callable(block):
        return block
    raise TypeError(f"block={block!r}: give a module class, a tuple of classes or a predicate module -> bool")


def _check_mesh(mesh: DeviceMesh) -> None:
    if mesh.ndim != 2:
        raise ValueError(f"HSDP needs a 2-D (replicate, shard) mesh; got {mesh.ndim}-D mesh {mesh}")


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh ``fully_shard`` gets: the 2-D one, or with one replica its shard axis (FSDP2
    all-reduces across the replicate axis even when it holds one rank)."""
    if mesh.size(0) == 1 and mesh.mesh_dim_names is not None:
        return mesh[mesh.mesh_dim_names[1]]
    return mesh


def wrap_hsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    block: BlockSpec | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
) -> nn.Module:
    """``fully_shard`` every submodule matching ``block`` (innermost first), then the root.

    ``block`` is a module class (e.g. ``TransformerBlock``), a tuple of classes or a
    predicate. Works on a meta-device model (materialize afterwards with ``to_empty``).
    Returns ``model``, now an FSDPModule.

    ``reshard_after_forward``: None (default) or True reshards each block after its forward
    and keeps the root's parameters (backward needs them first: no re-gather of the root),
    as FSDP2's own default does; False keeps every unit's parameters (ZeRO-2-like).
    ``fully_shard`` always gets a bool: torch before 2.8 refuses None (ValueError at wrap);
    2.8+ reads None for the root as False, which is what the root gets here.
    """
    _check_mesh(mesh)
    mesh = fsdp_mesh(mesh)
    matches = _matcher(block)
    policy = mp_policy or MixedPrecisionPolicy()
    # model.modules() lists parents before children: reversed, nested blocks come first.
    blocks = [m for m in reversed(list(model.modules())) if m is not model and matches(m)]
    block_reshard = True if reshard_after_forward is None else bool(reshard_after_forward)
    root_reshard = False
    for module in blocks:
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=block_reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=root_reshard)
    return model
