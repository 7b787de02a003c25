"""Your own training loop with the built-in loop's guarantees: ``hpc_hsdp.TrainingRun``.

An ``--entry`` function gets the run context; :class:`TrainingRun` gives it the rest::

    import hpc_hsdp

    def main(ctx):                              # hpc-hsdp run --entry mine:main --model hf:DIR --data DATA
        run = hpc_hsdp.TrainingRun(ctx)         # model built, sharded, initialised or loaded; resumed
        for step in run.steps():                # stops at --steps, or where the ranks agree to stop
            for batch in step.batches:          # this rank's micro-batches (--grad-accum of them)
                loss = run.loss(batch.inputs, batch.targets)
                (loss / len(step.batches)).backward()
            run.optimizer.step()
            run.optimizer.zero_grad()
            run.state["seen"] = run.state.get("seen", 0) + 1   # your own JSON state, checkpointed
            run.log(step, loss=loss)            # one metrics.jsonl line (global mean), rank 0 writes
        return run.finish()                     # final checkpoint; the summary

What it does, with the built-in loop's own parts (:mod:`hpc_hsdp.runtime.loop`):

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
- **Checkpoints**: every ``--checkpoint-every`` steps, at a stop and in :meth:`finish`:
  model, optimizer, the data position and ``run.state`` (any JSON-able dict) in the atomic
  distributed checkpoint; a new start of the same ``--run-dir`` resumes all four.
- **Learning rate**: set from ``--lr-schedule`` before each step (``step.lr``); change the
  optimizer's groups after that if you schedule it yourself.
- **Metrics**: :meth:`log` (collective: every rank calls it) writes ``step``, ``loss`` (the
  global mean), ``lr``, ``tokens_per_s``, ``step_time_s``, ``data_wait_s``, peak memory,
  the mesh, ``wall_time`` and your own numbers to ``metrics.jsonl``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.runtime import faults
from hpc_hsdp.runtime.dist import RunContext
from hpc_hsdp.runtime.loader import MicroBatch
from hpc_hsdp.runtime.loop import (
    MetricsLog,
    build_model,
    check_data,
    configure_device,
    control_group,
    make_loader,
    make_optimizer,
    open_data,
    peak_memory,
    record_model,
    reset_peak_memory,
    resolve_precision,
    resume,
    save_checkpoint,
    seed_step,
    should_stop,
)
from hpc_hsdp.runtime.observer import RunObserver
from hpc_hsdp.runtime.schedule import lr_of


@dataclass
class Step:
    """One optimizer step of :meth:`TrainingRun.steps`: its number, learning rate and this rank's micro-batches."""

    number: int
    lr: float
    batches: list[MicroBatch]
    data_wait_s: float

    def __int__(self) -> int:
        return self.number


