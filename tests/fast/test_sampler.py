"""The sampler's index arithmetic (pure numpy, no torch): permutations, epochs, batches."""

from __future__ import annotations

import numpy as np
import pytest

from hpc_hsdp.data.sampler import (
    BatchLayout,
    DatasetSamples,
    FeistelPermutation,
    SampleOrder,
    eval_sample_ids,
    num_samples,
)
from hpc_hsdp.data.synthetic import SyntheticSamples


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 100, 255, 256, 257, 1000, 4097, 65537])
@pytest.mark.parametrize("key", [0, 1, 12345])
def test_feistel_permutation_is_a_bijection(n, key):
    image = FeistelPermutation(n, key)(np.arange(n))
    assert sorted(image.tolist()) == list(range(n))


@pytest.mark.parametrize("n", [10, 100, 1000])
def test_different_keys_give_different_orders_and_shuffle(n):
    a, b = FeistelPermutation(n, 1)(np.arange(n)), FeistelPermutation(n, 2)(np.arange(n))
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, np.arange(n))
    # shuffled, not a rotation: few fixed points, neighbours scattered
    assert (a == np.arange(n)).sum() <= max(3, n // 20)
    assert np.mean(np.abs(np.diff(a))) > n / 10


def test_permutation_needs_no_index_array():
    n = 10**12  # an index array would be 8 TB
    perm = FeistelPermutation(n, 7)
    picked = perm(np.array([0, 1, n - 1, 123456789]))
    assert len(set(picked.tolist())) == 4 and picked.min() >= 0 and picked.max() < n


def test_permutation_rejects_indices_outside():
    with pytest.raises(ValueError):
        FeistelPermutation(5, 0)(np.array([5]))


@pytest.mark.parametrize("n", [1, 7, 64, 333])
def test_epochs_wrap_with_a_new_order(n):
    order = SampleOrder(num_samples=n, seed=3)
    stream = order.sample_ids(np.arange(3 * n))
    epochs = stream.reshape(3, n)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(n))  # every sample once per epoch
    if n > 2:
        assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])
    # positions are looked up independently: any slice equals the corresponding part of the stream
    assert np.array_equal(order.sample_ids(np.arange(n - 1, 2 * n + 1)), stream[n - 1 : 2 * n + 1])


def test_seed_changes_the_order():
    a = SampleOrder(num_samples=50, seed=1).sample_ids(np.arange(50))
    b = SampleOrder(num_samples=50, seed=2).sample_ids(np.arange(50))
    assert not np.array_equal(a, b)


LAYOUTS = [(8, 1, 1), (8, 2, 1), (8, 4, 2), (8, 8, 1), (8, 2, 4), (24, 4, 3), (24, 6, 2), (24, 2, 12), (16, 16, 1)]


@pytest.mark.parametrize(("global_batch", "world", "accum"), LAYOUTS)
def test_ranks_rows_are_disjoint_and_cover_the_global_batch(global_batch, world, accum):
    layout = BatchLayout(global_batch=global_batch, world_size=world, grad_accum=accum)
    for step in (1, 2, 7):
        rows = [layout.positions(step, m, r) for m in range(accum) for r in range(world)]
        assert all(len(x) == layout.rank_batch for x in rows)
        flat = np.concatenate(rows)
        assert len(set(flat.tolist())) == len(flat) == global_batch  # disjoint
        assert sorted(flat.tolist()) == layout.step_positions(step).tolist()  # covering
    assert layout.samples_consumed(3) == 3 * global_batch


@pytest.mark.parametrize("global_batch", [8, 24])
def test_global_batch_depends_only_on_seed_step_and_size(global_batch):
    order = SampleOrder(num_samples=101, seed=9)
    by_layout = {}
    for g, world, accum in LAYOUTS:
        if g != global_batch:
            continue
        layout = BatchLayout(global_batch=g, world_size=world, grad_accum=accum)
        by_layout[(world, accum)] = [
            sorted(
                np.concatenate(
                    [order.sample_ids(layout.positions(step, m, r)) for m in range(accum) for r in range(world)]
                ).tolist()
            )
            for step in range(1, 30)  # crosses several epochs of 101 samples
        ]
    assert len(by_layout) >= 3
    first = next(iter(by_layout.values()))
    assert all(value == first for value in by_layout.values())


