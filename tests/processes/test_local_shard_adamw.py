"""AdamW over the local shards (issue 24, the cheap host step): the same numbers and the same
state as ``torch.optim.AdamW`` over FSDP2's DTensors, without one DTensor op in the update.

One launch of an emulated 2 x 2 job (--shard 2: parameters placed (Replicate(), Shard(0)),
gloo on CPU): for the multi-tensor and the fused kernel, two copies of the built-in model get
the same gradients for three steps, one stepped by torch's AdamW, one by LocalShardAdamW; every
local shard of the parameters and of both moments must be bitwise equal, the state the same
DTensors (placements, keys, steps), and a dispatch mode must see no DTensor in the local step.
"""

from __future__ import annotations

import pytest
import torch
from dist_helpers import launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec

MODEL = TrainingSpec.of(layers=2, width=32, heads=4, seq_len=8, batch_size=2, vocab_size=64, steps=1, seed=5)


def compare_optimizers(ctx):
    """fn of run_task: per kernel, the largest difference of parameters and moments, the state's shape, DTensor ops."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.task.training.model import build_model
    from hpc_hsdp.task.training.optimizer import LocalShardAdamW

    class DTensorOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += any(issubclass(t, DTensor) for t in types)
            return func(*args, **(kwargs or {}))

    def groups(model):
        params = list(model.parameters())
        return [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]

    adapter = resolve_model(MODEL, data_vocab_size=None)
    out = {}
    for kernel in ({"foreach": True}, {"fused": True}):
        models = [build_model(ctx, adapter, MODEL) for _ in range(2)]
        reference = torch.optim.AdamW(groups(models[0]), lr=1e-2, **kernel)
        local = LocalShardAdamW(groups(models[1]), lr=1e-2, **kernel)
        ops = {}
        for step in range(3):
            generator = torch.Generator().manual_seed(100 + step)
            for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
                full = torch.randn(a.shape, generator=generator)
                a.grad = distribute_tensor(full, a.device_mesh, a.placements, src_data_rank=None)
                b.grad = distribute_tensor(full.clone(), b.device_mesh, b.placements, src_data_rank=None)
            for name, optimizer in (("reference", reference), ("local", local)):
                with DTensorOps() as mode:
                    optimizer.step()
                ops[name] = mode.count
        worst = 0.0
        for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
            pairs = [(a, b)] + [(reference.state[a][k], local.state[b][k]) for k in ("exp_avg", "exp_avg_sq")]
            for x, y in pairs:
                assert isinstance(x, DTensor) and isinstance(y, DTensor) and x.placements == y.placements
                worst = max(worst, (x.to_local() - y.to_local()).abs().max().item())
        ref_state, local_state = reference.state_dict(), local.state_dict()
        out[next(iter(kernel))] = {
            "worst": worst,
            "ops": ops,
            "same_keys": [sorted(s) for s in ref_state["state"].values()]
            == [sorted(s) for s in local_state["state"].values()],
            "steps": sorted({float(s["step"]) for s in local_state["state"].values()}),
            "placements": str(next(iter(local.state.values()))["exp_avg"].placements),
        }
    return out


@pytest.mark.dist
def test_local_shard_adamw_is_torch_adamw_without_dtensor_dispatch(tmp_path):
    spec = RunSpec(shard_size=2, run_dir=str(tmp_path), device="cpu", training=MODEL, timeout_s=60)
    outcomes = launch(spec, tasks_per_node=(2, 2), fn=compare_optimizers, timeout_s=120)
    for outcome in outcomes:
        for kernel, result in outcome.value.items():
            assert result["worst"] == 0.0, (outcome.procid, kernel, result)
            assert result["same_keys"] and result["steps"] == [3.0], result
            assert result["placements"] == "(Replicate(), Shard(dim=0))", result
            assert result["ops"]["local"] == 0, result  # the update touches local tensors only
            assert result["ops"]["reference"] > 0, result  # the mode does see torch's DTensor ops
