"""The one engine under both training loops: the built-in :func:`hpc_hsdp.task.training.loop.train`
and people's own loops (:class:`hpc_hsdp.TrainingRun`, its public face).

:class:`Engine` owns, for one run on one rank: the data and its position (the prefetching
loader), the model (built on meta, sharded, materialized, initialised or resumed), the
optimizer and the learning-rate schedule, the per-step seeding, the stop agreement on the
task's signals, the hang watchdog, the checkpoints (periodic ones written in the background
by the :class:`~hpc_hsdp.task.checkpointing.checkpoint.AsyncSaver`, synchronous ones at a stop and at the
end), the metrics (``metrics.jsonl``, the observer: stragglers, TensorBoard, attempts), the
communication statistics and the test hooks of :mod:`hpc_hsdp.task.resilience.injected_faults`. What differs
between an ordinary job and a replica group (which step, which rows, the gradient reduction
and the commit, who writes) is its step coordinator's (:mod:`hpc_hsdp.task.training.coordinator`).

A loop drives it step by step, every rank the same::

    engine = Engine(ctx, training)             # collective: build, shard, resume
    for number in engine.open_steps():         # collective: watchdog (restart budget), the steps
        step = engine.begin_step(number)       # hooks, seed, clocks, this rank's batches, lr
        ...                                    # forward, backward, optimizer step
        record = engine.step_record(step, loss=..., grad_norm=...)  # + comm stats, stragglers
        engine.evaluate_if_due(record)         # collective on --eval-every steps
        engine.publish(record)                 # metrics.jsonl, TensorBoard, the step's line
        engine.step_done(step)                 # hooks, watchdog
        if stopping: break
        engine.save_if_due(number)             # --checkpoint-every, in the background
    engine.finish(stop_reason)                 # collective: the final checkpoint, attempt ends

The stop agreement comes in two kinds: the built-in loop adds :attr:`Engine.stop_code` to its
step's one fused all_reduce and reads the result with :meth:`Engine.agreed_stop`; an own loop
agrees with :meth:`Engine.agree_stop` (one small collective) at each step boundary.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpc_hsdp.batch_shell import eval_job
from hpc_hsdp.data.sampler import MixtureOrder
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.models import resolve_model
from hpc_hsdp.plan.mixture import rows_after, rows_of_step
from hpc_hsdp.task.checkpointing import checkpoint
from hpc_hsdp.task.checkpointing.checkpoint_upload import StoreUploads
from hpc_hsdp.task.observation.debugger import QUIT, DebugPoint
from hpc_hsdp.task.observation.log import note, say
from hpc_hsdp.task.observation.observer import RunObserver
from hpc_hsdp.task.parallelism.compile import CompileClock, use_run_cache
from hpc_hsdp.task.parallelism.device import (
    check_training_device,
    configure_device,
    peak_memory,
    reset_peak_memory,
    resolve_precision,
)
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.parallelism.tensor_parallel import local_value
from hpc_hsdp.task.resilience import injected_faults
from hpc_hsdp.task.resilience.preemption import join_stop_code, split_stop_code
from hpc_hsdp.task.resilience.watchdog import Watchdog
from hpc_hsdp.task.training.coordinator import StepCoordinator, coordinator_for
from hpc_hsdp.task.training.loader import MicroBatch
from hpc_hsdp.task.training.metrics_writer import metrics_log
from hpc_hsdp.task.training.model import build_model, make_optimizer, record_model
from hpc_hsdp.task.training.run_data import (
    TrainData,
    check_data,
    eval_samples,
    open_data,
    source_eval_samples,
)
from hpc_hsdp.task.training.schedule import lr_of
from hpc_hsdp.task.training.staging import start_staging
from hpc_hsdp.task.training.step import clip_grad_norm, evaluate, seed_step


@dataclass
class Step:
    """One optimizer step: its number, learning rate and this rank's micro-batches."""

    number: int
    lr: float
    batches: list[MicroBatch]
    data_wait_s: float
    started: float = field(default=0.0, repr=False)
    """``time.perf_counter()`` when the step began."""
    cpu_started: float = field(default=0.0, repr=False)
    """``time.process_time()`` when the step began."""
    committed: bool = True
    """False: the coordinator did not commit the step (:meth:`Engine.train_step`): it comes again."""

    def __int__(self) -> int:
        return self.number


