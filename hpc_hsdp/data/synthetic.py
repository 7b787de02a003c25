"""Synthetic, learnable token samples: the data source when no ``--data`` is given.

Sample ``i`` follows ``x[t+1] = (x[t] + stride) % vocab`` from a start token, with a
per-sample stride from a small set and 10 % of the tokens replaced by noise; a model
learns to read the stride from the context, so the loss falls clearly in a few dozen
steps. Every token is a hash of ``(seed, split, i, t)``: a rank generates only its own
rows, and sample ``i`` is the same whoever asks for it. The "train" and "val" splits are
different streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpc_hsdp.data.sampler import derive_key, hash64

STRIDES = np.array([1, 2, 3, 5], dtype=np.int64)
NOISE_PER_MILLE = 100
NUM_SAMPLES = 1 << 40
"""Samples per split: unbounded in practice (the sampler still permutes them)."""
_SPLITS = {"train": 1, "val": 2}


@dataclass(frozen=True, kw_only=True)
class SyntheticSamples:
    """``read(sample_ids)`` -> ``(len(ids), seq_len + 1)`` int64 tokens."""

    seed: int
    seq_len: int
    vocab_size: int
    split: str = "train"
    num_samples: int = NUM_SAMPLES

    def __post_init__(self) -> None:
        if self.split not in _SPLITS:
            raise ValueError(f"split {self.split!r}: choose train or val")

    @property
    def max_token_id(self) -> int:
        return self.vocab_size - 1

    def read(self, sample_ids) -> np.ndarray:
        ids = np.asarray(sample_ids, dtype=np.int64).reshape(-1, 1)
        key = derive_key(self.seed, _SPLITS[self.split])
        t = np.arange(self.seq_len + 1, dtype=np.int64).reshape(1, -1)
        start = (hash64(ids, derive_key(key, 0)) % np.uint64(self.vocab_size)).astype(np.int64)
        stride = STRIDES[(hash64(ids, derive_key(key, 1)) % np.uint64(len(STRIDES))).astype(np.int64)]
        tokens = (start + stride * t) % self.vocab_size
        cell = ids * (self.seq_len + 1) + t  # one hash input per (sample, position)
        noise = (hash64(cell, derive_key(key, 2)) % np.uint64(1000)) < np.uint64(NOISE_PER_MILLE)
        random_tokens = (hash64(cell, derive_key(key, 3)) % np.uint64(self.vocab_size)).astype(np.int64)
        return np.where(noise, random_tokens, tokens)
