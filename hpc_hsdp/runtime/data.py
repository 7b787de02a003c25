"""Synthetic, learnable, reproducible token data.

A sequence follows ``x[t+1] = (x[t] + stride) % vocab`` with a per-sequence stride from
a small set, and 10 % of the tokens replaced by noise: a model learns to read the stride
from the context, so the loss falls clearly in a few dozen steps.

The global batch of step ``k`` (``world_size * batch_size`` rows) depends only on
``(seed, k)``; rank ``r`` takes rows ``r*batch_size .. (r+1)*batch_size``. So a run is
reproducible, a resumed run continues the same sequence from the saved step, and the
global batch does not depend on the mesh shape (only on the number of ranks).
"""

from __future__ import annotations

import torch

STRIDES = (1, 2, 3, 5)
NOISE = 0.1


def global_batch(*, seed: int, step: int, rows: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """``rows`` sequences of ``seq_len + 1`` tokens (inputs and shifted targets) for ``step``."""
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
    start = torch.randint(0, vocab_size, (rows, 1), generator=generator)
    stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (rows, 1), generator=generator)]
    tokens = (start + stride * torch.arange(seq_len + 1)) % vocab_size
    noise = torch.rand(rows, seq_len + 1, generator=generator) < NOISE
    random_tokens = torch.randint(0, vocab_size, (rows, seq_len + 1), generator=generator)
    return torch.where(noise, random_tokens, tokens)


def rank_batch(
    *, seed: int, step: int, rank: int, world_size: int, batch_size: int, seq_len: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (inputs, targets) for ``step``: its ``batch_size`` rows of the global batch."""
    tokens = global_batch(seed=seed, step=step, rows=world_size * batch_size, seq_len=seq_len, vocab_size=vocab_size)
    mine = tokens[rank * batch_size : (rank + 1) * batch_size]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
