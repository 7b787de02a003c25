"""Which gradients count whole in the norm under tensor parallelism (``task/tensor_parallel.norm_weights``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from hpc_hsdp.task.parallelism.tensor_parallel import norm_weights


def _dtensor(names, placements):
    """A stand-in DTensor with the mesh names and placements norm_weights reads (no process group)."""
    return SimpleNamespace(device_mesh=SimpleNamespace(mesh_dim_names=names), placements=placements)


@pytest.mark.parametrize(
    ("names", "placements", "weight"),
    [
        (("replicate", "shard", "tp"), (Replicate(), Shard(0), Shard(0)), 1.0),  # qkv: split over tp
        (("shard", "tp"), (Shard(0), Shard(1)), 1.0),  # proj: split by columns
        (("shard", "tp"), (Shard(0), Replicate()), 0.5),  # a sequence-parallel norm: whole on each tp rank
        (("replicate", "shard"), (Replicate(), Shard(0)), 0.5),  # a parameter the plan left out
        (("shard",), (Shard(0),), 0.5),
    ],
)
def test_a_gradient_whole_on_every_tp_rank_counts_once_over_the_group(monkeypatch, names, placements, weight):
    param = _dtensor(names, placements)
    monkeypatch.setattr(
        "hpc_hsdp.task.parallelism.tensor_parallel.DTensor", SimpleNamespace
    )  # the stand-in passes for one
    assert norm_weights([param], 2) == [weight]


def test_without_tensor_parallelism_every_gradient_counts_whole():
    assert norm_weights([torch.zeros(2), torch.zeros(3)], 1) == [1.0, 1.0]


def test_a_plain_tensor_under_tensor_parallelism_counts_once_over_the_group():
    assert norm_weights([torch.zeros(2)], 4) == [0.25]
