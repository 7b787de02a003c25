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

The parts are small functions a custom loop can reuse (``hpc_hsdp.runtime.loop``):
:func:`open_data` + :func:`check_data`, :func:`build_model`, :func:`make_optimizer`,
:func:`make_loader`, :func:`should_stop`, :func:`train_step`, :func:`evaluate`,
:func:`save_checkpoint` / :func:`resume`, :class:`MetricsLog`.

``<run_dir>/metrics.jsonl``, one record per step (rank 0): ``step``, ``loss`` (global
mean), ``lr``, ``grad_norm`` (global, before clipping), ``tokens_seen``,
``tokens_per_s``, ``step_time_s``, ``cpu_time_s`` (CPU seconds of the rank's process in the
step, all threads: near ``step_time_s`` on a GPU means the step is bound by the host),
``data_wait_s`` (time the step waited for the loader), ``eval_loss`` (on evaluation steps), ``peak_mem_bytes`` with ``peak_mem_kind``
(``cuda_max_allocated``, reset every step, plus ``peak_mem_reserved_bytes``; on CPU
``ru_maxrss``, rank 0's resident high-water mark, which only grows), ``world_size``,
``shard_size``, ``num_replicas``, ``grad_accum``, ``global_batch``, ``precision``,
``wall_time``, ``elapsed_s``; with ``--comm-stats``, ``comm`` (see ``comm_stats.py``).
"""

from __future__ import annotations

import functools
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from hpc_hsdp.data.sampler import BatchLayout, DatasetSamples, SampleOrder, eval_sample_ids
from hpc_hsdp.data.synthetic import SyntheticSamples
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.rundir.files import append_jsonl, truncate_metrics
from hpc_hsdp.rundir.state import check_data_position, saved_train_state
from hpc_hsdp.runtime import checkpoint, faults
from hpc_hsdp.runtime.dist import RunContext
from hpc_hsdp.runtime.hsdp import wrap_hsdp
from hpc_hsdp.runtime.loader import BatchLoader, MicroBatch, read_rows
from hpc_hsdp.runtime.observer import RunObserver
from hpc_hsdp.runtime.preemption import NONE, TERMINATE, WARNING, restart_count
from hpc_hsdp.runtime.reshard import choose_reshard
from hpc_hsdp.runtime.schedule import lr_of
from hpc_hsdp.runtime.watchdog import Watchdog

OnStep = Callable[[int, dict], None]


# ----------------------------------------------------------------------------- data


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
    from hpc_hsdp.data.tokens import DataError, open_dataset, open_eval_dataset

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
    from hpc_hsdp.data.tokens import check_for_eval, check_for_training

    train_ds, *rest = data.datasets
    check_for_training(
        train_ds, model_vocab_size=model_vocab_size, seq_len=training.seq_len, global_batch=data.layout.global_batch
    )
    for val_ds in rest:
        check_for_eval(val_ds, model_vocab_size=model_vocab_size, seq_len=training.seq_len)


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


# ----------------------------------------------------------------------------- model


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` on CUDA, ``fp32`` elsewhere."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16: bf16 parameters (all-gathered in bf16) and compute, fp32 gradient reduction."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def configure_device(device: torch.device) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA (what training wants; torch's default is off)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def checkpoint_activations(model: nn.Module, units: tuple[type, ...]) -> int:
    """Recompute each shard unit's activations in backward (``torch.utils.checkpoint``,
    non-reentrant) without renaming a parameter; returns how many units."""
    count = 0
    for module in model.modules():
        if units and isinstance(module, units):
            module.forward = functools.partial(torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False)
            count += 1
    return count


def build_model(
    ctx: RunContext, adapter, training: TrainingSpec, *, precision: str | None = None, verbose: bool = False
) -> nn.Module:
    """The adapter's model on ``ctx.mesh``: meta build, activation checkpointing (if asked),
    ``fully_shard`` per shard unit then the root (``--reshard-after-forward``, resolved by
    :func:`~hpc_hsdp.runtime.reshard.choose_reshard`; rank 0 says what it chose when
    ``verbose``), ``to_empty``, pretrained weights or a seed-determined initialisation (the
    same on every mesh shape)."""
    precision = precision or resolve_precision(training.precision, ctx.device)
    model = adapter.build_meta()
    units = tuple(adapter.shard_units(model))
    if training.activation_checkpointing:
        checkpoint_activations(model, units)
    choice = choose_reshard(ctx, model, units, setting=training.reshard_after_forward, precision=precision)
    if verbose and ctx.is_rank0:
        print(f"[hpc-hsdp] {choice.reason}", flush=True)
    wrap_hsdp(
        model, ctx.mesh, block=units, mp_policy=mixed_precision_policy(precision), reshard_after_forward=choice.reshard
    )
    model.to_empty(device=ctx.device)
    if adapter.has_pretrained_weights:
        adapter.load_pretrained(model)
    else:
        adapter.init_weights(model, seed=training.seed)
    return model


def make_optimizer(model: nn.Module, training: TrainingSpec) -> torch.optim.Optimizer:
    """AdamW; the learning rate is set every step from the schedule. Weight decay applies
    to matrices and embeddings only (not to biases and norms).

    On CPU the fused kernel (one op per parameter group): torch's default there runs ~10 ops
    per parameter, each paying DTensor's dispatch on FSDP2's parameters, and that was the
    whole of FSDP1's step advantage (benchmarks/probe_engines.py: the optimizer step of the
    0.9M model was 6x FSDP1's, 8-9 % of the whole step). On CUDA the multi-tensor kernel,
    torch's default there: the fused one made the H200 loop step 1.31x slower (RESULTS.md)."""
    params = list(model.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": training.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    device = params[0].device if params else torch.device("cpu")
    kernel = {"fused": True} if device.type == "cpu" else {"foreach": True}
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=training.lr, **kernel)


