"""Which samples each rank reads at each step: pure index arithmetic, numpy only.

A *sample* is ``seq_len + 1`` tokens starting at ``i * seq_len`` (inputs and the targets
shifted by one); a token stream of ``T`` tokens holds ``N = (T - 1) // seq_len`` of them,
without overlap. Samples are visited in an infinite *stream*: epoch ``e`` is a seeded
bijective permutation of ``[0, N)`` (a Feistel network with cycle walking, so no O(N)
index array), a new order every epoch; stream position ``p`` is sample
``perm(seed, p // N)(p % N)``.

The global batch of optimizer step ``k`` (1-based) is stream positions
``[(k-1)*G, k*G)`` for a global batch of ``G`` samples: it depends only on
``(seed, k, G)``, never on the mesh shape or the node count. Within it, micro-batch ``m``
of rank ``r`` (``W`` ranks, ``b`` samples each) holds positions
``(k-1)*G + m*W*b + r*b + [0, b)``, so every rank computes and reads only its own rows.

The data position saved in a checkpoint is therefore ``k * G`` samples consumed, with
``G`` and the seed: a run resumed with the same ``G`` on any number of ranks continues
with exactly the samples an uninterrupted run would see.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hpc_hsdp.plan.mixture import check_batch, rows_after, rows_of_step

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (for keys)."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def hash64(values: np.ndarray, key: int) -> np.ndarray:
    """A well-mixed 64-bit hash of each (value, key): splitmix64's finaliser, vectorised
    (uint64 arithmetic wraps, as it should)."""
    x = np.asarray(values).astype(np.uint64) ^ np.uint64(key & _MASK64)
    x = x + np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: int) -> int:
    """One 64-bit key from integers (seed, epoch, salt ...)."""
    key = 0x243F6A8885A308D3
    for part in parts:
        key = _mix_int(key ^ _mix_int(int(part) & _MASK64))
    return key


class FeistelPermutation:
    """A seeded bijection of ``[0, n)`` in O(1) memory.

    A balanced Feistel network on the smallest even number of bits covering ``n`` (a
    domain of at most ``4n``) permutes that domain; *cycle walking* (apply it again while
    the result is ``>= n``) restricts it to ``[0, n)`` and stays a bijection.
    """

    ROUNDS = 6

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        self.half_bits = (bits + 1) // 2
        self._mask = np.uint64((1 << self.half_bits) - 1)
        self._keys = [derive_key(key, round_index) for round_index in range(self.ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half_bits)
        left, right = x >> half, x & self._mask
        for round_key in self._keys:
            left, right = right, left ^ (hash64(right, round_key) & self._mask)
        return (left << half) | right

    def __call__(self, indices) -> np.ndarray:
        """The images of ``indices`` (each in ``[0, n)``) as int64."""
        x = np.asarray(indices, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"indices must lie in [0, {self.n})")
        if self.n == 1:
            return np.zeros_like(x)
        y = self._encrypt(x.astype(np.uint64))
        outside = y >= np.uint64(self.n)
        while outside.any():
            y[outside] = self._encrypt(y[outside])
            outside = y >= np.uint64(self.n)
        return y.astype(np.int64)


def num_samples(num_tokens: int, seq_len: int) -> int:
    """Non-overlapping samples of ``seq_len + 1`` tokens in ``num_tokens`` tokens."""
    return max(0, (num_tokens - 1) // seq_len)


@dataclass(frozen=True, kw_only=True)
class SampleOrder:
    """The infinite stream of sample ids over ``num_samples`` samples, reshuffled each epoch."""

    num_samples: int
    seed: int

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"a sample order needs at least one sample, got {self.num_samples}")

    def epoch_permutation(self, epoch: int) -> FeistelPermutation:
        return FeistelPermutation(self.num_samples, derive_key(self.seed, epoch, 0x5A3))

    def sample_ids(self, positions) -> np.ndarray:
        """Sample id at each stream position (int64)."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, within = np.divmod(positions, self.num_samples)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            out[here] = self.epoch_permutation(int(epoch))(within[here])
        return out