def control_group(ctx: RunContext):
    """A gloo group for the per-step stop agreement on GPU runs, so that it costs no device
    sync (None on CPU: the default gloo group serves)."""
    return dist.new_group(backend="gloo") if ctx.device.type == "cuda" else None


def should_stop(
    ctx: RunContext,
    last_step: int,
    *,
    stop_requested: Callable[[], bool] | None = None,
    group=None,
    debug_code: int = 0,
) -> str | None:
    """Collective, at a step boundary: the agreed reason to stop (``"USR2"``, ``"TERM"``,
    ``"requested"``) or None. Every rank must call it at the same boundaries. ``debug_code``:
    rank 0's request of ``hpc-hsdp debug``, agreed in the same collective
    (``ctx.preemption.agreed_debug``)."""
    preemption = ctx.preemption
    if preemption is not None:
        device = torch.device("cpu") if group is not None else ctx.device
        if preemption.should_stop(last_step, device=device, group=group, debug_code=debug_code):
            return preemption.stop_reason
    if stop_requested is not None and stop_requested():
        return "requested"
    return None


def _ended_by(observer: RunObserver) -> Callable[..., None]:
    """The engine's part of its context's teardown (:attr:`~hpc_hsdp.task.parallelism.dist.RunContext.teardown`):
    after an exception the observer records it, then the saves still in flight are committed."""

    def end(exc_type, exc, traceback) -> None:
        try:
            if exc is not None:
                observer.close_on_error(exc, None)
        finally:
            checkpoint.finish_open_saves()

    return end