# ----------------------------------------------------------------------------- one step


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    adapter,
    batches: list[MicroBatch],
    *,
    lr: float,
    clip_grad: float,
    num_replicas: int,
    stop_code: Callable[[], int] | None = None,
) -> torch.Tensor:
    """One optimizer step over this rank's micro-batches; returns a device tensor
    ``[global mean loss, global gradient norm before clipping, agreed stop code]`` (no host
    sync).

    Every micro-batch's gradients are reduce-scattered in the shard group; the all-reduce
    across replicas (``set_requires_all_reduce``) runs only with the last one. Loss, squared
    gradient norm and the stop agreement go through ONE all_reduce over all ranks: each
    rank's local gradient shards cover the model once per replica, so the sum over all ranks
    is ``num_replicas`` times the squared norm; ``stop_code()``, this rank's signal code
    (:data:`hpc_hsdp.runtime.preemption.WARNING`, ``TERMINATE``), read after the backward,
    is summed as one count per code, so the agreed code is the highest any rank had."""
    accum = len(batches)
    device = batches[0].inputs.device
    loss_sum = torch.zeros((), device=device, dtype=torch.float32)
    for index, batch in enumerate(batches):
        if accum > 1:
            model.set_requires_all_reduce(index == accum - 1)
        loss = adapter.loss(model, batch.inputs, batch.targets)
        (loss / accum).backward()
        loss_sum += loss.detach().float()
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    if grads:
        squared = torch.stack([n.float() for n in torch._foreach_norm(grads, 2.0)]).pow(2).sum()
    else:
        squared = torch.zeros((), device=device)
    code = stop_code() if stop_code is not None else NONE
    warned = torch.full((), float(code == WARNING), device=device)  # a fill kernel: no host-to-device copy
    terminated = torch.full((), float(code == TERMINATE), device=device)
    fused = torch.stack([loss_sum, squared, warned, terminated])
    dist.all_reduce(fused, op=dist.ReduceOp.SUM)
    mean_loss = fused[0] / (dist.get_world_size() * accum)
    grad_norm = (fused[1] / num_replicas).sqrt()
    agreed = torch.where(fused[3] > 0, float(TERMINATE), torch.where(fused[2] > 0, float(WARNING), float(NONE)))
    if clip_grad > 0 and grads:
        torch._foreach_mul_(grads, torch.clamp(clip_grad / (grad_norm + 1e-6), max=1.0))
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return torch.stack([mean_loss, grad_norm, agreed])


@torch.no_grad()
def evaluate(
    ctx: RunContext, model: nn.Module, adapter, source, sample_ids: np.ndarray, *, rows_per_rank: int
) -> float:
    """Mean loss per token over ``sample_ids`` of ``source`` (collective). The ranks split the
    samples in chunks of ``rows_per_rank``; a rank with no rows left in a chunk still runs
    the forward (FSDP gathers are collectives) with weight 0. The mean is over the same
    samples on every mesh shape."""
    was_training = model.training
    model.eval()
    world, rank = ctx.world_size, ctx.rank
    per_chunk = world * rows_per_rank
    totals = torch.zeros(2, device=ctx.device, dtype=torch.float64)
    for start in range(0, len(sample_ids), per_chunk):
        mine = sample_ids[start + rank * rows_per_rank : start + (rank + 1) * rows_per_rank]
        weight = len(mine)
        inputs, targets = read_rows(source, mine if weight else sample_ids[:1])
        inputs, targets = inputs.to(ctx.device), targets.to(ctx.device)
        loss = adapter.loss(model, inputs, targets).double()
        tokens = weight * targets.shape[1]
        totals += torch.stack([loss * tokens, torch.tensor(float(tokens), device=ctx.device, dtype=torch.float64)])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    model.train(was_training)
    total, tokens = totals.tolist()
    return total / tokens


