"""Helpers shared by tests (moved out of tests/fast/test_comm_stats.py: no test module imports another)."""

from __future__ import annotations

from hpc_hsdp.job.spec import TrainingSpec

MODEL = TrainingSpec.of(
    layers=2,
    width=32,
    heads=4,
    seq_len=12,
    batch_size=2,
    vocab_size=64,
    steps=2,
    seed=1,
    reshard_after_forward="always",
)  # the plan's default estimate
