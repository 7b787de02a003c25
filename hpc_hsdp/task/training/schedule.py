"""Learning-rate schedules: a pure function of the step (no state to checkpoint, no torch)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_hsdp.job.training_sections import OptimizerSection


def learning_rate(step: int, *, lr: float, schedule: str, warmup_steps: int, min_lr: float, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based).

    A linear warm-up from ``lr / warmup_steps`` to ``lr`` over the first ``warmup_steps``
    steps, then ``constant`` (``lr``), ``cosine`` or ``linear`` decay from ``lr`` down to
    ``min_lr``, reached exactly at ``total_steps``."""
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    decay_steps = total_steps - warmup_steps
    progress = 1.0 if decay_steps <= 0 else min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "cosine":
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    raise ValueError(f"unknown learning-rate schedule {schedule!r}")


def lr_of(optimizer: OptimizerSection, step: int) -> float:
    """:func:`learning_rate` with the optimizer section's options."""
    return learning_rate(
        step,
        lr=optimizer.lr,
        schedule=optimizer.lr_schedule,
        warmup_steps=optimizer.warmup_steps,
        min_lr=optimizer.min_lr,
        total_steps=optimizer.steps,
    )