def eval_samples(data: TrainData, training: TrainingSpec) -> np.ndarray:
    """The fixed held-out samples of every evaluation: ``--eval-batches`` global batches."""
    return eval_sample_ids(
        num_samples=data.val.num_samples, count=training.eval_batches * data.layout.global_batch, seed=training.seed
    )


# ----------------------------------------------------------------------------- stopping, checkpoints, metrics


def control_group(ctx: RunContext):
    """A gloo group for the per-step stop agreement on GPU runs, so that it costs no device
    sync (None on CPU: the default gloo group serves)."""
    return dist.new_group(backend="gloo") if ctx.device.type == "cuda" else None


def should_stop(
    ctx: RunContext, last_step: int, *, stop_requested: Callable[[], bool] | None = None, group=None
) -> str | None:
    """Collective, at a step boundary: the agreed reason to stop (``"USR2"``, ``"TERM"``,
    ``"requested"``) or None. Every rank must call it at the same boundaries."""
    preemption = ctx.preemption
    if preemption is not None:
        device = torch.device("cpu") if group is not None else ctx.device
        if preemption.should_stop(last_step, device=device, group=group):
            return preemption.stop_reason
    if stop_requested is not None and stop_requested():
        return "requested"
    return None


def save_checkpoint(
    ctx: RunContext,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    training: TrainingSpec,
    data: TrainData,
    model_name: str = "builtin",
    extra: dict | None = None,
    background: checkpoint.AsyncSaver | None = None,
) -> Path:
    """Collective: model, optimizer and the data position after ``step`` (plus ``extra``, any
    JSON-able state of a custom loop) into ``<run_dir>/checkpoints/step-N`` atomically; with
    ``background``, written by it while training goes on (else before returning)."""
    train_state = {
        "seed": training.seed,
        "world_size": ctx.world_size,
        "batch_size": data.layout.rank_batch,
        "grad_accum": data.layout.grad_accum,
        "mesh_shape": list(ctx.plan.mesh_shape),
        "model": model_name,
        "data": data_state(data, step, training.seed),
        "extra": extra or {},
    }
    if background is not None:
        background.save(model, optimizer, step=step, train_state=train_state)
        return checkpoint.checkpoint_root(ctx.run_dir) / checkpoint.step_dir_name(step)
    return checkpoint.save(
        ctx.run_dir, model, optimizer, step=step, train_state=train_state, keep=training.keep_checkpoints
    )


def resume(
    ctx: RunContext,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data: TrainData,
    training: TrainingSpec,
    verbose: bool = True,
) -> tuple[int, dict]:
    """Load the newest complete checkpoint of ``ctx.run_dir`` (collective); returns
    ``(step, train_state)``, ``(0, {})`` on a fresh start. Refuses a data position this
    run cannot continue (another global batch, seed or dataset)."""
    if ctx.run_dir is None:
        return 0, {}
    found = checkpoint.latest_checkpoint(ctx.run_dir)
    if found is None:
        return 0, {}
    step, path = found
    saved = saved_train_state(path)
    check_data_position(
        saved.get("data"),
        global_batch=data.layout.global_batch,
        num_samples=data.train.num_samples,
        seed=training.seed,
        where=f"checkpoint {path.name} (step {step})",
    )
    state = checkpoint.load(path, model, optimizer)
    if ctx.is_rank0 and verbose:
        restart = getattr(ctx.preemption, "restart_count", None)
        restart = restart if restart is not None else restart_count(os.environ)
        print(
            f"[hpc-hsdp] resumed from step {step} (restart {restart}): {path}, saved on mesh "
            f"{state.get('mesh_shape')}, now {list(ctx.plan.mesh_shape)}",
            flush=True,
        )
    return int(state["step"]), state


def seed_step(seed: int, step: int, rank: int) -> None:
    """Seed torch's RNGs (CPU and CUDA) from ``(seed, step, rank)`` before a step, so that
    dropout draws the same masks in a resumed run as in an uninterrupted one."""
    torch.manual_seed((seed * 1_000_003 + step * 65_537 + rank) % (2**63))


MODEL_RECORD = "model.json"


