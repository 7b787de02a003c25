"""Your own training loop with the built-in loop's guarantees: ``hpc_hsdp.TrainingRun``.

An ``--entry`` function gets the run context; :class:`TrainingRun` gives it the rest::

    import hpc_hsdp

    def main(ctx):                              # hpc-hsdp run --entry mine:main --model hf:DIR --data DATA
        run = hpc_hsdp.TrainingRun(ctx)         # model built, sharded, initialised or loaded; resumed
        for step in run.steps():                # stops at --steps, or where the ranks agree to stop
            for batch in step.batches:          # this rank's micro-batches (--grad-accum of them)
                loss = run.loss(batch.inputs, batch.targets)
                (loss / len(step.batches)).backward()
            run.clip_grad_norm(1.0)             # over the whole mesh (replicate, shard, tp)
            run.optimizer.step()
            run.optimizer.zero_grad()
            run.state["seen"] = run.state.get("seen", 0) + 1   # your own JSON state, checkpointed
            run.log(step, loss=loss)            # one metrics.jsonl line (global mean), rank 0 writes
        return run.finish()                     # final checkpoint; the summary

It is the public face of the engine the built-in loop runs on
(:class:`hpc_hsdp.task.training.engine.Engine`): what one gets, the other has.

- **Model**: the adapter of ``--model`` (or the ``adapter=`` you pass), built on meta,
  ``fully_shard`` per shard unit then the root on the ``("replicate", "shard")`` mesh,
  materialized, initialised from the seed or loaded from pretrained weights; the data is
  checked against its vocabulary before step 1. ``run.model``, ``run.optimizer`` (AdamW,
  or ``optimizer=fn(model)``), ``run.adapter``.
- **Data**: the token-file sampler of ``--data`` (synthetic tokens without it): this rank's
  rows of each step's global batch, prefetched; the global batch of step k depends only on
  ``(seed, k, global batch size)``, so a resumed run sees exactly the samples it would have.
- **Stopping**: before every step all ranks agree (one collective) on the task's signals
  (the warning signal, SIGTERM); on a stop every rank saves and ``steps()`` ends;
  ``run.stopped`` says why. ``hpc-hsdp run`` then requeues as for the built-in loop.
- **Hangs**: the watchdog of ``--hang-timeout``: when no step completes in time every rank
  writes its stacks, rank 0 names the ranks that never reached the collective, the job ends
  (and is requeued inside SLURM).
- **Checkpoints**: every ``--checkpoint-every`` steps (written in the background while the
  next steps train), at a stop and in :meth:`finish`: model, optimizer, the data position and
  ``run.state`` (any JSON-able dict) in the atomic distributed checkpoint; a new start of the
  same ``--run-dir`` resumes all four.
- **Learning rate**: set from ``--lr-schedule`` before each step (``step.lr``); change the
  optimizer's groups after that if you schedule it yourself.
- **Metrics**: :meth:`log` (collective: every rank calls it) writes ``step``, ``loss`` (the
  global mean), ``lr``, ``tokens_per_s``, ``step_time_s``, ``cpu_time_s``, ``data_wait_s``,
  peak memory, the mesh, ``comm`` (``--comm-stats``), your own numbers, the stragglers entry
  (``--straggler-every``), ``eval_loss`` (``--eval-every``) and ``wall_time`` to
  ``metrics.jsonl`` and TensorBoard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.training.engine import Engine, Step

__all__ = ["Step", "TrainingRun"]


class TrainingRun:
    """A custom loop's model, optimizer, data, stop agreement, watchdog, checkpoints and
    metrics: the engine's public face (see the module docstring)."""

    def __init__(
        self,
        ctx: RunContext,
        training: TrainingSpec | None = None,
        *,
        adapter=None,
        optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
        verbose: bool = True,
    ) -> None:
        self.ctx = ctx
        self.engine = Engine(ctx, training, adapter=adapter, optimizer=optimizer, verbose=verbose)
        self.training = self.engine.training
        self.stopped: str | None = None
        """Why :meth:`steps` ended early: ``"USR2"``, ``"TERM"``, ``"requested"``, or None."""
        self._current: Step | None = None

    model = property(lambda self: self.engine.model)
    optimizer = property(lambda self: self.engine.optimizer)
    adapter = property(lambda self: self.engine.adapter)
    data = property(lambda self: self.engine.data)
    precision = property(lambda self: self.engine.precision)
    start_step = property(lambda self: self.engine.start_step)
    """Step of the checkpoint the run resumed from (0: fresh start)."""
    last_step = property(lambda self: self.engine.last_step)
    """The last step completed (logged, or ended by the loop's body)."""

    @property
    def state(self) -> dict:
        """Your own JSON-able state: saved in every checkpoint, restored on resume."""
        return self.engine.state

    # ------------------------------------------------------------------ the steps

    def steps(self, stop_requested: Callable[[], bool] | None = None) -> Iterator[Step]:
        """The steps left to ``--steps``: before each, the stop agreement (collective) and
        the due checkpoint of the step before (written in the background). ``stop_requested()``
        must answer the same on every rank."""
        engine = self.engine
        try:
            for number in engine.open_steps():
                done = number - 1
                reason = engine.agree_stop(done, stop_requested)
                if reason is not None:
                    self.stopped = reason
                    engine.announce_stop(reason, done)
                    break
                if done > engine.start_step:
                    engine.save_if_due(done)
                self._current = engine.begin_step(number)
                yield self._current
                engine.last_step = max(engine.last_step, number)
                engine.step_done(self._current)
        finally:
            engine.close_steps()
        self.finish()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss on a micro-batch (the adapter's: mean cross-entropy in fp32)."""
        return self.engine.loss(inputs, targets)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Collective, after the backward: the gradient norm over the whole mesh (replicate, shard
        and tp), the gradients scaled to at most ``max_norm``; works where torch's
        ``clip_grad_norm_`` cannot (gradients on different meshes under ``--tp``)."""
        return self.engine.clip_grad_norm(max_norm)

    def log(self, step: Step | int, *, loss: torch.Tensor | float, **more) -> dict:
        """Collective, after the step's optimizer step: the global mean of ``loss`` over all
        ranks and one metrics.jsonl record (rank 0 writes; every rank gets it back); marks the
        step done. ``more``: your own JSON-able numbers."""
        engine, number = self.engine, int(step)
        value = loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        value = value.to(self.ctx.device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        current = self._current if self._current is not None and self._current.number == number else number
        record = engine.step_record(current, loss=float(value) / self.ctx.world_size, more=more)
        engine.evaluate_if_due(record)
        line = f"step {number:>5}/{self.training.optimizer.steps}  loss {record['loss']:.4f}"
        if "eval_loss" in record:
            line += f"  eval {record['eval_loss']:.4f}"
        if record["step_time_s"] is not None:
            line += f"  {record['step_time_s'] * 1000:.0f} ms"
        return engine.publish(record, line)  # the step is done (a break after it keeps it)

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        """Collective: checkpoint the last completed step (model, optimizer, data position, ``state``)."""
        self.engine.save()

    def finish(self) -> dict:
        """Collective: the final checkpoint (once); returns the run's summary."""
        self.engine.finish(self.stopped)
        return dict(
            self.engine.summary(),
            stopped=self.stopped is not None,
            stop_reason=self.stopped,
            state=dict(self.state),
        )
