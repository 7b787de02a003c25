"""The run's data: where the samples come from, their order and this rank's share of each step.

:func:`open_data` (``--data``/``--val-data`` memory-mapped, or synthetic tokens),
:func:`check_data` (against the model, before step 1), :func:`make_loader` (this rank's
micro-batches, prefetched), :func:`data_state` (the position stored in every checkpoint) and
:func:`eval_samples` (the fixed held-out samples).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from hpc_hsdp.data.sampler import (
    BatchLayout,
    DatasetSamples,
    MixtureOrder,
    MixtureSamples,
    SampleOrder,
    SampleSource,
    eval_sample_ids,
)
from hpc_hsdp.data.synthetic import SyntheticSamples
from hpc_hsdp.data.tokens import DataError, TokenDataset, check_token_data, open_dataset, open_eval_dataset
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.plan.mixture import Mixture
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.training.loader import BatchLoader


@dataclass(frozen=True)
class TrainData:
    """Where the samples come from: the train and held-out sources, the order and the split."""

    train: SampleSource
    val: SampleSource | None
    """The held-out source (None: no evaluation, or a mixture's, whose are ``source_vals``)."""
    order: SampleOrder | MixtureOrder
    layout: BatchLayout
    vocab_size: int | None
    """The dataset's vocabulary (None: synthetic tokens, the model's ``--vocab-size``)."""
    description: str
    """``synthetic`` or the dataset path (for checkpoints and messages)."""
    datasets: tuple = ()
    """The opened token datasets (train, val), for :func:`check_data`."""
    source_vals: dict[str, SampleSource] | None = None
    """A mixture's held-out sources by name (each source's val split; None: one dataset)."""

    @property
    def source_names(self) -> tuple[str, ...]:
        """A mixture's source names, in order (empty: one dataset)."""
        return self.order.mixture.names if isinstance(self.order, MixtureOrder) else ()

    def drawn_from(self, model_vocab_size: int) -> TrainData:
        """Synthetic tokens drawn from the model's own vocabulary: ``--vocab-size`` sizes the built-in
        model, but a model that brings its vocabulary (``hf:PATH``, a factory) embeds only its own
        tokens. Data read from files is returned unchanged (its vocabulary is checked against the
        model's by :func:`check_data`)."""
        if not isinstance(self.train, SyntheticSamples) or self.train.vocab_size == model_vocab_size:
            return self
        return replace(
            self,
            train=replace(self.train, vocab_size=model_vocab_size),
            val=replace(self.val, vocab_size=model_vocab_size) if isinstance(self.val, SyntheticSamples) else self.val,
        )


def open_data(training: TrainingSpec, world_size: int) -> TrainData:
    """The run's data: ``--data`` (and ``--val-data``) memory-mapped, or synthetic tokens.
    Reads only the sidecars; raises DataError/SpecError (one line, exit 2) on bad input."""
    layout = BatchLayout(
        global_batch=training.dataset.global_batch(world_size),
        world_size=world_size,
        grad_accum=training.dataset.grad_accum,
    )
    if training.dataset.data is None:
        train: SampleSource = SyntheticSamples(
            seed=training.optimizer.seed, seq_len=training.dataset.seq_len, vocab_size=training.model.vocab_size
        )
        val: SampleSource | None = (
            SyntheticSamples(
                seed=training.optimizer.seed,
                seq_len=training.dataset.seq_len,
                vocab_size=training.model.vocab_size,
                split="val",
            )
            if training.evaluation.eval_every
            else None
        )
        return TrainData(
            train=train,
            val=val,
            order=SampleOrder(num_samples=train.num_samples, seed=training.optimizer.seed),
            layout=layout,
            vocab_size=None,
            description="synthetic",
        )
    if training.dataset.mixture is not None:
        return _open_mixture(training, training.dataset.mixture, layout)
    train_ds = open_dataset(training.dataset.data, split="train")
    val_ds = (
        open_eval_dataset(training.dataset.data, training.dataset.val_data) if training.evaluation.eval_every else None
    )
    train = DatasetSamples(train_ds, training.dataset.seq_len)
    val = DatasetSamples(val_ds, training.dataset.seq_len) if val_ds is not None else None
    if train.num_samples < 1:
        raise DataError(
            f"--data {training.dataset.data}: {train_ds.num_tokens} tokens hold no sample of --seq-len "
            f"{training.dataset.seq_len} + 1 tokens; use more data or a shorter --seq-len"
        )
    return TrainData(
        train=train,
        val=val,
        order=SampleOrder(num_samples=train.num_samples, seed=training.optimizer.seed),
        layout=layout,
        vocab_size=train_ds.vocab_size,
        description=str(training.dataset.data),
        datasets=tuple(d for d in (train_ds, val_ds) if d is not None),
    )


def _open_mixture(training: TrainingSpec, mixture: Mixture, layout: BatchLayout) -> TrainData:
    """A ``--data NAME=PATH:W,...`` mixture: every source's train split (and val split with
    ``--eval-every``), one vocabulary, one order over all of them."""
    trains: list[DatasetSamples] = []
    vals: dict[str, SampleSource] = {}
    datasets: list[tuple[TokenDataset, TokenDataset | None]] = []
    vocab_sizes = set()
    for source in mixture.sources:
        train_ds = open_dataset(source.path, split="train")
        train = DatasetSamples(train_ds, training.dataset.seq_len)
        if train.num_samples < 1:
            raise DataError(
                f"--data source {source.name} ({source.path}): {train_ds.num_tokens} tokens hold no sample of "
                f"--seq-len {training.dataset.seq_len} + 1 tokens; use more data or a shorter --seq-len"
            )
        trains.append(train)
        datasets.append((train_ds, None))
        vocab_sizes.add(train_ds.vocab_size)
        if training.evaluation.eval_every:
            val_ds = open_eval_dataset(source.path, None)
            vals[source.name] = DatasetSamples(val_ds, training.dataset.seq_len)
            datasets[-1] = (train_ds, val_ds)
    if len(vocab_sizes) > 1:
        sizes = ", ".join(f"{s.name} {d[0].vocab_size}" for s, d in zip(mixture.sources, datasets))
        raise DataError(
            f"--data mixture: the sources were tokenized with different vocabularies ({sizes}); "
            f"prepare every source with the same --tokenizer"
        )
    order = MixtureOrder(
        mixture,
        num_samples=tuple(t.num_samples for t in trains),
        seed=training.optimizer.seed,
        global_batch=layout.global_batch,
    )
    return TrainData(
        train=MixtureSamples(tuple(trains), mixture.names),
        val=None,  # each source is evaluated on its own: source_vals
        order=order,
        layout=layout,
        vocab_size=vocab_sizes.pop(),
        description=mixture.format(),
        datasets=tuple(datasets),
        source_vals=vals or None,
    )


def check_data(data: TrainData, *, model_vocab_size: int, training: TrainingSpec) -> None:
    """Before step 1: every token id fits the model's vocabulary and the training split
    holds at least one global batch (DataError, exit 2)."""
    if not data.datasets:
        return
    if data.source_vals is not None or isinstance(data.order, MixtureOrder):
        for train_ds, val_ds in data.datasets:
            check_token_data(
                train_ds,
                val=val_ds,
                model_vocab_size=model_vocab_size,
                seq_len=training.dataset.seq_len,
                global_batch=1,  # a source need not hold a whole batch: it gives a share, and wraps
            )
        return
    train_ds, *rest = data.datasets
    for index, val_ds in enumerate(rest or [None]):
        check_token_data(
            train_ds if index == 0 else None,
            val=val_ds,
            model_vocab_size=model_vocab_size,
            seq_len=training.dataset.seq_len,
            global_batch=data.layout.global_batch,
        )


def make_loader(ctx: RunContext, data: TrainData, *, first_step: int, last_step: int) -> BatchLoader:
    """This rank's micro-batches of steps ``first_step..last_step``, prefetched."""
    return BatchLoader(
        data.train,
        order=data.order,
        layout=data.layout,
        rank=ctx.data_rank,
        first_step=first_step,
        last_step=last_step,
        device=ctx.device,
    )


def data_state(data: TrainData, step: int, seed: int) -> dict:
    """The data position after ``step`` steps, as stored in every checkpoint."""
    state = {
        "samples_consumed": data.layout.samples_consumed(step),
        "global_batch": data.layout.global_batch,
        "seed": seed,
        "num_samples": data.train.num_samples,
        "source": data.description,
    }
    if isinstance(data.order, MixtureOrder):
        state["sources"] = data.order.state(step)
    return state


def source_table(data: TrainData) -> dict | None:
    """A mixture's sources for :func:`~hpc_hsdp.rundir.checkpointing.state.check_data_position`: name ->
    (weight as written, samples); None for one dataset."""
    if not isinstance(data.order, MixtureOrder):
        return None
    return {
        source.name: (source.weight_text or str(source.weight), size)
        for source, size in zip(data.order.mixture.sources, data.order.sizes)
    }


def eval_samples(data: TrainData, training: TrainingSpec) -> np.ndarray:
    """The fixed held-out samples of every evaluation: ``--eval-batches`` global batches."""
    assert data.val is not None  # evaluated only with a held-out source
    return eval_sample_ids(
        num_samples=data.val.num_samples,
        count=training.evaluation.eval_batches * data.layout.global_batch,
        seed=training.optimizer.seed,
    )


def source_eval_samples(data: TrainData, training: TrainingSpec) -> dict[str, tuple[SampleSource, np.ndarray]]:
    """A mixture's evaluation: per source, (its val split, its fixed held-out samples:
    ``--eval-batches`` global batches of it); empty for one dataset."""
    count = training.evaluation.eval_batches * data.layout.global_batch
    return {
        name: (val, eval_sample_ids(num_samples=val.num_samples, count=count, seed=training.optimizer.seed))
        for name, val in (data.source_vals or {}).items()
    }
