"""A model's cost on a plan, for ``hpc-hsdp plan`` (pure): :class:`ModelCost` (its parameters per
shard size, how they are stored and trained), :func:`sizing` (memory and traffic per GPU, the
smallest shard size that fits, the checkpoint's save), and what ``--recommend`` weighs besides:
the activations' shape (:func:`activation_shape`) and the model's blocks (:func:`model_blocks`).
The formulas are :mod:`hpc_hsdp.plan.estimates`'; this module puts a model's options to them."""

from __future__ import annotations

from hpc_hsdp.plan.estimates import (
    PRECISION_BYTES,
    ActivationShape,
    Estimate,
    Fit,
    ParamsForShard,
    SaveEstimate,
    SaveTime,
    estimate,
    gathered_fits,
    llama_like_shape,
    parse_bandwidth,
    resolve_precision,
    save_estimate,
    save_time,
    signal_lead_s,
    smallest_fitting_shard,
)
from hpc_hsdp.plan.records import record
from hpc_hsdp.plan.slurm_facts import check_signal
from hpc_hsdp.plan.topology import TopologyPlan


@record(kw_only=False)
class ModelCost:
    """The model's parameters per shard size and how they are stored and trained."""

    params_for_shard: ParamsForShard | None
    precision: str
    optimizer: str
    grad_accum: int
    activations: ActivationShape | None = None
    blocks: int | None = None

    def params(self, plan: TopologyPlan) -> tuple[int | None, int]:
        return self.params_for_shard(plan.shard_size) if self.params_for_shard else (None, 0)

    def estimate(self, plan: TopologyPlan, **more) -> Estimate | None:
        params, root = self.params(plan)
        if not params:
            return None
        return estimate(
            plan,
            model_params=params,
            root_params=root,
            precision=self.precision,
            optimizer=self.optimizer,
            grad_accum=self.grad_accum,
            activations=self.activations,
            blocks=self.blocks,
            **more,
        )


@record(kw_only=False)
class Sizing:
    """What ``plan`` says of a model on a plan (each None where the options do not ask it)."""

    estimate: Estimate | None
    fit: Fit | None
    """The smallest shard size that fits ``--gpu-memory``."""
    on_sigterm: SaveTime | None
    """Whether a save on SIGTERM (or the --signal lead) ends before SLURM's KillWait."""
    saving: SaveEstimate | None


def sizing(
    the_plan: TopologyPlan,
    model: ModelCost,
    *,
    memory: int | None,
    write_bandwidth: str,
    signal: str,
    kill_wait: int,
    upload_bandwidth: str | None = None,
) -> Sizing:
    """Memory and traffic per GPU, the smallest shard size that fits, and the checkpoint's cost."""
    params, _ = model.params(the_plan)
    precision, optimizer = model.precision, model.optimizer
    est = model.estimate(the_plan)
    if (
        est is not None
        and params
        and memory is not None
        and the_plan.shard_size > 1
        and gathered_fits(
            state_bytes=est.needed_bytes,
            gathered_bytes=PRECISION_BYTES[resolve_precision(precision)].gather * params // the_plan.tp_size,
            memory_bytes=memory,
        )
    ):
        # what the run's default --reshard-after-forward auto does on a GPU of this memory
        est = model.estimate(the_plan, reshard_after_forward=False)
    fit = (
        smallest_fitting_shard(
            the_plan,
            model_params=params,
            gpu_memory=memory,
            precision=precision,
            optimizer=optimizer,
            activations=model.activations,
            blocks=model.blocks,
        )
        if memory is not None and params is not None
        else None
    )
    rate = parse_bandwidth(write_bandwidth)
    if signal.strip().lower() != "none":
        check_signal(signal)
    lead = signal_lead_s(None if signal.strip().lower() == "none" else signal)
    on_sigterm = save_time(the_plan, est, kill_wait_s=kill_wait, rate=rate, lead_s=lead) if est is not None else None
    saving = None
    if params:
        saving = save_estimate(
            the_plan,
            model_params=params,
            precision=precision,
            optimizer=optimizer,
            node_write_bandwidth=rate,
            signal=None if signal.strip().lower() == "none" else signal,
            upload_bandwidth=parse_bandwidth(upload_bandwidth, option="--upload-bandwidth")
            if upload_bandwidth
            else None,
        )
    return Sizing(estimate=est, fit=fit, on_sigterm=on_sigterm, saving=saving)


def activation_shape(
    model_info: dict | None,
    params_for_shard: ParamsForShard | None,
    *,
    seq_len: int | None,
    batch_size: int,
    checkpointing: bool,
    wanted: bool,
) -> ActivationShape | None:
    """What the activations depend on, where ``wanted`` (``--seq-len`` given, or ``--tp`` > 1) and
    known: the built-in model's blocks, width and sequence (``--seq-len`` wins), an ``hf:`` model's
    blocks and width from config.json, or the Llama-family shape nearest a bare ``--model-params``
    count (with ``--seq-len`` only)."""
    if not wanted or params_for_shard is None:
        return None
    dims = model_info.get("dims") if model_info is not None else getattr(params_for_shard, "dims", None)
    if dims is not None:
        layers, width, own_seq_len, source = dims
        if seq_len is None and own_seq_len is None:
            return None
        return ActivationShape(
            layers=layers,
            width=width,
            seq_len=seq_len or own_seq_len,
            batch_size=batch_size,
            checkpointing=checkpointing,
            source=source,
            **(model_info.get("activation_style", {}) if model_info is not None else {}),
        )
    if seq_len is None or model_info is not None:
        return None
    params, _ = params_for_shard(1)
    return llama_like_shape(params, seq_len=seq_len, batch_size=batch_size, checkpointing=checkpointing)


def model_blocks(model_info: dict | None, params_for_shard: ParamsForShard | None) -> int | None:
    """The model's blocks where known (the built-in model's, an ``hf:``/factory model's), for the working set."""
    dims = model_info.get("dims") if model_info is not None else getattr(params_for_shard, "dims", None)
    return dims[0] if dims else None