class Engine:
    """See the module docstring. Collective constructor: every rank builds its engine."""

    def __init__(
        self,
        ctx: RunContext,
        training: TrainingSpec | None = None,
        *,
        adapter=None,
        optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
        coordinator: StepCoordinator | None = None,
        verbose: bool = True,
    ) -> None:
        self.ctx = ctx
        self.training = training or (ctx.spec.training if ctx.spec is not None else None) or TrainingSpec()
        self.coordinator = coordinator or coordinator_for(ctx, self.training)
        """What an ordinary job and a replica group do differently (default: the options' choice)."""
        self.verbose = verbose
        check_training_device(self.training.compute, ctx.device)  # before anything is written (model.json, the cache)
        self.compile_clock: CompileClock | None = None
        self.data: TrainData = open_data(self.training, ctx.data_world_size)
        staging = (
            start_staging(ctx, self.data, self.training.dataset.stage_data)
            if self.training.dataset.stage_data
            else None
        )
        self.adapter = adapter or resolve_model(self.training, data_vocab_size=self.data.vocab_size)
        self.data = self.data.drawn_from(self.adapter.vocab_size)
        self._build(optimizer)  # while each node copies its token files (--stage-data)
        if staging is not None:  # collective: every node's copies ready, read from them from now on
            staging.finish(verbose=verbose)
        self.uploads = StoreUploads.for_run(ctx, self.training.checkpoint)  # None without --checkpoint-store
        self.start_step, saved = checkpoint.resume(
            ctx,
            self.model,
            self.optimizer,
            data=self.data,
            training=self.training,
            verbose=verbose,
            model_layout=getattr(self.adapter, "layout", None),
            uploads=self.uploads,
        )
        self.state: dict = dict(saved.get("extra") or {})
        """A loop's own JSON-able state: saved in every checkpoint, restored on resume."""
        self.coordinator.open(
            self.data,
            self.adapter,
            self.model,
            self.optimizer,
            start_step=self.start_step,
            state=self.state,
            save_now=self._save_now,
        )
        self.last_step = self.start_step
        """The last step completed."""
        self.saved_step: int | None = self.start_step or None
        self.observer = RunObserver.start(ctx, self.training, start_step=self.start_step, verbose=verbose)
        ctx.teardown.push(_ended_by(self.observer))  # from now on an error ends the attempt's record
        self.metrics = metrics_log(ctx, start_step=self.start_step)  # after the observer: it reads the old records
        self.sources = self.data.source_names
        """A mixture's source names (empty: one dataset): ``loss/NAME``, ``tokens/NAME``, ``eval_loss/NAME``."""
        self.evaluation = (
            eval_samples(self.data, self.training)
            if self.data.val is not None and self.training.evaluation.eval_every
            else None
        )
        self.source_evaluation = (
            source_eval_samples(self.data, self.training) if self.training.evaluation.eval_every else {}
        )
        self.tokens_per_step = self.data.layout.global_batch * self.training.dataset.seq_len
        self.began = time.time()
        self.periodic = checkpoint.AsyncSaver.for_run(
            ctx, self.training.checkpoint, uploads=self.uploads
        )  # None without --checkpoint-every
        self.watchdog: Watchdog | None = None
        self.debug_point = DebugPoint(ctx) if getattr(self.coordinator, "debuggable", False) else None
        """``hpc-hsdp debug``'s side on the ranks, agreed at the step boundaries (where the coordinator allows)."""
        self._debug_due: int | None = None
        self.quit_reason: str | None = None
        """``"debugger"`` once a debugger session ended with quit: every rank stops after this step."""
        self._number = self.start_step
        self._stop_group = None
        self._agreement_ready = False
        self._finished = False
        self._evals_checked: int | None = None
        self.submit_evals()  # catch-up: the complete checkpoints of earlier attempts without an eval job

    def _build(self, optimizer) -> None:
        ctx, training = self.ctx, self.training
        check_data(self.data, model_vocab_size=self.adapter.vocab_size, training=training)
        record_model(ctx, self.adapter, training)
        self.precision = resolve_precision(training.compute.precision, ctx.device)
        configure_device(ctx.device)
        if training.compute.compile:
            use_run_cache(ctx.run_dir, ctx.rank)  # before the first compile: a resumed attempt loads its graphs
            self.compile_clock = CompileClock()
        self.model = build_model(ctx, self.adapter, training, precision=self.precision, verbose=self.verbose)
        self.optimizer = (
            optimizer(self.model) if optimizer is not None else make_optimizer(self.model, training.optimizer)
        )
        if self.precision == "fp8":
            from hpc_hsdp.task.parallelism.float8 import precompute_scales_after_each_step  # noqa: PLC0415 - torchao

            precompute_scales_after_each_step(self.model, self.optimizer)

    # ------------------------------------------------------------------ the steps

    def open_steps(self):
        """Collective, once: training mode, the watchdog (which first refuses a job past
        ``--max-restarts``); the steps left, as the coordinator gives them (after the last
        completed one; the ordinary job's rows read ahead from there)."""
        self.model.train()
        self.watchdog = Watchdog.for_run(
            self.ctx, self.training.resilience, step=self.start_step
        )  # a hang ends the job
        if self.compile_clock is not None:  # a compile (minutes on a large model) is no hang
            self.watchdog.busy = self.compile_clock.compiling
        return self.coordinator.steps(lambda: self.last_step)

    def close_steps(self) -> None:
        """Stop the watchdog (nothing after the last step may count as a hang) and the reading ahead."""
        if self.watchdog is not None:
            self.watchdog.stop()
        self.coordinator.close_steps()

    def begin_step(self, number: int) -> Step:
        """The test hooks, the step's seed, its clocks, this rank's micro-batches and its learning rate."""
        injected_faults.at_step(self.ctx.rank, number)  # test hooks (HPC_HSDP_FAULT_*); no-ops otherwise
        self._number = number
        seed_step(self.training.optimizer.seed, number, self.ctx.data_rank)  # a tp group draws alike
        started, cpu_started = time.perf_counter(), time.process_time()
        self.observer.step_begins(number)
        reset_peak_memory(self.ctx.device)
        if self.ctx.comm_stats is not None:
            self.ctx.comm_stats.reset()
        number, batches, waited = self.coordinator.begin(number)  # a replica group may go on from a peer's step
        return Step(
            number=number,
            lr=lr_of(self.training.optimizer, number),
            batches=batches,
            data_wait_s=waited,
            started=started,
            cpu_started=cpu_started,
        )

    def train_step(self, step: Step) -> torch.Tensor:
        """The built-in step (:func:`hpc_hsdp.task.training.step.train_step` in an ordinary job) with
        this run's settings and the stop agreement fused into its all_reduce: ``[loss,
        grad_norm, agreed stop code, ...]``; sets ``step.committed``."""
        out, step.committed = self.coordinator.train_step(step.batches, lr=step.lr, stop_code=self.stop_code)
        return out

    def source_fields(self, number: int, losses: list[float] | None = None) -> dict:
        """A mixture's per-source fields of step ``number``'s record: ``tokens/NAME`` (the
        step's tokens drawn from each source: a pure function of the step), ``epoch/NAME`` (the
        whole passes over each source after the step) and, given the
        per-source losses that :meth:`train_step` returns after its first three values,
        ``loss/NAME`` (a source without rows in the step has none)."""
        order = self.data.order
        if not self.sources or not isinstance(order, MixtureOrder):
            return {}
        rows = rows_of_step(order.mixture, number, self.data.layout.global_batch)
        used = rows_after(order.mixture, number, self.data.layout.global_batch)
        out: dict = {}
        for index, name in enumerate(self.sources):
            if losses is not None and index < len(losses) and losses[index] == losses[index]:  # not nan
                out[f"loss/{name}"] = losses[index]
        for name, count, total, size in zip(self.sources, rows, used, order.sizes):
            out[f"tokens/{name}"] = count * self.training.dataset.seq_len
            out[f"epoch/{name}"] = total // size  # whole passes over the source so far (it wraps)
        return out

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The model's loss on a micro-batch (the adapter's: mean cross-entropy in fp32), a plain
        tensor to call ``backward()`` on. Under tensor parallelism the logits are gathered for it
        (the built-in loop computes it on the vocabulary shards instead)."""
        return local_value(self.adapter.loss(self.model, inputs, targets))

    def clip_grad_norm(self, max_norm: float) -> float:
        """Collective: the gradient norm over the whole mesh, the gradients scaled to at most
        ``max_norm`` (:func:`~hpc_hsdp.task.training.step.clip_grad_norm`)."""
        norm = clip_grad_norm(self.model, max_norm, self.ctx.dims)
        return float(norm)

    def step_record(
        self, step: Step | int, *, loss: float, lr: float | None = None, source_losses=None, **fields
    ) -> dict:
        """The step's metrics record: ``step``, ``loss``, ``lr``, then ``fields`` given first
        (``grad_norm``), the throughput, a mixture's per-source fields (``source_losses``: what
        :meth:`train_step` returns after its first three values), clocks, peak memory, the mesh and precision, ``comm``
        (``--comm-stats``), ``compile_s`` and ``compile_cache`` (``--compile``, on the steps the
        compiler ran: the first, and any recompile), ``more`` (a loop's own numbers, a dict) and the stragglers entry
        (collective on its probed steps)."""
        number = int(step)
        current = step if isinstance(step, Step) else None
        more = fields.pop("more", None)
        step_time = time.perf_counter() - current.started if current is not None else None
        cpu_time = time.process_time() - current.cpu_started if current is not None else None
        ctx, layout = self.ctx, self.data.layout
        record = {
            "step": number,
            "loss": loss,
            "lr": current.lr if lr is None and current is not None else lr,
            **fields,
            "tokens_seen": number * self.tokens_per_step,
            "tokens_per_s": self.tokens_per_step / step_time if step_time else None,
            "step_time_s": step_time,
            "cpu_time_s": cpu_time,
            "data_wait_s": current.data_wait_s if current is not None else None,
            **peak_memory(ctx.device),
            "world_size": ctx.world_size,
            "shard_size": ctx.plan.shard_size,
            "num_replicas": ctx.plan.num_replicas,
            "grad_accum": layout.grad_accum,
            "global_batch": layout.global_batch,
            "precision": self.precision,
            **self.coordinator.take_record_fields(),
        }
        if ctx.comm_stats is not None:
            record["comm"] = ctx.comm_stats.take()
        if self.sources:
            record.update(self.source_fields(number, source_losses))
        if self.compile_clock is not None:  # the compiler's seconds inside this step, apart from its time
            record.update(self.compile_clock.take())
        if more:
            record.update(more)
        if step_time is not None:
            self.observer.step_ends(number, record)  # every K steps: each rank's own time, the slowest named
        return record

    def evaluation_due(self, number: int) -> bool:
        every = self.training.evaluation.eval_every
        has = self.evaluation is not None or bool(self.source_evaluation)
        return has and (number % every == 0 or number == self.training.optimizer.steps)

    def evaluate_if_due(self, record: dict) -> float | None:
        """Collective on ``--eval-every`` steps (and the last): the held-out mean loss into the
        record (``eval_loss``, ``eval_time_s``)."""
        if not self.evaluation_due(record["step"]):
            return None
        started = time.perf_counter()
        if self.source_evaluation:  # a mixture: each source on its own val split; eval_loss their weighted mean
            assert isinstance(self.data.order, MixtureOrder)  # source_vals are a mixture's
            shares = dict(zip(self.sources, self.data.order.mixture.shares))
            for name, (val, ids) in self.source_evaluation.items():
                record[f"eval_loss/{name}"] = evaluate(
                    self.ctx, self.model, self.adapter, val, ids, rows_per_rank=self.data.layout.rank_batch
                )
            record["eval_loss"] = sum(float(shares[n]) * record[f"eval_loss/{n}"] for n in self.source_evaluation)
        else:
            assert self.evaluation is not None  # evaluation_due
            record["eval_loss"] = evaluate(
                self.ctx,
                self.model,
                self.adapter,
                self.data.val,
                self.evaluation,
                rows_per_rank=self.data.layout.rank_batch,
            )
        record["eval_time_s"] = time.perf_counter() - started
        return record["eval_loss"]

    def publish(self, record: dict, line: str | None = None) -> dict:
        """The finished record: ``wall_time``, ``elapsed_s``; TensorBoard and metrics.jsonl
        (rank 0), and ``line`` on rank 0's stdout."""
        record["wall_time"] = time.time()
        record["elapsed_s"] = record["wall_time"] - self.began
        self.last_step = max(self.last_step, record["step"])
        self.observer.write(record)
        if self.coordinator.leads:  # one record per step
            self.metrics.write(record)
        if line is not None and self.verbose and self.coordinator.prints_step_lines:
            say(line, tag=False)
        return record

    def step_done(self, step: Step) -> None:
        """After the step and its record: the sample-id hook, the watchdog's progress."""
        injected_faults.after_step(self.coordinator.rank_label, self.ctx.world_size, step.number, step.batches)
        if self.watchdog is not None:
            self.watchdog.step_done(step.number)
        if self._debug_due is not None:  # agreed in the step's all_reduce
            rank, self._debug_due = self._debug_due, None
            self._debug(step.number, rank)
        if self.saved_step != self._evals_checked and (self.periodic is None or self.periodic.in_flight is None):
            self.submit_evals()  # a background save was committed since

    # ------------------------------------------------------------------ stopping

    @property
    def stop_code(self) -> Callable[[], int] | None:
        """This rank's code for a fused agreement (``train_step(..., stop_code=)``): its signals',
        and on rank 0 a debugger request due after the step (:mod:`hpc_hsdp.task.observation.debugger`)."""
        preemption = self.ctx.preemption
        if preemption is None:
            return None
        debug_point = self.debug_point
        if debug_point is None:
            return lambda: preemption.local_code
        return lambda: join_stop_code(preemption.local_code, debug_point.request_code(self._number))

    def agreed_stop(self, code: float, number: int) -> bool:
        """Whether the code the ranks agreed on in the step's all_reduce stops them after step
        ``number`` (after the last one the run is done: nothing to stop or requeue). A debugger
        request in it stops its rank in :meth:`step_done`."""
        preemption = self.ctx.preemption
        debug_code = split_stop_code(int(code))[1]
        if debug_code and self.debug_point is not None:
            self._debug_due = debug_code - 1
        return preemption is not None and number < self.training.optimizer.steps and preemption.agree(int(code), number)

    def agree_stop(self, done: int, stop_requested: Callable[[], bool] | None = None) -> str | None:
        """Collective, at the boundary after step ``done``: the agreed reason to stop or None
        (``"debugger"``: a debugger session at this boundary ended with quit)."""
        if not self._agreement_ready:
            self._stop_group, self._agreement_ready = control_group(self.ctx), True
        debug_code = self.debug_point.request_code(done) if self.debug_point is not None else 0
        reason = should_stop(
            self.ctx, done, stop_requested=stop_requested, group=self._stop_group, debug_code=debug_code
        )
        preemption = self.ctx.preemption
        if reason is None and preemption is not None and preemption.agreed_debug and self.debug_point is not None:
            self._debug(done, preemption.agreed_debug - 1)
        return reason or self.quit_reason

    def _debug(self, step: int, rank: int) -> None:
        """Every rank, at the boundary after ``step``: rank ``rank`` in the debugger, the others waiting."""
        assert self.debug_point is not None  # agreed only with one
        if self.debug_point.pause(step, rank, self.watchdog) == QUIT:
            self.quit_reason = "debugger"

    def announce_stop(self, reason: str, number: int) -> None:
        if self.ctx.is_rank0 and self.verbose:
            preemption = self.ctx.preemption
            received = preemption.received.items() if preemption is not None else ()
            got = ", ".join(f"{name} {time.time() - at:.2f} s ago" for name, at in received)
            say(f"{reason}: every rank stops after step {number} and saves (on rank 0: {got or 'none'})")

    # ------------------------------------------------------------------ checkpoints

    def save(self, step: int | None = None, *, in_background: bool = False) -> None:
        """Collective: checkpoint step ``step`` (default: the last completed), with ``state``;
        ``in_background``: by the periodic saver while training goes on."""
        step = self.last_step if step is None else step
        if self.ctx.run_dir is None or step == 0 or self.saved_step == step:
            return
        if not self.coordinator.leads:  # the step's leader saves for all
            return
        background = self.periodic if in_background else None
        path = checkpoint.save_checkpoint(
            self.ctx,
            self.model,
            self.optimizer,
            step=step,
            training=self.training,
            data=self.data,
            model_name=self.adapter.name,
            model_layout=getattr(self.adapter, "layout", None),
            extra=json.loads(json.dumps(self.state)) if self.state else None,  # as it is now: written later
            background=background,
            uploads=self.uploads,
        )
        self.saved_step = step
        if self.ctx.is_rank0 and self.verbose:
            say(f"checkpoint {path}" + (" (writing in the background)" if background is not None else ""))

    def submit_evals(self) -> None:
        """Rank 0, with ``--eval-job``: submit the eval job of every complete checkpoint that has
        none (:func:`hpc_hsdp.batch_shell.eval_job.submit_due`); never stops training."""
        self._evals_checked = self.saved_step
        command = self.training.checkpoint.eval_job
        if not command or not self.ctx.is_rank0 or self.ctx.run_dir is None:
            return
        try:
            submitted = eval_job.submit_due(
                self.ctx.run_dir,
                command,
                every=self.training.checkpoint.checkpoint_every,
                last=self.training.optimizer.steps,
            )
        except Exception as exc:  # noqa: BLE001 - an eval job never stops training
            note(f"warning: eval jobs could not be submitted: {' '.join(str(exc).split())[:300]}")
            return
        for record in submitted:
            if record.get("job_id"):
                say(f"eval job {record['job_id']} submitted for step {record['step']}")
            else:
                note(f"warning: the eval job of step {record['step']} was not submitted: {record.get('reason')}")

    def _save_now(self) -> int:
        """Collective: the last completed step's checkpoint, synchronously, the periodic saver
        closed (the coordinator's, before its job ends: a requeue resumes from it); the step."""
        self.save(self.last_step)
        if self.periodic is not None:
            self.periodic.close()
        self._wait_for_uploads()
        return self.last_step

    def _wait_for_uploads(self) -> None:
        """On the way out, with ``--checkpoint-store``: the last save's upload committed, as long as SLURM leaves."""
        if self.uploads is None:
            return
        preemption = self.ctx.preemption
        term_at = preemption.received.get("TERM") if preemption is not None else None
        self.uploads.finish(term_at=term_at, verbose=self.verbose)

    def save_if_due(self, number: int) -> None:
        """The ``--checkpoint-every`` checkpoint of step ``number``, in the background (not
        of the last step: :meth:`finish` writes that one)."""
        every = self.training.checkpoint.checkpoint_every
        if self.ctx.run_dir is not None and every and number % every == 0 and number != self.training.optimizer.steps:
            self.save(number, in_background=True)

    def finish(self, stop_reason: str | None) -> None:
        """Collective, once: the final checkpoint (synchronous) unless the last step has one,
        the periodic saver committed and closed, the attempt's end recorded."""
        if self._finished:
            return
        self._finished = True
        self.close_steps()
        self.save()
        if self.periodic is not None:
            self.periodic.close()
        self._wait_for_uploads()
        if self.uploads is not None:
            self.uploads.close()
        self.submit_evals()  # the final checkpoint's eval job (and any a background save left)
        self.observer.finish(stop_reason, self.last_step)
        self.coordinator.close()
        if self.compile_clock is not None:
            self.compile_clock.close()
        sys.stdout.flush()

    def summary(self) -> dict:
        ctx = self.ctx
        return {
            "rank": ctx.rank,
            "world_size": ctx.world_size,
            "shard_size": ctx.plan.shard_size,
            "start_step": self.start_step,
            "steps": self.last_step,
        }
