"""Helpers shared by tests (moved out of tests/processes/test_runtime.py: no test module imports another)."""

from __future__ import annotations

import os

from hpc_hsdp.job.spec import TrainingSpec


def wrapped_collectives() -> list[str]:
    """The torch.distributed collectives that are not torch's own functions right now."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    names = (
        "all_gather_single",
        "all_gather_into_tensor",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_reduce",
    )
    return [n for n in names if getattr(dist, n) is not getattr(distributed_c10d, n)]


def synthetic_rows(training: TrainingSpec, *, step: int, rank: int, world_size: int, batch_size: int):
    """(inputs, targets) of ``rank``'s rows of ``step`` from the loop's synthetic source."""
    import torch

    from hpc_hsdp.data.sampler import BatchLayout, SampleOrder
    from hpc_hsdp.data.synthetic import SyntheticSamples

    source = SyntheticSamples(
        seed=training.optimizer.seed, seq_len=training.dataset.seq_len, vocab_size=training.model.vocab_size
    )
    layout = BatchLayout(global_batch=batch_size * world_size, world_size=world_size)
    ids = SampleOrder(num_samples=source.num_samples, seed=training.optimizer.seed).sample_ids(
        layout.positions(step, 0, rank)
    )
    rows = torch.from_numpy(source.read(ids))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def full_checkpoint(path):
    """A DCP checkpoint as one plain state dict (single process, no process group)."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(str(path), out)
        return torch.load(out, weights_only=False)


def _flatten(prefix, value, out):
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}/{k}", v, out)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(f"{prefix}/{i}", v, out)
    else:
        out[prefix] = value
    return out


def compare_states(a, b, *, atol=0.0):
    """Names of the entries of two nested states that differ (exactly when atol == 0)."""
    import torch

    fa, fb = _flatten("", a, {}), _flatten("", b, {})
    diffs = sorted(set(fa) ^ set(fb))
    for key in sorted(set(fa) & set(fb)):
        x, y = fa[key], fb[key]
        if isinstance(x, torch.Tensor):
            same = x.shape == y.shape and (torch.equal(x, y) if atol == 0 else torch.allclose(x, y, atol=atol, rtol=0))
        else:
            same = x == y
        if not same:
            diffs.append(key)
    return diffs


def compare_checkpoints(path_a, path_b):
    return compare_states(full_checkpoint(path_a), full_checkpoint(path_b))
