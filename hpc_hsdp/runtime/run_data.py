"""The run's data: where the samples come from, their order and this rank's share of each step.

:func:`open_data` (``--data``/``--val-data`` memory-mapped, or synthetic tokens),
:func:`check_data` (against the model, before step 1), :func:`make_loader` (this rank's
micro-batches, prefetched), :func:`data_state` (the position stored in every checkpoint) and
:func:`eval_samples` (the fixed held-out samples).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpc_hsdp.data.sampler import BatchLayout, DatasetSamples, SampleOrder, eval_sample_ids
from hpc_hsdp.data.synthetic import SyntheticSamples
from hpc_hsdp.data.tokens import DataError, check_token_data, open_dataset, open_eval_dataset
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.runtime.dist import RunContext
from hpc_hsdp.runtime.loader import BatchLoader


@dataclass(frozen=True)
class TrainData:
    """Where the samples come from: the train and held-out sources, the order and the split."""

    train: object
    """``read(sample_ids)`` -> ``(rows, seq_len + 1)`` int64; ``num_samples``; ``max_token_id``."""
    val: object | None
    """The held-out source (None: no evaluation)."""
    order: SampleOrder
    layout: BatchLayout
    vocab_size: int | None
    """The dataset's vocabulary (None: synthetic tokens, the model's ``--vocab-size``)."""
    description: str
    """``synthetic`` or the dataset path (for checkpoints and messages)."""
    datasets: tuple = ()
    """The opened token datasets (train, val), for :func:`check_data`."""


def open_data(training: TrainingSpec, world_size: int) -> TrainData:
    """The run's data: ``--data`` (and ``--val-data``) memory-mapped, or synthetic tokens.
    Reads only the sidecars; raises DataError/SpecError (one line, exit 2) on bad input."""
    layout = BatchLayout(
        global_batch=training.global_batch(world_size), world_size=world_size, grad_accum=training.grad_accum
    )
    if training.data is None:
        train = SyntheticSamples(seed=training.seed, seq_len=training.seq_len, vocab_size=training.vocab_size)
        val = (
            SyntheticSamples(seed=training.seed, seq_len=training.seq_len, vocab_size=training.vocab_size, split="val")
            if training.eval_every
            else None
        )
        return TrainData(
            train=train,
            val=val,
            order=SampleOrder(num_samples=train.num_samples, seed=training.seed),
            layout=layout,
            vocab_size=None,
            description="synthetic",
        )
    train_ds = open_dataset(training.data, split="train")
    val_ds = open_eval_dataset(training.data, training.val_data) if training.eval_every else None
    train = DatasetSamples(train_ds, training.seq_len)
    val = DatasetSamples(val_ds, training.seq_len) if val_ds is not None else None
    if train.num_samples < 1:
        raise DataError(
            f"--data {training.data}: {train_ds.num_tokens} tokens hold no sample of --seq-len "
            f"{training.seq_len} + 1 tokens; use more data or a shorter --seq-len"
        )
    return TrainData(
        train=train,
        val=val,
        order=SampleOrder(num_samples=train.num_samples, seed=training.seed),
        layout=layout,
        vocab_size=train_ds.vocab_size,
        description=str(training.data),
        datasets=tuple(d for d in (train_ds, val_ds) if d is not None),
    )


def check_data(data: TrainData, *, model_vocab_size: int, training: TrainingSpec) -> None:
    """Before step 1: every token id fits the model's vocabulary and the training split
    holds at least one global batch (DataError, exit 2)."""
    if not data.datasets:
        return
    train_ds, *rest = data.datasets
    for index, val_ds in enumerate(rest or [None]):
        check_token_data(
            train_ds if index == 0 else None,
            val=val_ds,
            model_vocab_size=model_vocab_size,
            seq_len=training.seq_len,
            global_batch=data.layout.global_batch,
        )


def make_loader(ctx: RunContext, data: TrainData, *, first_step: int, last_step: int) -> BatchLoader:
    """This rank's micro-batches of steps ``first_step..last_step``, prefetched."""
    return BatchLoader(
        data.train,
        order=data.order,
        layout=data.layout,
        rank=ctx.rank,
        first_step=first_step,
        last_step=last_step,
        device=ctx.device,
    )


def data_state(data: TrainData, step: int, seed: int) -> dict:
    """The data position after ``step`` steps, as stored in every checkpoint."""
    return {
        "samples_consumed": data.layout.samples_consumed(step),
        "global_batch": data.layout.global_batch,
        "seed": seed,
        "num_samples": data.train.num_samples,
        "source": data.description,
    }


def eval_samples(data: TrainData, training: TrainingSpec) -> np.ndarray:
    """The fixed held-out samples of every evaluation: ``--eval-batches`` global batches."""
    return eval_sample_ids(
        num_samples=data.val.num_samples, count=training.eval_batches * data.layout.global_batch, seed=training.seed
    )