class TrainingRun:
    """A custom loop's model, optimizer, data, stop agreement, checkpoints and metrics (see the module docstring)."""

    def __init__(
        self,
        ctx: RunContext,
        training: TrainingSpec | None = None,
        *,
        adapter=None,
        optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
        verbose: bool = True,
    ) -> None:
        from hpc_hsdp.models import resolve_model

        self.ctx = ctx
        self.training = training or getattr(ctx.spec, "training", None) or TrainingSpec()
        self.verbose = verbose
        self.data = open_data(self.training, ctx.world_size)
        self.adapter = adapter or resolve_model(self.training, data_vocab_size=self.data.vocab_size)
        check_data(self.data, model_vocab_size=self.adapter.vocab_size, training=self.training)
        record_model(ctx, self.adapter, self.training)
        self.precision = resolve_precision(self.training.precision, ctx.device)
        configure_device(ctx.device)
        self.model = build_model(ctx, self.adapter, self.training, precision=self.precision, verbose=verbose)
        self.optimizer = optimizer(self.model) if optimizer is not None else make_optimizer(self.model, self.training)
        self.start_step, saved = resume(
            ctx, self.model, self.optimizer, data=self.data, training=self.training, verbose=verbose
        )
        self.state: dict = dict(saved.get("extra") or {})
        """Your own JSON-able state: saved in every checkpoint, restored on resume."""
        self.last_step = self.start_step
        self.stopped: str | None = None
        """Why :meth:`steps` ended early: ``"USR2"``, ``"TERM"``, ``"requested"``, or None."""
        self._observer = RunObserver.start(ctx, self.training, start_step=self.start_step, verbose=verbose)
        self._metrics = MetricsLog(ctx, start_step=self.start_step)
        self._saved_step = self.start_step or None
        self._group = control_group(ctx)
        self._began = time.time()
        self._step_started = 0.0
        self._current: Step | None = None
        self._loader = None
        self._finished = False

    # ------------------------------------------------------------------ the steps

    def steps(self, stop_requested: Callable[[], bool] | None = None) -> Iterator[Step]:
        """The steps left to ``--steps``: before each, the stop agreement (collective) and
        the due checkpoint of the step before. ``stop_requested()`` must answer the same on
        every rank."""
        training = self.training
        self.model.train()
        self._loader = make_loader(self.ctx, self.data, first_step=self.start_step + 1, last_step=training.steps)
        try:
            for number in range(self.start_step + 1, training.steps + 1):
                done = number - 1
                every = training.checkpoint_every
                if done > self.start_step and every and done % every == 0:
                    self.save()
                reason = should_stop(self.ctx, done, stop_requested=stop_requested, group=self._group)
                if reason is not None:
                    self.stopped = reason
                    if self.ctx.is_rank0 and self.verbose:
                        print(f"[hpc-hsdp] {reason}: every rank stops after step {done} and saves", flush=True)
                    break
                faults.at_step(self.ctx.rank, number)
                seed_step(training.seed, number, self.ctx.rank)
                reset_peak_memory(self.ctx.device)
                self._step_started = time.perf_counter()
                self._observer.step_begins(number)
                batches, waited = self._loader.next_step(number)
                lr = lr_of(training, number)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self._current = Step(number=number, lr=lr, batches=batches, data_wait_s=waited)
                yield self._current
                self.last_step = number
        finally:
            self._loader.close()
        self.finish()

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss on a micro-batch (the adapter's: mean cross-entropy in fp32)."""
        return self.adapter.loss(self.model, inputs, targets)

    def log(self, step: Step | int, *, loss: torch.Tensor | float, **more) -> dict:
        """Collective, after the step's optimizer step: the global mean of ``loss`` over all
        ranks and one metrics.jsonl record (rank 0 writes; every rank gets it back); marks the
        step done. ``more``: your own JSON-able numbers."""
        number = int(step)
        value = loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        value = value.to(self.ctx.device)
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        step_time = time.perf_counter() - self._step_started
        tokens = self.data.layout.global_batch * self.training.seq_len
        current = self._current if self._current is not None and self._current.number == number else None
        record = {
            "step": number,
            "loss": float(value) / self.ctx.world_size,
            "lr": current.lr if current else None,
            "tokens_seen": number * tokens,
            "tokens_per_s": tokens / step_time if step_time > 0 else None,
            "step_time_s": step_time,
            "data_wait_s": current.data_wait_s if current else None,
            **peak_memory(self.ctx.device),
            "world_size": self.ctx.world_size,
            "shard_size": self.ctx.plan.shard_size,
            "num_replicas": self.ctx.plan.num_replicas,
            "grad_accum": self.data.layout.grad_accum,
            "global_batch": self.data.layout.global_batch,
            "precision": self.precision,
            **more,
            "wall_time": time.time(),
        }
        record["elapsed_s"] = record["wall_time"] - self._began
        self.last_step = max(self.last_step, number)  # logged: the step is done (a break after it keeps it)
        self._observer.step_ends(number, record)  # every K steps: each rank's own time (collective)
        self._observer.write(record)
        self._metrics.write(record)
        if self.ctx.is_rank0 and self.verbose:
            print(
                f"step {number:>5}/{self.training.steps}  loss {record['loss']:.4f}  {step_time * 1000:.0f} ms",
                flush=True,
            )
        return record

    # ------------------------------------------------------------------ checkpoints

    def save(self) -> None:
        """Collective: checkpoint the last completed step (model, optimizer, data position, ``state``)."""
        if self.ctx.run_dir is None or self.last_step == 0 or self._saved_step == self.last_step:
            return
        path = save_checkpoint(
            self.ctx,
            self.model,
            self.optimizer,
            step=self.last_step,
            training=self.training,
            data=self.data,
            model_name=self.adapter.name,
            extra=self.state,
        )
        self._saved_step = self.last_step
        if self.ctx.is_rank0 and self.verbose:
            print(f"[hpc-hsdp] checkpoint {path}", flush=True)

    def finish(self) -> dict:
        """Collective: the final checkpoint (once); returns the run's summary."""
        if not self._finished:
            self._finished = True
            if self._loader is not None:
                self._loader.close()
            self.save()
            self._observer.finish(self.stopped, self.last_step)
            sys.stdout.flush()
        return {
            "rank": self.ctx.rank,
            "world_size": self.ctx.world_size,
            "shard_size": self.ctx.plan.shard_size,
            "start_step": self.start_step,
            "steps": self.last_step,
            "stopped": self.stopped is not None,
            "stop_reason": self.stopped,
            "state": dict(self.state),
        }
