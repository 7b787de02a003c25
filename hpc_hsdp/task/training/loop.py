"""The training loop: one loop for every model (``--model builtin``, ``hf:...``, a factory).

Recipe (:func:`train`): open the data and check it against the model before step 1;
build the model from its adapter on the meta device, ``fully_shard`` each shard unit then
the root (bf16 parameters and compute with fp32 gradient reduction under ``--precision
bf16``; activation checkpointing per unit), materialize, initialise; resume model,
optimizer and data position from the newest complete checkpoint; then per step: take this
rank's micro-batches from the prefetching loader, forward/backward each (gradients
reduce-scattered inside the shard group every micro-batch, all-reduced across replicas
once, on the last), one fused all_reduce of loss, gradient norm and the ranks' stop
signals (clipping without a host sync), the scheduled learning rate, the optimizer step,
one host sync for the metrics and the agreed stop, evaluation every ``--eval-every``
steps, checkpoints.

The loop is a short user of :class:`hpc_hsdp.task.training.engine.Engine`, the machinery
:class:`hpc_hsdp.TrainingRun` gives people's own loops; the engine's parts live in
``run_data`` (data and its position), ``model`` (build, shard, optimizer), ``step`` (the
fused step, evaluation, seeding), ``device``, ``checkpoint`` and ``metrics``.

``<run_dir>/metrics.jsonl``, one record per step (rank 0): ``step``, ``loss`` (global
mean), ``lr``, ``grad_norm`` (global, before clipping), ``tokens_seen``,
``tokens_per_s``, ``step_time_s``, ``cpu_time_s`` (CPU seconds of the rank's process in the
step, all threads: near ``step_time_s`` on a GPU means the step is bound by the host),
``data_wait_s`` (time the step waited for the loader), ``eval_loss`` (on evaluation steps),
``peak_mem_bytes`` with ``peak_mem_kind``
(``cuda_max_allocated``, reset every step, plus ``peak_mem_reserved_bytes``; on CPU
``ru_maxrss``, rank 0's resident high-water mark, which only grows), ``world_size``,
``shard_size``, ``num_replicas``, ``grad_accum``, ``global_batch``, ``precision``,
``wall_time``, ``elapsed_s``; with ``--comm-stats``, ``comm`` (see ``comm_stats.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.training.engine import Engine
from hpc_hsdp.task.training.metrics_writer import step_line

__all__ = ["OnStep", "TrainResult", "payload", "train"]

OnStep = Callable[[int, dict], None]


@dataclass
class TrainResult:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    start_step: int
    """Step of the checkpoint the run resumed from (0: fresh start)."""
    last_step: int
    """Last step completed (== start_step when nothing was left to do)."""
    losses: dict[int, float] = field(default_factory=dict)
    """Global mean loss of each step this run did."""
    eval_losses: dict[int, float] = field(default_factory=dict)
    """Held-out mean loss at each evaluation step this run did."""
    stopped: bool = False
    """True when ``stop_requested()`` or a signal (``ctx.preemption``) ended the run before ``steps``."""
    stop_reason: str | None = None
    """``"USR2"`` (the warning signal), ``"TERM"``, ``"requested"`` (``stop_requested()``) or None."""

    def summary(self, ctx: RunContext) -> dict:
        return {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "shard_size": ctx.plan.shard_size,
            "start_step": self.start_step,
            "steps": self.last_step,
            "final_loss": self.losses.get(self.last_step),
            "final_eval_loss": self.eval_losses[max(self.eval_losses)] if self.eval_losses else None,
            "stopped": self.stopped,
            "stop_reason": self.stop_reason,
        }


def train(
    ctx: RunContext,
    training: TrainingSpec | None = None,
    *,
    adapter=None,
    stop_requested: Callable[[], bool] | None = None,
    on_step: OnStep | None = None,
    verbose: bool = True,
) -> TrainResult:
    """Train ``training.model.name`` (or ``adapter``) to ``training.optimizer.steps``, resuming from
    ``ctx.run_dir``'s newest complete checkpoint. In every step the ranks agree on the task
    signals (``ctx.preemption``, in the step's fused all_reduce: a signal that arrives after
    it counts in the next step), and before every step ask ``stop_requested()`` (it must
    answer the same on every rank); on a stop every rank saves a checkpoint. ``on_step(step, record)``
    runs on every rank after each step: the metrics record plus ``sample_ids`` (this rank's
    dataset samples of the step, one list per micro-batch)."""
    engine = Engine(ctx, training, adapter=adapter, verbose=verbose)
    result = TrainResult(
        model=engine.model, optimizer=engine.optimizer, start_step=engine.start_step, last_step=engine.start_step
    )
    try:
        for number in engine.open_steps():
            if stop_requested is not None and stop_requested():  # the same answer on every rank
                result.stopped, result.stop_reason = True, "requested"
                break
            if _one_step(engine, number, result, on_step):
                break
    finally:
        engine.close_steps()
    engine.finish(result.stop_reason)  # on a stop signal and at the end: the synchronous checkpoint
    return result


def _one_step(engine: Engine, number: int, result: TrainResult, on_step: OnStep | None) -> bool:
    """Step ``number`` of the built-in loop, its record and its periodic checkpoint; True when
    the ranks agreed (in the step's all_reduce) to stop after it."""
    step = engine.begin_step(number)
    number = step.number  # a replica group that healed from a peer goes on from the peer's step
    values = engine.train_step(step).tolist()  # the step's one host sync
    loss, grad_norm, agreed = values[:3]
    if not step.committed:  # a replica group was lost in the step: the live ones train it again
        return False
    stopping = engine.agreed_stop(agreed, number)  # the ranks' signals: all stop after this step, or none
    record = engine.step_record(step, loss=loss, grad_norm=grad_norm, source_losses=values[3:])
    if not stopping and engine.evaluate_if_due(record) is not None:
        result.eval_losses[number] = record["eval_loss"]
    result.losses[number] = loss
    result.last_step = number
    engine.publish(record, step_line(record, engine.training.optimizer.steps))
    if on_step is not None:
        on_step(number, dict(record, sample_ids=[b.sample_ids.tolist() for b in step.batches]))
    engine.step_done(step)  # where a debugger session agreed in the step runs
    if engine.quit_reason is not None and not stopping:
        result.stopped, result.stop_reason = True, engine.quit_reason
        return True
    if stopping:
        preemption = engine.ctx.preemption
        assert preemption is not None and preemption.stop_reason is not None  # agreed_stop: a signal was agreed
        result.stopped, result.stop_reason = True, preemption.stop_reason
        engine.announce_stop(preemption.stop_reason, number)
        return True
    engine.save_if_due(number)
    return False


def payload(ctx: RunContext) -> dict:
    """What ``hpc-hsdp run`` trains without ``--entry``: :func:`train`, then the summary."""
    return train(ctx).summary(ctx)
