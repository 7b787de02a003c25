"""The training loop's data loader: this rank's rows of each micro-batch, prefetched.

A background thread reads the rows of the next micro-batches (sample ids from
:mod:`hpc_hsdp.data.sampler`, tokens from a memory-mapped dataset or the synthetic
source) while the current step runs, into pinned memory when training on a GPU; the
consumer copies them to the device with ``non_blocking=True`` and measures how long it
waited for the thread (``data_wait_s``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from hpc_hsdp.data.sampler import BatchLayout, MixtureOrder, SampleOrder


@dataclass
class MicroBatch:
    step: int
    micro: int
    inputs: torch.Tensor
    """``(rows, seq_len)`` int64."""
    targets: torch.Tensor
    sample_ids: np.ndarray
    """The dataset sample ids of these rows (for tests and debugging)."""
    sources: np.ndarray | None = None
    """A mixture's source index of each row (None: one dataset)."""

    def to(self, device: torch.device) -> MicroBatch:
        if device.type == "cpu":
            return self
        return MicroBatch(
            self.step,
            self.micro,
            self.inputs.to(device, non_blocking=True),
            self.targets.to(device, non_blocking=True),
            self.sample_ids,
            self.sources,
        )


def read_rows(source, sample_ids: np.ndarray, *, pin_memory: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the samples ``sample_ids`` of ``source`` (``read(ids)`` ->
    ``(rows, seq_len + 1)`` int64)."""
    rows = torch.from_numpy(np.ascontiguousarray(source.read(sample_ids), dtype=np.int64))
    inputs, targets = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    if pin_memory:
        inputs, targets = inputs.pin_memory(), targets.pin_memory()
    return inputs, targets


class _End:
    pass


class BatchLoader:
    """This rank's micro-batches of steps ``first_step..last_step``, in order, read ahead by
    a daemon thread (``prefetch`` micro-batches deep). Use as an iterator or with
    :meth:`next_step`; always :meth:`close` (or use ``with``)."""

    def __init__(
        self,
        source,
        *,
        order: SampleOrder | MixtureOrder,
        layout: BatchLayout,
        rank: int,
        first_step: int,
        last_step: int,
        device: torch.device,
        prefetch: int | None = None,
    ) -> None:
        self.source, self.order, self.layout, self.rank = source, order, layout, rank
        self.first_step, self.last_step = first_step, last_step
        self.device = device
        self.pin_memory = device.type == "cuda"
        depth = prefetch if prefetch is not None else max(2, 2 * layout.grad_accum)
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="hpc-hsdp-loader", daemon=True)
        self._thread.start()

    def read(self, step: int, micro: int) -> MicroBatch:
        """One micro-batch of this rank, on the host (what the thread does)."""
        ids = self.order.sample_ids(self.layout.positions(step, micro, self.rank))
        inputs, targets = read_rows(self.source, ids, pin_memory=self.pin_memory)
        source_of = getattr(self.order, "source_of", None)
        return MicroBatch(step, micro, inputs, targets, ids, source_of(ids) if source_of is not None else None)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for step in range(self.first_step, self.last_step + 1):
                for micro in range(self.layout.grad_accum):
                    if not self._put(self.read(step, micro)):
                        return
            self._put(_End())
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put(exc)

    def next_micro_batch(self) -> tuple[MicroBatch, float]:
        """The next micro-batch, on the device, and the seconds spent waiting for it."""
        began = time.perf_counter()
        item = self._queue.get()
        waited = time.perf_counter() - began
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, _End):
            raise StopIteration
        return item.to(self.device), waited

    def next_step(self, step: int) -> tuple[list[MicroBatch], float]:
        """All ``grad_accum`` micro-batches of ``step`` and the total wait."""
        batches, waited = [], 0.0
        for _ in range(self.layout.grad_accum):
            batch, wait = self.next_micro_batch()
            if batch.step != step:
                raise RuntimeError(f"loader out of order: wanted step {step}, got {batch.step}")
            batches.append(batch)
            waited += wait
        return batches, waited

    def __iter__(self) -> Iterator[MicroBatch]:
        while True:
            try:
                yield self.next_micro_batch()[0]
            except StopIteration:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