@dataclass(frozen=True, kw_only=True)
class BatchLayout:
    """How one optimizer step's ``global_batch`` samples split into ``grad_accum``
    micro-batches of ``rank_batch`` samples on each of ``world_size`` ranks."""

    global_batch: int
    world_size: int
    grad_accum: int = 1

    def __post_init__(self) -> None:
        per_step = self.world_size * self.grad_accum
        if self.global_batch < 1 or self.world_size < 1 or self.grad_accum < 1 or self.global_batch % per_step:
            raise ValueError(
                f"global batch {self.global_batch} does not split over {self.world_size} ranks x "
                f"{self.grad_accum} micro-batches"
            )

    @property
    def rank_batch(self) -> int:
        return self.global_batch // (self.world_size * self.grad_accum)

    def step_positions(self, step: int) -> np.ndarray:
        """Stream positions of the whole global batch of ``step`` (1-based)."""
        if step < 1:
            raise ValueError(f"steps count from 1, got {step}")
        return np.arange((step - 1) * self.global_batch, step * self.global_batch, dtype=np.int64)

    def positions(self, step: int, micro: int, rank: int) -> np.ndarray:
        """Stream positions of ``rank``'s rows of micro-batch ``micro`` (0-based) of ``step``."""
        if not (0 <= micro < self.grad_accum and 0 <= rank < self.world_size):
            raise ValueError(f"micro-batch {micro} of {self.grad_accum}, rank {rank} of {self.world_size}")
        b = self.rank_batch
        first = (step - 1) * self.global_batch + micro * self.world_size * b + rank * b
        return np.arange(first, first + b, dtype=np.int64)

    def samples_consumed(self, step: int) -> int:
        """Samples of the stream used by steps ``1..step``."""
        return step * self.global_batch


def eval_sample_ids(*, num_samples: int, count: int, seed: int) -> np.ndarray:
    """The fixed held-out samples of every evaluation: ``min(count, num_samples)`` distinct
    samples spread over the split (a seeded permutation's first ones); the same set on
    every mesh shape."""
    order = SampleOrder(num_samples=num_samples, seed=derive_key(seed, 0xE7A1))
    return order.sample_ids(np.arange(min(count, num_samples), dtype=np.int64))