def record_model(ctx: RunContext, adapter, training: TrainingSpec) -> None:
    """``<run_dir>/model.json`` (rank 0): which model this run trains (``adapter.describe()``:
    for ``hf:`` models the whole config) and the data it reads; ``hpc-hsdp export`` rebuilds
    the model from it without the job's nodes."""
    if ctx.run_dir is None or not ctx.is_rank0:
        return
    import json
    from dataclasses import asdict

    from hpc_hsdp.rundir.files import atomic_write_text

    describe = getattr(adapter, "describe", None)
    record = {
        "model": adapter.name,
        "vocab_size": adapter.vocab_size,
        "training": asdict(training),
        "adapter": describe() if callable(describe) else {"kind": adapter.name},
    }
    atomic_write_text(ctx.run_dir / MODEL_RECORD, json.dumps(record, indent=1) + "\n")


class MetricsLog:
    """``<run_dir>/metrics.jsonl`` on rank 0: records after ``start_step`` are dropped on
    resume (the resumed run rewrites them), then one line per step."""

    def __init__(self, ctx: RunContext, *, start_step: int) -> None:
        self.path = ctx.run_dir / "metrics.jsonl" if ctx.run_dir is not None and ctx.is_rank0 else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            truncate_metrics(self.path, keep_through_step=start_step)

    def write(self, record: dict) -> None:
        if self.path is not None:
            append_jsonl(self.path, record)


def peak_memory(device: torch.device) -> dict:
    """This step's peak memory (CUDA: since the last :func:`reset_peak_memory`)."""
    if device.type == "cuda":
        return {
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device),
            "peak_mem_kind": "cuda_max_allocated",
            "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    return {"peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_mem_kind": "ru_maxrss"}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def step_line(record: dict, total_steps: int) -> str:
    text = (
        f"step {record['step']:>5}/{total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
        f"gnorm {record['grad_norm']:.3f}"
    )
    if "eval_loss" in record:
        text += f"  eval {record['eval_loss']:.4f}"
    return text + (
        f"  {record['tokens_per_s']:,.0f} tok/s  {record['step_time_s'] * 1000:.0f} ms  "
        f"wait {record['data_wait_s'] * 1000:.1f} ms  peak {record['peak_mem_bytes'] / 2**20:.0f} MiB "
        f"({record['peak_mem_kind']})"
    )


