"""The step coordinator: what an ordinary job and a replica group do differently around the
engine's steps. :class:`~hpc_hsdp.task.training.engine.Engine` is given one and never asks which.

- :class:`OneGroup`, the ordinary job: the steps after the resumed one to ``--steps``, each
  rank's rows read ahead by the prefetching loader, the fused step
  (:func:`hpc_hsdp.task.training.step.train_step`), always committed; the job leads every step
  (its rank 0 writes the record and the checkpoints).
- :class:`~hpc_hsdp.task.training.replica_coordinator.ReplicaGroup` (``--fault-tolerance replica``,
  torchft): which step, and which of its rows are this group's, is known only after the
  step's quorum (a group that healed from a live peer jumps ahead); the gradients are averaged
  across the live groups and the step commits only where all agree, else it is trained again;
  the step's leading group writes the record and saves; below ``--min-replicas`` one surviving
  group saves the last committed step before the job falls back to a requeue.

:func:`coordinator_for` chooses one from the training options.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Protocol, runtime_checkable

import torch

from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.parallelism.tensor_parallel import loss_context
from hpc_hsdp.task.training.loader import BatchLoader, MicroBatch
from hpc_hsdp.task.training.run_data import TrainData, make_loader
from hpc_hsdp.task.training.step import train_step


@runtime_checkable
class StepCoordinator(Protocol):
    """What the engine asks of the job around its steps (see the module docstring)."""

    def open(
        self,
        data: TrainData,
        adapter,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        start_step: int,
        state: dict,
        save_now: Callable[[], int],
    ) -> None:
        """Collective, once, after the model is built and resumed from ``start_step``. ``state``:
        the engine's own state (a replica group that heals replaces its content with a peer's);
        ``save_now()``: checkpoints the last completed step at once and returns its number."""

    def steps(self, done: Callable[[], int]) -> Iterable[int]:
        """Collective, once: the numbers of the steps left to ``--steps``; ``done()`` is the
        last step completed so far."""

    def begin(self, number: int) -> tuple[int, list[MicroBatch], float]:
        """The step trained now (``number``, or where a replica group jumped to), this rank's
        micro-batches of it and the seconds it waited for them."""

    def train_step(
        self, batches: list[MicroBatch], *, lr: float, stop_code: Callable[[], int] | None
    ) -> tuple[torch.Tensor, bool]:
        """Collective: forward, backward, the gradient reduction and the optimizer step;
        ``([global mean loss, global gradient norm, agreed stop code, ...], committed)``, the
        tensor on the device (no host sync). Not committed: the step is trained again."""

    def take_record_fields(self) -> dict:
        """The fields this coordinator adds to the step's metrics record (counts since the last record)."""

    @property
    def leads(self) -> bool:
        """This job (or group) writes the step's record and saves the checkpoints."""

    @property
    def debuggable(self) -> bool:
        """``hpc-hsdp debug`` may stop a rank at the step boundaries (every rank meets at each one)."""

    @property
    def prints_step_lines(self) -> bool:
        """This rank prints the step's line."""

    @property
    def rank_label(self) -> int | str:
        """This rank's name in the test hooks' files (:func:`hpc_hsdp.task.resilience.injected_faults.after_step`)."""

    def close_steps(self) -> None:
        """After the last step (or a stop): nothing reads ahead any more."""

    def close(self) -> None:
        """At the run's end, after the final checkpoint."""


class OneGroup:
    """The ordinary job: every rank trains every step, each with its own rows (see the module docstring)."""

    leads = True
    debuggable = True

    def __init__(self, ctx: RunContext, training: TrainingSpec) -> None:
        self.ctx, self.training = ctx, training
        self.loader: BatchLoader | None = None

    def open(self, data, adapter, model, optimizer, *, start_step, state, save_now) -> None:
        self.data, self.adapter, self.model, self.optimizer = data, adapter, model, optimizer

    def steps(self, done: Callable[[], int]) -> Iterable[int]:
        first, last = done() + 1, self.training.optimizer.steps
        self.loader = make_loader(self.ctx, self.data, first_step=first, last_step=last)
        return range(first, last + 1)

    def begin(self, number: int) -> tuple[int, list[MicroBatch], float]:
        assert self.loader is not None  # steps() opened it
        batches, waited = self.loader.next_step(number)
        return number, batches, waited

    def train_step(self, batches, *, lr, stop_code) -> tuple[torch.Tensor, bool]:
        out = train_step(
            self.model,
            self.optimizer,
            self.adapter,
            batches,
            lr=lr,
            clip_grad=self.training.optimizer.clip_grad,
            dims=self.ctx.dims,
            stop_code=stop_code,
            num_sources=len(self.data.source_names),
            loss_scope=partial(loss_context, self.ctx, self.adapter),
        )
        return out, True

    def take_record_fields(self) -> dict:
        return {}

    @property
    def prints_step_lines(self) -> bool:
        return self.ctx.is_rank0

    @property
    def rank_label(self) -> int:
        return self.ctx.rank

    def close_steps(self) -> None:
        if self.loader is not None:
            self.loader.close()

    def close(self) -> None:
        pass


def coordinator_for(ctx: RunContext, training: TrainingSpec) -> StepCoordinator:
    """The coordinator ``training``'s options ask for: a replica group's with ``--fault-tolerance replica``."""
    if training.resilience.fault_tolerance == "replica":
        from hpc_hsdp.task.training.replica_coordinator import ReplicaGroup  # noqa: PLC0415 - torchft: an optional extra

        return ReplicaGroup(ctx, training)
    return OneGroup(ctx, training)