class TokenSource(Protocol):
    """What :class:`DatasetSamples` reads: ``length`` tokens from ``start``, and the sizes."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def max_token_id(self) -> int: ...

    def read(self, start: int, length: int) -> np.ndarray: ...


class SampleSource(Protocol):
    """Where a run's samples come from (:class:`DatasetSamples`, :class:`MixtureSamples`,
    :class:`~hpc_hsdp.data.synthetic.SyntheticSamples`): ``read(sample_ids)`` -> ``(rows, seq_len + 1)``
    int64, and the sizes."""

    @property
    def num_samples(self) -> int: ...

    @property
    def max_token_id(self) -> int: ...

    def read(self, sample_ids) -> np.ndarray: ...


@dataclass(frozen=True)
class DatasetSamples:
    """Samples of a token dataset (anything with ``read(start, length)`` and ``num_tokens``,
    e.g. :class:`hpc_hsdp.data.tokens.TokenDataset`): ``read(sample_ids)`` reads only those
    rows (memory-mapped) as ``(len(ids), seq_len + 1)`` int64."""

    dataset: TokenSource
    seq_len: int

    @property
    def num_samples(self) -> int:
        return num_samples(self.dataset.num_tokens, self.seq_len)

    @property
    def max_token_id(self) -> int:
        return self.dataset.max_token_id

    def read(self, sample_ids) -> np.ndarray:
        ids = np.asarray(sample_ids, dtype=np.int64)
        out = np.empty((len(ids), self.seq_len + 1), dtype=np.int64)
        for row, sample in enumerate(ids.tolist()):
            out[row] = self.dataset.read(sample * self.seq_len, self.seq_len + 1)
        return out


# ---------------------------------------------------------------------------- mixtures


class MixtureOrder:
    """The sample stream of a mixture (``--data web=DIR:0.7,code=DIR:0.3``), with the interface
    of :class:`SampleOrder`: stream position ``p`` is row ``p - (k-1)*G`` of step ``k``'s global
    batch of ``G`` rows.

    Step ``k`` takes ``rows_of_step(k)`` rows of each source (:mod:`hpc_hsdp.plan.mixture`: a
    pure function of ``k``), spread over the batch by a permutation seeded with
    ``(seed, k)``; the ``j``-th row of source ``s`` in the step is position
    ``rows_after(k-1)[s] + j`` of that source's own stream, a :class:`SampleOrder` of its samples
    (reshuffled every epoch of it: a source that runs out wraps). A sample id is global: source
    ``s``'s sample ``i`` is ``offsets[s] + i`` (:class:`MixtureSamples` reads it).
    """

    def __init__(self, mixture, *, num_samples: tuple[int, ...], seed: int, global_batch: int) -> None:
        check_batch(mixture, global_batch)
        self.mixture = mixture
        self.seed = seed
        self.global_batch = global_batch
        self.sizes = tuple(int(n) for n in num_samples)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.num_samples = int(self.offsets[-1])
        self.orders = tuple(
            SampleOrder(num_samples=n, seed=derive_key(seed, zlib.crc32(s.name.encode()), 0x313))
            for s, n in zip(mixture.sources, self.sizes)
        )
        self._cached: tuple[int, np.ndarray, np.ndarray] | None = None

    def step_rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each row, that source's stream position) of step ``step``'s global batch."""
        if self._cached is not None and self._cached[0] == step:
            return self._cached[1], self._cached[2]
        counts = rows_of_step(self.mixture, step, self.global_batch)
        before = rows_after(self.mixture, step - 1, self.global_batch)
        arranged = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
        shuffle = FeistelPermutation(self.global_batch, derive_key(self.seed, step, 0x317))
        sources = arranged[shuffle(np.arange(self.global_batch))]
        positions = np.empty(self.global_batch, dtype=np.int64)
        for index, first in enumerate(before):
            here = sources == index
            positions[here] = first + np.arange(int(here.sum()), dtype=np.int64)
        self._cached = (step, sources, positions)
        return sources, positions

    def sample_ids(self, positions) -> np.ndarray:
        """Global sample id at each stream position (int64)."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty_like(positions)
        steps, rows = np.divmod(positions, self.global_batch)
        for step in np.unique(steps):
            here = steps == step
            sources, source_positions = self.step_rows(int(step) + 1)
            chosen, chosen_positions = sources[rows[here]], source_positions[rows[here]]
            ids = np.empty(len(chosen), dtype=np.int64)
            for index, order in enumerate(self.orders):
                mine = chosen == index
                if mine.any():
                    ids[mine] = self.offsets[index] + order.sample_ids(chosen_positions[mine])
            out[here] = ids
        return out

    def source_of(self, sample_ids) -> np.ndarray:
        """The source index of each global sample id."""
        return np.searchsorted(self.offsets, np.asarray(sample_ids, dtype=np.int64), side="right") - 1

    def state(self, step: int) -> dict:
        """Each source's position after ``step`` steps: rows given, whole epochs of it, samples."""
        rows = rows_after(self.mixture, step, self.global_batch)
        return {
            source.name: {
                "samples_consumed": used,
                "epoch": used // size,
                "num_samples": size,
                "weight": source.weight_text or str(source.weight),
            }
            for source, used, size in zip(self.mixture.sources, rows, self.sizes)
        }


@dataclass(frozen=True)
class MixtureSamples:
    """The sources of a mixture as one sample source: global sample id ``offsets[s] + i`` is
    sample ``i`` of source ``s`` (anything with ``read(ids)``, ``num_samples``, ``max_token_id``)."""

    sources: tuple
    names: tuple[str, ...]

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([s.num_samples for s in self.sources])]).astype(np.int64)

    @property
    def num_samples(self) -> int:
        return int(sum(s.num_samples for s in self.sources))

    @property
    def max_token_id(self) -> int:
        return max(s.max_token_id for s in self.sources)

    def source_of(self, sample_ids) -> np.ndarray:
        return np.searchsorted(self.offsets, np.asarray(sample_ids, dtype=np.int64), side="right") - 1

    def read(self, sample_ids) -> np.ndarray:
        ids = np.asarray(sample_ids, dtype=np.int64)
        offsets = self.offsets
        which = self.source_of(ids)
        rows = None
        for index, source in enumerate(self.sources):
            mine = which == index
            if mine.any():
                part = source.read(ids[mine] - offsets[index])
                if rows is None:
                    rows = np.empty((len(ids), part.shape[1]), dtype=np.int64)
                rows[mine] = part
        return rows if rows is not None else np.empty((0, 0), dtype=np.int64)
