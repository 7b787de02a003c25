"""AdamW that steps on this rank's local shards.

FSDP2's parameters, gradients and AdamW's moments are DTensors; every op on a DTensor pays
its dispatch (sharding propagation, wrapping of the result) on the host, about ten ops per
parameter per step with torch's multi-tensor kernel. AdamW is elementwise, so the update of
each local shard is the update of its part of the global tensor whatever the placements:
:class:`LocalShardAdamW` runs torch's own AdamW kernels on the local tensors. Its state
stays DTensors (created by torch's own ``_init_group``), so its ``state_dict``, DCP
checkpoints and resharded resumes are those of ``torch.optim.AdamW``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

__all__ = ["LocalShardAdamW", "local_shard"]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a plain tensor as it is): the very tensor the DTensor holds,
    without DTensor's dispatch or autograd, so writes to it are writes to the DTensor. For work
    outside autograd only (the optimizer's update, the gradients' norm and clipping, a replica
    group's state); the one helper of the runtime for it."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [local_shard(t) for t in tensors]


class LocalShardAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` (same arguments, state and results) whose step runs on the
    parameters' local shards: no DTensor dispatch in the update."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            state_steps: list[torch.Tensor] = []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
            beta1, beta2 = group["betas"]
            adam(
                _locals(params),
                _locals(grads),
                _locals(exp_avgs),
                _locals(exp_avg_sqs),
                _locals(max_exp_avg_sqs),
                state_steps,
                amsgrad=group["amsgrad"],
                has_complex=has_complex,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
        return loss
