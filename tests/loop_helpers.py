"""Helpers shared by tests (moved out of tests/processes/test_loop.py: no test module imports another)."""

from __future__ import annotations

import os
import signal


def _train_recording(ctx, training, *, signal_at=None):
    """train() with every step's record and this rank's sample ids; optionally SIGUSR2 on rank 3, so that
    every rank stops after step ``signal_at``."""
    from hpc_hsdp.task.training.loop import train

    records = {}

    def on_step(step, record):
        records[step] = record
        if signal_at is not None and step == signal_at - 1 and ctx.rank == 3:  # agreed in step signal_at's all_reduce
            os.kill(os.getpid(), signal.SIGUSR2)

    result = train(ctx, training, on_step=on_step)
    return {"summary": result.summary(ctx), "records": records, "eval": result.eval_losses}


def train_recording(ctx):
    return _train_recording(ctx, ctx.spec.training)


def train_signalled_at_3(ctx):
    return _train_recording(ctx, ctx.spec.training, signal_at=3)


def max_param_diff(path_a, path_b):
    from tests.runtime_helpers import full_checkpoint

    a, b = full_checkpoint(path_a)["model"], full_checkpoint(path_b)["model"]
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def union_of_samples(values) -> dict[int, list[int]]:
    """step -> the sorted sample ids all ranks trained on."""
    steps: dict[int, list[int]] = {}
    for value in values:
        for step, record in value["records"].items():
            steps.setdefault(step, []).extend(i for micro in record["sample_ids"] for i in micro)
    return {step: sorted(ids) for step, ids in steps.items()}