# ----------------------------------------------------------------------------- the loop


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
    """Train ``training.model`` (or ``adapter``) to ``training.steps``, resuming from
    ``ctx.run_dir``'s newest complete checkpoint. In every step the ranks agree on the task
    signals (``ctx.preemption``, in the step's fused all_reduce: a signal that arrives after
    it counts in the next step), and before every step ask ``stop_requested()`` (it must
    answer the same on every rank); on a stop every rank saves a checkpoint. ``on_step(step, record)``
    runs on every rank after each step: the metrics record plus ``sample_ids`` (this rank's
    dataset samples of the step, one list per micro-batch)."""
    from hpc_hsdp.models import resolve_model

    if training is None:
        training = getattr(ctx.spec, "training", None) or TrainingSpec()
    data = open_data(training, ctx.world_size)
    adapter = adapter or resolve_model(training, data_vocab_size=data.vocab_size)
    check_data(data, model_vocab_size=adapter.vocab_size, training=training)
    record_model(ctx, adapter, training)
    precision = resolve_precision(training.precision, ctx.device)
    configure_device(ctx.device)
    model = build_model(ctx, adapter, training, precision=precision, verbose=verbose)
    optimizer = make_optimizer(model, training)
    start_step, _ = resume(ctx, model, optimizer, data=data, training=training, verbose=verbose)
    observer = RunObserver.start(ctx, training, start_step=start_step, verbose=verbose)  # before metrics are cut back
    metrics = MetricsLog(ctx, start_step=start_step)
    preemption = ctx.preemption
    stop_code = (lambda: preemption.local_code) if preemption is not None else None
    evaluation = eval_samples(data, training) if data.val is not None and training.eval_every else None

    result = TrainResult(model=model, optimizer=optimizer, start_step=start_step, last_step=start_step)
    layout = data.layout
    tokens_per_step = layout.global_batch * training.seq_len
    saved_step = start_step if start_step else None
    began = time.time()

    periodic = checkpoint.AsyncSaver.for_run(ctx, training)  # None without a run_dir or --checkpoint-every

    def save(step: int, *, in_background: bool = False) -> None:
        nonlocal saved_step
        path = save_checkpoint(
            ctx,
            model,
            optimizer,
            step=step,
            training=training,
            data=data,
            model_name=adapter.name,
            background=periodic if in_background else None,
        )
        saved_step = step
        if ctx.is_rank0 and verbose:
            print(
                f"[hpc-hsdp] checkpoint {path}" + (" (writing in the background)" if in_background else ""), flush=True
            )

    model.train()
    loader = make_loader(ctx, data, first_step=start_step + 1, last_step=training.steps)
    watchdog = Watchdog.for_run(ctx, training, step=start_step)  # a hang ends the job (and requeues it)
    try:
        for step in range(start_step + 1, training.steps + 1):
            if stop_requested is not None and stop_requested():  # the same answer on every rank
                result.stopped, result.stop_reason = True, "requested"
                break
            faults.at_step(ctx.rank, step)  # test hooks (HPC_HSDP_FAULT_*); no-ops otherwise
            seed_step(training.seed, step, ctx.rank)
            t0, cpu0 = time.perf_counter(), time.process_time()
            observer.step_begins(step)
            reset_peak_memory(ctx.device)
            if ctx.comm_stats is not None:
                ctx.comm_stats.reset()
            batches, waited = loader.next_step(step)
            lr = lr_of(training, step)
            out = train_step(
                model,
                optimizer,
                adapter,
                batches,
                lr=lr,
                clip_grad=training.clip_grad,
                num_replicas=ctx.plan.num_replicas,
                stop_code=stop_code,
            )
            loss, grad_norm, agreed = out.tolist()  # the step's one host sync
            # the ranks' signals, agreed in the step's all_reduce: all stop after this step, or none
            # (after the last one the run is done: nothing to stop or requeue)
            stopping = preemption is not None and step < training.steps and preemption.agree(int(agreed), step)
            step_time, cpu_time = time.perf_counter() - t0, time.process_time() - cpu0
            record = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_seen": step * tokens_per_step,
                "tokens_per_s": tokens_per_step / step_time,
                "step_time_s": step_time,
                "cpu_time_s": cpu_time,
                "data_wait_s": waited,
                **peak_memory(ctx.device),
                "world_size": ctx.world_size,
                "shard_size": ctx.plan.shard_size,
                "num_replicas": ctx.plan.num_replicas,
                "grad_accum": layout.grad_accum,
                "global_batch": layout.global_batch,
                "precision": precision,
            }
            if ctx.comm_stats is not None:
                record["comm"] = ctx.comm_stats.take()
            observer.step_ends(step, record)  # every K steps: each rank's own time, the slowest named
            if evaluation is not None and not stopping and (step % training.eval_every == 0 or step == training.steps):
                t_eval = time.perf_counter()
                record["eval_loss"] = evaluate(
                    ctx, model, adapter, data.val, evaluation, rows_per_rank=layout.rank_batch
                )
                record["eval_time_s"] = time.perf_counter() - t_eval
                result.eval_losses[step] = record["eval_loss"]
            record["wall_time"] = time.time()
            record["elapsed_s"] = record["wall_time"] - began
            result.losses[step] = loss
            result.last_step = step
            observer.write(record)
            metrics.write(record)
            if ctx.is_rank0 and verbose:
                print(step_line(record, training.steps), flush=True)
            if on_step is not None:
                on_step(step, dict(record, sample_ids=[b.sample_ids.tolist() for b in batches]))
            faults.after_step(ctx.rank, ctx.world_size, step, batches)  # test hook: the sample-id log
            watchdog.step_done(step)
            if stopping:
                result.stopped, result.stop_reason = True, preemption.stop_reason
                if ctx.is_rank0 and verbose:
                    got = ", ".join(f"{name} {time.time() - at:.2f} s ago" for name, at in preemption.received.items())
                    print(
                        f"[hpc-hsdp] {result.stop_reason}: every rank stops after step {step} and saves "
                        f"(on rank 0: {got or 'none'})",
                        flush=True,
                    )
                break  # the checkpoint of this step is written below, synchronously
            every = training.checkpoint_every
            if ctx.run_dir is not None and every and step % every == 0 and step != training.steps:
                save(step, in_background=True)
    finally:
        watchdog.stop()
        loader.close()

    if ctx.run_dir is not None and result.last_step > 0 and saved_step != result.last_step:
        save(result.last_step)  # on a stop signal and at the end: synchronous
    if periodic is not None:
        periodic.close()
    observer.finish(result.stop_reason, result.last_step)
    sys.stdout.flush()
    return result


def payload(ctx: RunContext) -> dict:
    """What ``hpc-hsdp run`` trains without ``--entry``: :func:`train`, then the summary."""
    return train(ctx).summary(ctx)