def test_a_resumed_stream_continues_where_the_steps_ended():
    order, layout = SampleOrder(num_samples=37, seed=0), BatchLayout(global_batch=6, world_size=2, grad_accum=1)
    uninterrupted = np.concatenate([order.sample_ids(layout.step_positions(s)) for s in range(1, 21)])
    assert np.array_equal(uninterrupted, order.sample_ids(np.arange(layout.samples_consumed(20))))
    # 20 steps x 6 = 120 samples = 3 epochs of 37 and 9 more: each sample 3 or 4 times, never more
    counts = np.bincount(uninterrupted, minlength=37)
    assert set(counts.tolist()) <= {3, 4}


@pytest.mark.parametrize(("global_batch", "world", "accum"), [(6, 4, 1), (0, 1, 1), (8, 3, 1), (8, 2, 3)])
def test_layouts_that_do_not_split_are_refused(global_batch, world, accum):
    with pytest.raises(ValueError):
        BatchLayout(global_batch=global_batch, world_size=world, grad_accum=accum)


@pytest.mark.parametrize(
    ("tokens", "seq_len", "expected"),
    [(0, 4, 0), (1, 4, 0), (4, 4, 0), (5, 4, 1), (9, 4, 2), (10, 4, 2), (1001, 10, 100)],
)
def test_num_samples(tokens, seq_len, expected):
    assert num_samples(tokens, seq_len) == expected


class _Flat:
    """A stand-in reader over an in-memory array (the real TokenDataset is tested by its owner)."""

    def __init__(self, tokens):
        self.tokens = np.asarray(tokens)
        self.num_tokens = len(self.tokens)
        self.max_token_id = int(self.tokens.max())

    def read(self, start, length):
        assert start >= 0 and start + length <= self.num_tokens
        return self.tokens[start : start + length]


def test_dataset_samples_are_windows_of_seq_len_plus_one():
    samples = DatasetSamples(_Flat(np.arange(23)), seq_len=5)
    assert samples.num_samples == 4
    rows = samples.read([3, 0])
    assert rows.dtype == np.int64 and rows.tolist() == [list(range(15, 21)), list(range(0, 6))]


def test_eval_samples_are_fixed_distinct_and_capped():
    ids = eval_sample_ids(num_samples=50, count=20, seed=1)
    assert len(set(ids.tolist())) == 20 and np.array_equal(ids, eval_sample_ids(num_samples=50, count=20, seed=1))
    assert sorted(eval_sample_ids(num_samples=7, count=20, seed=1).tolist()) == list(range(7))


def test_synthetic_rows_do_not_depend_on_who_reads_them():
    source = SyntheticSamples(seed=4, seq_len=16, vocab_size=64)
    together = source.read(np.arange(10))
    apart = np.concatenate([source.read([i]) for i in range(10)])
    assert np.array_equal(together, apart) and together.shape == (10, 17)
    assert together.min() >= 0 and together.max() < 64
    assert not np.array_equal(
        source.read([0]), SyntheticSamples(seed=4, seq_len=16, vocab_size=64, split="val").read([0])
    )
    # learnable: most next tokens follow one of the strides
    steps = (together[:, 1:] - together[:, :-1]) % 64
    assert np.isin(steps, [1, 2, 3, 5]).mean() > 0.75


def test_synthetic_tokens_are_drawn_from_the_models_vocabulary(tmp_path):
    """--vocab-size sizes the built-in model only: a model with its own vocabulary (hf:, a factory)
    gets synthetic tokens below its size; data read from files is never redrawn."""
    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.task.training.run_data import open_data
    from tests.data_helpers import make_dataset

    data = open_data(TrainingSpec.of(vocab_size=256, seq_len=16, eval_every=2), world_size=2)
    redrawn = data.drawn_from(96)
    for source in (redrawn.train, redrawn.val):
        rows = source.read(np.arange(200))
        assert rows.max() < 96 and rows.max() > 64, rows.max()
    assert data.train.read(np.arange(200)).max() >= 96  # the run before the model was known
    assert redrawn.order == data.order and redrawn.layout == data.layout
    assert data.drawn_from(256) is data
    make_dataset(tmp_path / "ds", shards={"train": [[np.arange(100) % 50]], "val": [[np.arange(40) % 50]]})
    from_files = open_data(TrainingSpec.of(data=str(tmp_path / "ds"), seq_len=8), world_size=1)
    assert from_files.drawn_from(96) is from_files
