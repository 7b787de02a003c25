"""Memory and traffic per GPU for a plan and a model size (pure arithmetic, no torch).

Model of one HSDP step with FSDP2 (blocks resharded after forward unless
``reshard_after_forward=False``, the root kept unsharded after forward), P parameters of
which ``root_params`` sit in the root:

- shard group: all-gather ``b(2P - P_root)`` tensor bytes (forward, then the backward
  re-gather; ``bP`` when the blocks keep their parameters), reduce-scatter ``bP``
  (gradients); bytes on the wire per rank with a ring: ``(S-1)/S`` of each.
- replicate group: all-reduce of the ``bP/S`` gradient shard; on the wire ``2(R-1)/R`` of it.

With ``--grad-accum N`` the shard group gathers and reduce-scatters on each of the N
micro-batches, while the replicas all-reduce once per optimizer step (HSDP's advantage:
the inter-node all-reduce does not grow with N).

A collective counts as inter-node when its group spans more than one node.

With tensor parallelism (``tp_size`` T > 1) every rank holds 1/T of each split layer before
FSDP2 shards it over S: parameters, gradients and optimizer state per GPU are over S x T, the
shard group gathers and reduce-scatters ``1/T`` of the bytes above, the replicate group
all-reduces ``bP/(S T)``. Inside the TP group (sequence parallelism, Megatron's and torchtitan's
plan) the activations between blocks are split over the sequence and gathered inside a block:
per micro-batch and block, forward all-gathers the ``B x L x H`` activation before attention and
before the feed-forward and reduce-scatters after each, backward the reverse; the embeddings'
output and the head's input add one pair each way. Per GPU per optimizer step, with ``N``
micro-batches of ``B`` rows (one TP group's), sequence ``L``, width ``H``, ``layers`` blocks,
``b`` bytes per element::

    all-gather     = reduce-scatter = N (4 layers + 2) b B L H          (tensor bytes)
                     with activation checkpointing, the recomputed forward: all-gather + N 2 layers
                     b B L H, reduce-scatter + N layers b B L H (torch's checkpoint stops once the
                     saved tensors are back, before the feed-forward's reduce-scatter)
    on the wire    = (T-1)/T of each (ring)

Activations per GPU (:class:`ActivationShape`): ``17 b B L H`` per block (Korthikanti et al.
2022, 34 s b h bytes at 16 bits, without the attention scores that flash attention never
stores), over T (sequence parallelism splits the parts tensor parallelism does not); with
activation checkpointing each block keeps its input (``b B L H / T``) and one block's set is live.

A transformers model's own plan is not sequence parallel: per block ``(5 + 12/T) b B L H`` (the
norms' part stays whole), each checkpointed block's input whole, and its TP traffic is all-reduces
of ``b B L H`` (:data:`TRANSFORMERS_TP`) and the logits' all-gather, ``2(T-1)/T`` and ``(T-1)/T``
of them on the wire.

Bytes per element follow ``--precision`` as the trainer runs it (:data:`PRECISION_BYTES`,
FSDP2's ``MixedPrecisionPolicy`` in ``task/training/model.py``): the sharded parameters the optimizer
updates and their gradients stay fp32 in every precision; bf16 (and fp8) gather parameters and
keep activations in bf16 and reduce gradients in fp32. Per GPU, with P_u the parameters of the
largest shard unit (a block) and ``g``/``r`` the gather/reduce bytes::

    states   = (4 + 4 + 4 k) P / (S T)                        k: optimizer tensors (AdamW 2)
    working  = (g (P_root + 2 P_u) + (g + r) P_u) / T          two blocks gathered (the one running
                                                               and the one prefetched), one block's
                                                               gradients unsharded and reduce-scattered
             = (g P + (g + r) P_u) / T                         blocks kept gathered (reshard never)
    peak     = states + working + activations
"""

from __future__ import annotations

import re
from collections.abc import Callable

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.records import record
from hpc_hsdp.plan.slurm_facts import signal_lead_seconds
from hpc_hsdp.plan.topology import TopologyPlan, valid_shard_sizes, valid_tp_sizes
from hpc_hsdp.plan.units import format_bytes


@record(kw_only=False)
class PrecisionBytes:
    """Bytes per element the trainer uses at one ``--precision``."""

    state: int
    """The sharded parameters the optimizer updates, and their gradients."""
    gather: int
    """Parameters all-gathered and held gathered for compute (FSDP2's ``param_dtype``)."""
    reduce: int
    """Gradients reduce-scattered and all-reduced (FSDP2's ``reduce_dtype``)."""
    activation: int


PRECISION_BYTES = {
    "fp32": PrecisionBytes(4, 4, 4, 4),
    "bf16": PrecisionBytes(4, 2, 4, 2),
    "fp8": PrecisionBytes(4, 2, 4, 2),
}
"""``--precision`` -> bytes per element (fp8: the Float8 Linears gather in one byte, so 2 is an upper bound)."""
PLAN_PRECISION_AUTO = "bf16"
"""What ``--precision auto`` trains in on a GPU: what ``plan`` counts for it."""
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
"""Per-parameter optimizer tensors (kept in fp32)."""
ACTIVATION_RESERVE = 0.2
"""Fraction of GPU memory left for activations, buffers and the allocator when judging a fit."""


def budget_bytes(gpu_memory: int) -> int:
    """What an estimate may use of ``gpu_memory``: all but ``ACTIVATION_RESERVE``."""
    return int(gpu_memory * (1 - ACTIVATION_RESERVE))


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "b": 10**9}
_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}


def parse_count(text: str, *, option: str = "--model-params") -> int:
    """``7B``, ``350M``, ``1.3e9``, ``125000000`` -> an integer count."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgtb]?)\s*", str(text).lower())
    if not match:
        raise SpecError(f"{option} {text!r} is not a count; write e.g. 125000000, 350M or 7B")
    number = float(match.group(1)) * _UNITS[match.group(2)]
    if number == float("inf"):
        raise SpecError(f"{option} {text!r} is too large to be a count; write e.g. 7B or 1.8T")
    value = int(number)
    if value < 1:
        raise SpecError(f"{option} {text!r} must be at least 1")
    if not match.group(2) and value < SMALLEST_BARE_COUNT:
        given = match.group(1)
        raise SpecError(
            f"{option} {text!r} would be {value:,} parameters; write {given}B (billions) or {given}M (millions), "
            f"or the whole count ({value * 10**9})"
        )
    return value


SMALLEST_BARE_COUNT = 10**4
"""A count without a unit below this (``--model-params 70``) is a forgotten B or M, not a model."""


def parse_bytes(text: str, *, option: str = "--gpu-memory") -> int:
    """``80GiB``, ``80GB``, ``80G`` (binary), ``1024B`` -> bytes; a bare number is refused (``80``
    is far more likely 80 GiB than 80 bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(text).lower())
    if not match or match.group(2) not in _BYTE_UNITS:
        raise SpecError(f"{option} {text!r} is not a size; write e.g. 80GiB, 40GB or 24G")
    if not match.group(2):
        raise SpecError(
            f"{option} {text!r} has no unit; write e.g. {match.group(1)}GiB (or {match.group(1)}B for bytes)"
        )
    value = int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])
    if value < 1:
        raise SpecError(f"{option} {text!r} must be more than 0 bytes")
    return value


@record
class Traffic:
    """Bytes one rank moves per step in one collective."""

    kind: str
    """``all_gather``, ``reduce_scatter`` or ``all_reduce``."""
    axis: str
    """The mesh axis: ``shard``, ``replicate`` or ``tp`` (activations, sequence parallelism)."""
    tensor_bytes: int
    wire_bytes: int
    inter_node: bool


@record
class Estimate:
    model_params: int
    root_params: int
    precision: str
    optimizer: str
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    traffic: tuple[Traffic, ...]
    reshard_after_forward: bool = True
    """False: the blocks keep their gathered parameters to backward (no re-gather counted)."""
    tp_size: int = 1
    activation_bytes: int | None = None
    """Activations per GPU (:class:`ActivationShape`); None where the model's shape or the sequence is not known."""
    working_bytes: int = 0
    """Gathered parameters and unsharded gradients in flight (see the module's docstring)."""
    blocks: int = 1
    """Shard units (blocks) the model was counted in, for :attr:`working_bytes`."""

    @property
    def total_bytes(self) -> int:
        """Parameters, gradients and optimizer state per GPU."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def needed_bytes(self) -> int:
        """What must fit: :attr:`total_bytes`, the gathered working set, and the activations where known."""
        return self.total_bytes + self.working_bytes + (self.activation_bytes or 0)

    @property
    def tp_wire_bytes(self) -> int:
        return sum(t.wire_bytes for t in self.traffic if t.axis == "tp")

    @property
    def intra_node_wire_bytes(self) -> int:
        return sum(t.wire_bytes for t in self.traffic if not t.inter_node)

    @property
    def inter_node_wire_bytes(self) -> int:
        return sum(t.wire_bytes for t in self.traffic if t.inter_node)

    def to_dict(self) -> dict:
        return {
            "model_params": self.model_params,
            "root_params": self.root_params,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "reshard_after_forward": self.reshard_after_forward,
            "blocks": self.blocks,
            "per_gpu_bytes": {
                "parameters": self.param_bytes,
                "gradients": self.grad_bytes,
                "optimizer_state": self.optimizer_bytes,
                "total": self.total_bytes,
                "working": self.working_bytes,
                "needed": self.needed_bytes,
            },
            "per_step_per_gpu": [
                {
                    "kind": t.kind,
                    "axis": t.axis,
                    "tensor_bytes": t.tensor_bytes,
                    "wire_bytes": t.wire_bytes,
                    "inter_node": t.inter_node,
                }
                for t in self.traffic
            ],
            "intra_node_wire_bytes": self.intra_node_wire_bytes,
            "inter_node_wire_bytes": self.inter_node_wire_bytes,
        } | (
            {
                "tp_size": self.tp_size,
                "activation_bytes": self.activation_bytes,
                "tp_wire_bytes": self.tp_wire_bytes,
                "needed_bytes": self.needed_bytes,
            }
            if self.tp_size > 1 or self.activation_bytes is not None
            else {}
        )


ACTIVATION_ELEMENTS = 17
"""Activation elements kept per block per token and unit of width (Korthikanti et al. 2022: 34 s b h
bytes at 16 bits, with flash attention's scores left out), for :class:`ActivationShape`."""


UNSPLIT_ELEMENTS = 5
"""Of :data:`ACTIVATION_ELEMENTS`, those tensor parallelism without sequence parallelism leaves whole
on every rank (Korthikanti et al. 2022: ``s b h (10 + 24/t)`` bytes at 16 bits: the norms' inputs, the
residuals, the dropout masks)."""

TRANSFORMERS_TP = (7, 2)
"""A transformers model under its own plan (colwise q/k/v and gate/up, rowwise o and down, the
embedding by vocabulary, the head colwise with its output gathered), in ``B x L x H`` all-reduces
per micro-batch: per block, forward 2 (o's and down's outputs) and backward 5 (the input gradient of
each colwise Linear; +1 per block with activation checkpointing: the forward again, which stops
before down's all-reduce); the ends 2
(the embedding's output, the head's input gradient; none when they are tied, left whole). The head
also all-gathers the ``B x L x V`` logits. Measured with ``--comm-stats`` on a Llama at tp 2
(``tests/processes/test_tensor_parallel.py``)."""


@record
class ActivationShape:
    """What the activations of one micro-batch depend on: blocks, width, tokens, rows."""

    layers: int
    width: int
    seq_len: int
    batch_size: int
    """Rows per micro-batch of one TP group (its T ranks read the same rows)."""
    checkpointing: bool = False
    """Activation checkpointing: each block keeps its input; forward runs again in backward."""
    source: str = ""
    """Where the shape came from (the model, or the Llama family's shape nearest a parameter count)."""
    sequence_parallel: bool = True
    """The model's TP plan splits the activations between blocks over the sequence (the built-in
    model's, torchtitan's); False for a transformers model's own plan, which keeps them whole on every
    rank of the TP group and all-reduces instead (:data:`TRANSFORMERS_TP`)."""
    vocab_size: int = 0
    """Without sequence parallelism: the logits' width, which the head's all-gather carries."""
    tied: bool = False
    """Without sequence parallelism: the embedding and the head are one parameter, left whole."""

    def token_bytes(self, element_bytes: int) -> int:
        """``b B L H``: one activation tensor of the micro-batch, whole."""
        return element_bytes * self.batch_size * self.seq_len * self.width

    def bytes_per_gpu(self, *, element_bytes: int, tp_size: int = 1) -> int:
        """Activations kept per GPU for backward (see the module's docstring)."""
        one = self.token_bytes(element_bytes)
        if not self.sequence_parallel:
            # the norms', residuals' and dropouts' part stays whole; a block's input is whole
            block = (UNSPLIT_ELEMENTS * tp_size + ACTIVATION_ELEMENTS - UNSPLIT_ELEMENTS) * one // tp_size
            return self.layers * one + block if self.checkpointing else self.layers * block
        if self.checkpointing:
            return (self.layers * one + ACTIVATION_ELEMENTS * one) // tp_size
        return self.layers * ACTIVATION_ELEMENTS * one // tp_size

    def tp_traffic(self, *, element_bytes: int, tp_size: int, grad_accum: int, inter_node: bool) -> tuple[Traffic, ...]:
        """The TP group's all-gathers and reduce-scatters of activations per optimizer step (none at T = 1);
        without sequence parallelism its all-reduces and the logits' all-gather (:data:`TRANSFORMERS_TP`)."""
        if tp_size == 1:
            return ()
        if not self.sequence_parallel:
            return self._all_reduce_traffic(element_bytes, tp_size, grad_accum, inter_node)
        # the recomputed forward of a checkpointed block gathers twice and reduce-scatters once: torch's
        # checkpoint stops once the saved tensors are back, before the feed-forward's reduce-scatter
        extra = {"all_gather": 2, "reduce_scatter": 1} if self.checkpointing else {"all_gather": 0, "reduce_scatter": 0}
        out = []
        for kind in ("all_gather", "reduce_scatter"):
            tensor = grad_accum * (4 * self.layers + 2 + extra[kind] * self.layers) * self.token_bytes(element_bytes)
            wire = tensor * (tp_size - 1) // tp_size
            out.append(Traffic(kind=kind, axis="tp", tensor_bytes=tensor, wire_bytes=wire, inter_node=inter_node))
        return tuple(out)

    def _all_reduce_traffic(self, element_bytes: int, tp_size: int, grad_accum: int, inter_node: bool):
        per_block, ends = TRANSFORMERS_TP
        count = (per_block + (1 if self.checkpointing else 0)) * self.layers + (0 if self.tied else ends)
        tensor = grad_accum * count * self.token_bytes(element_bytes)
        out = [
            Traffic(
                kind="all_reduce",
                axis="tp",
                tensor_bytes=tensor,
                wire_bytes=2 * tensor * (tp_size - 1) // tp_size,
                inter_node=inter_node,
            )
        ]
        if not self.tied and self.vocab_size:
            logits = grad_accum * element_bytes * self.batch_size * self.seq_len * self.vocab_size
            wire = logits * (tp_size - 1) // tp_size
            out.append(
                Traffic(kind="all_gather", axis="tp", tensor_bytes=logits, wire_bytes=wire, inter_node=inter_node)
            )
        return tuple(out)


LLAMA_FAMILY = (
    (1_240_000_000, 16, 2048),
    (3_210_000_000, 28, 3072),
    (6_740_000_000, 32, 4096),
    (13_000_000_000, 40, 5120),
    (32_500_000_000, 60, 6656),
    (70_600_000_000, 80, 8192),
    (405_000_000_000, 126, 16384),
)
"""(parameters, blocks, width) of the public Llama models (1B, 3B, 7B, 13B, 30B, 70B, 405B): the shape
``plan`` assumes for activations when it is given only a parameter count."""


def llama_like_shape(params: int, *, seq_len: int, batch_size: int, checkpointing: bool = False) -> ActivationShape:
    """The activation shape of the Llama model nearest ``params`` (by ratio)."""
    count, layers, width = min(LLAMA_FAMILY, key=lambda row: max(row[0], params) / min(row[0], params))
    return ActivationShape(
        layers=layers,
        width=width,
        seq_len=seq_len,
        batch_size=batch_size,
        checkpointing=checkpointing,
        source=f"as a Llama-family model of {count / 1e9:.3g}B ({layers} blocks, width {width})",
    )


def resolve_precision(precision: str) -> str:
    """``auto`` -> what a GPU run trains in; the others as they are."""
    return PLAN_PRECISION_AUTO if precision == "auto" else precision


def check_model_options(*, precision: str, optimizer: str) -> None:
    if precision not in PRECISION_BYTES:
        raise SpecError(
            f"--precision {precision!r} is unknown; choose one of auto, {', '.join(sorted(PRECISION_BYTES))}"
        )
    if optimizer not in OPTIMIZER_STATES:
        raise SpecError(f"--optimizer {optimizer!r} is unknown; choose one of {', '.join(sorted(OPTIMIZER_STATES))}")


def nearest_llama_blocks(params: int) -> int:
    """The block count of the Llama model nearest ``params`` (by ratio)."""
    return min(LLAMA_FAMILY, key=lambda row: max(row[0], params) / min(row[0], params))[1]


def estimate(
    plan: TopologyPlan,
    *,
    model_params: int,
    root_params: int = 0,
    precision: str = "fp32",
    optimizer: str = "adamw",
    grad_accum: int = 1,
    reshard_after_forward: bool = True,
    activations: ActivationShape | None = None,
    blocks: int | None = None,
) -> Estimate:
    """Memory per GPU and bytes per optimizer step of rank 0 (every rank of an even plan
    moves the same); ``grad_accum`` micro-batches per step. ``reshard_after_forward=False``
    (blocks keep their gathered parameters to backward): the shard group gathers ``bP``
    per micro-batch, with no backward re-gather. With ``plan.tp_size`` T > 1 the model is
    over S x T (see the module's docstring); ``activations`` adds the activations per GPU and
    the TP group's bytes. ``blocks``: the model's shard units (default: the activations' blocks,
    else the Llama model's nearest ``model_params``), for the gathered working set."""
    precision = resolve_precision(precision)
    check_model_options(precision=precision, optimizer=optimizer)
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise SpecError(f"--grad-accum {grad_accum!r} must be a positive integer")
    n = grad_accum
    bytes_of = PRECISION_BYTES[precision]
    g, rd = bytes_of.gather, bytes_of.reduce
    s, r, t = plan.shard_size, plan.num_replicas, plan.tp_size
    p, p_root = model_params, min(root_params, model_params)
    if blocks is None:
        blocks = activations.layers if activations is not None else nearest_llama_blocks(p)
    blocks = max(1, blocks)
    p_unit = -(-(p - p_root) // blocks)
    shard_inter = len(plan.nodes_of_group(plan.shard_group_of(0))) > 1
    replicate_inter = len(plan.nodes_of_group(plan.replicate_group_of(0))) > 1
    traffic: list[Traffic] = []
    if activations is not None:
        traffic.extend(
            activations.tp_traffic(
                element_bytes=bytes_of.activation, tp_size=t, grad_accum=n, inter_node=plan.tp_groups_cross_nodes
            )
        )
    if s > 1:
        gathered = n * g * ((2 * p - p_root) if reshard_after_forward else p) // t
        traffic.append(
            Traffic(
                kind="all_gather",
                axis="shard",
                tensor_bytes=gathered,
                wire_bytes=gathered * (s - 1) // s,
                inter_node=shard_inter,
            )
        )
        scattered = n * rd * p // t
        traffic.append(
            Traffic(
                kind="reduce_scatter",
                axis="shard",
                tensor_bytes=scattered,
                wire_bytes=scattered * (s - 1) // s,
                inter_node=shard_inter,
            )
        )
    if r > 1:
        shard_grad = rd * p // (s * t)
        traffic.append(
            Traffic(
                kind="all_reduce",
                axis="replicate",
                tensor_bytes=shard_grad,
                wire_bytes=2 * shard_grad * (r - 1) // r,
                inter_node=replicate_inter,
            )
        )
    held = min(p, p_root + 2 * p_unit) if reshard_after_forward else p
    working = (g * held + (g + rd) * p_unit) // t
    return Estimate(
        model_params=p,
        root_params=p_root,
        precision=precision,
        optimizer=optimizer,
        param_bytes=bytes_of.state * p // (s * t),
        grad_bytes=bytes_of.state * p // (s * t),
        optimizer_bytes=4 * OPTIMIZER_STATES[optimizer] * p // (s * t),
        traffic=tuple(traffic),
        reshard_after_forward=reshard_after_forward,
        tp_size=t,
        activation_bytes=None
        if activations is None
        else activations.bytes_per_gpu(element_bytes=bytes_of.activation, tp_size=t),
        working_bytes=working,
        blocks=blocks,
    )


@record
class Fit:
    shard_size: int
    needed_bytes: int
    budget_bytes: int
    gpu_memory: int

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_memory - self.needed_bytes


def smallest_fitting_shard(
    plan: TopologyPlan,
    *,
    model_params: int,
    gpu_memory: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    activations: ActivationShape | None = None,
    blocks: int | None = None,
) -> Fit | None:
    """The smallest shard size (at ``plan``'s tp size) whose parameter, gradient and optimizer
    bytes, and the activations where given, fit, leaving ``ACTIVATION_RESERVE`` of the GPU free;
    None when even full sharding does not fit."""
    budget = budget_bytes(gpu_memory)
    for s in valid_shard_sizes(plan.tasks_per_node, plan.tp_size):
        candidate = TopologyPlan(
            tasks_per_node=plan.tasks_per_node, shard_size=s, node_names=plan.node_names, tp_size=plan.tp_size
        )
        needed = estimate(
            candidate,
            model_params=model_params,
            precision=precision,
            optimizer=optimizer,
            activations=activations,
            blocks=blocks,
        ).needed_bytes
        if needed <= budget:
            return Fit(shard_size=s, needed_bytes=needed, budget_bytes=budget, gpu_memory=gpu_memory)
    return None


def gathered_fits(*, state_bytes: int, gathered_bytes: int, memory_bytes: int) -> bool:
    """Whether the whole model gathered (``gathered_bytes``) fits beside the sharded state
    (parameters, gradients, optimizer) in ``memory_bytes``, leaving ``ACTIVATION_RESERVE``
    free: the rule by which ``plan --recommend`` and ``--reshard-after-forward auto`` keep
    the gathered parameters from forward to backward."""
    return state_bytes + gathered_bytes <= budget_bytes(memory_bytes)


ParamsForShard = Callable[[int], tuple[int, int]]
"""shard size -> (parameters, root parameters) as FSDP2 holds them (padded for that size)."""


@record
class Candidate:
    """One shard size considered by :func:`recommend`."""

    shard_size: int
    estimate: Estimate
    fits: bool

    @property
    def tp_size(self) -> int:
        return self.estimate.tp_size

    @property
    def needed_bytes(self) -> int:
        return self.estimate.needed_bytes

    def to_dict(self) -> dict:
        e = self.estimate
        data: dict[str, object] = {
            "shard_size": self.shard_size,
            "memory_per_gpu_bytes": e.needed_bytes,
            "fits": self.fits,
            "intra_node_wire_bytes": e.intra_node_wire_bytes,
            "inter_node_wire_bytes": e.inter_node_wire_bytes,
        }
        if e.tp_size > 1 or e.activation_bytes is not None:
            data.update(
                tp_size=e.tp_size,
                activation_bytes=e.activation_bytes,
                needed_bytes=e.needed_bytes,
                tp_wire_bytes=e.tp_wire_bytes,
            )
        return data


@record
class Recommendation:
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    """The fitting shard size with the least inter-node traffic; None when none fits."""
    gpu_memory: int
    budget_bytes: int
    """``gpu_memory`` less the activation reserve: what parameters, gradients and optimizer state may use."""
    reasons: tuple[str, ...]
    reshard_after_forward: bool | None = None
    """False when every block's gathered parameters fit beside the chosen shard size's
    state (``--reshard-after-forward never``: no backward re-gather, the faster step); True
    when they do not; None when nothing fits or the shard size is 1 (nothing to gather)."""
    gathered_bytes: int = 0
    """What keeping the gathered parameters adds per GPU: the whole model unsharded."""

    def to_dict(self) -> dict:
        return {
            "recommended_shard_size": self.chosen.shard_size if self.chosen else None,
            "reshard_after_forward": self.reshard_after_forward,
            "gathered_bytes": self.gathered_bytes,
            "gpu_memory": self.gpu_memory,
            "budget_bytes": self.budget_bytes,
            "activation_reserve": ACTIVATION_RESERVE,
            "reasons": list(self.reasons),
            "candidates": [c.to_dict() for c in self.candidates],
        }


def _ranking(c: Candidate) -> tuple[int, int, int, int]:
    e = c.estimate
    return (e.inter_node_wire_bytes, e.intra_node_wire_bytes, e.needed_bytes, c.shard_size)


def recommend(
    plan: TopologyPlan,
    *,
    model_params: int | None = None,
    gpu_memory: int,
    root_params: int = 0,
    precision: str = "fp32",
    optimizer: str = "adamw",
    params_for_shard: ParamsForShard | None = None,
    activations: ActivationShape | None = None,
    blocks: int | None = None,
) -> Recommendation:
    """The shard size for ``plan``'s nodes (at its tp size) that fits ``gpu_memory`` (leaving
    ``ACTIVATION_RESERVE`` free) and sends the least inter-node traffic per step; ties go
    to less intra-node traffic, then less memory. Every valid shard size is a candidate.
    ``params_for_shard`` (e.g. the built-in model's padded counts) replaces
    ``model_params``/``root_params`` when the count depends on the shard size; ``activations``
    count in what must fit where given."""
    precision = resolve_precision(precision)
    check_model_options(precision=precision, optimizer=optimizer)
    if params_for_shard is None:
        if model_params is None:
            raise SpecError("recommend needs --model-params; add e.g. --model-params 7B")
        params_for_shard = lambda _s: (model_params, root_params)  # noqa: E731
    budget = budget_bytes(gpu_memory)
    candidates = []
    t = plan.tp_size
    for s in valid_shard_sizes(plan.tasks_per_node, t):
        candidate_plan = TopologyPlan(
            tasks_per_node=plan.tasks_per_node, shard_size=s, node_names=plan.node_names, tp_size=t
        )
        p, p_root = params_for_shard(s)
        est = estimate(
            candidate_plan,
            model_params=p,
            root_params=p_root,
            precision=precision,
            optimizer=optimizer,
            activations=activations,
            blocks=blocks,
        )
        candidates.append(Candidate(shard_size=s, estimate=est, fits=est.needed_bytes <= budget))
    fitting = [c for c in candidates if c.fits]
    chosen = min(fitting, key=_ranking) if fitting else None
    reasons = _reasons(candidates, chosen, budget, gpu_memory)
    reshard, gathered = None, 0
    if chosen is not None and chosen.shard_size > 1:
        e = chosen.estimate
        gathered = PRECISION_BYTES[precision].gather * e.model_params // t
        regather = PRECISION_BYTES[precision].gather * (e.model_params - e.root_params) // t
        reshard = not gathered_fits(state_bytes=e.needed_bytes, gathered_bytes=gathered, memory_bytes=gpu_memory)
        if reshard:
            reasons.append(
                f"keep resharding after forward: the whole model gathered ({format_bytes(gathered)}) "
                f"would not fit beside the {format_bytes(e.needed_bytes)} of state"
            )
        else:
            reasons.append(
                f"--reshard-after-forward never: the whole model gathered from forward to backward "
                f"({format_bytes(gathered)}) fits beside the state ({format_bytes(e.needed_bytes + gathered)} "
                f"in all); backward gathers nothing again ({format_bytes(regather)} less to all-gather per "
                f"step in the shard group), the faster step"
            )
    return Recommendation(
        candidates=tuple(candidates),
        chosen=chosen,
        gpu_memory=gpu_memory,
        budget_bytes=budget,
        reasons=tuple(reasons),
        reshard_after_forward=reshard,
        gathered_bytes=gathered,
    )


def _reasons(candidates: list[Candidate], chosen: Candidate | None, budget: int, gpu_memory: int) -> list[str]:
    counted = any(c.estimate.activation_bytes is not None for c in candidates)
    kept = "buffers and the allocator" if counted else "activations"
    reserve = f"{format_bytes(budget)} of {format_bytes(gpu_memory)}, {ACTIVATION_RESERVE:.0%} kept for {kept}"
    too_big = [c.shard_size for c in candidates if not c.fits]
    if chosen is None:
        largest = candidates[-1]
        return [
            f"no shard size fits: even --shard {largest.shard_size} needs {format_bytes(largest.needed_bytes)} "
            f"per GPU for parameters, gradients, optimizer state, the blocks in flight"
            f"{' and activations' if counted else ''}, "
            f"more than {reserve}; "
            f"use more GPUs, split layers (--tp), or an optimizer with less state"
        ]
    e = chosen.estimate
    lines = [f"--shard {chosen.shard_size}: {format_bytes(e.needed_bytes)} per GPU fits in {reserve}"]
    if too_big:
        lines.append(f"too big for memory: --shard {', '.join(map(str, too_big))}")
    others = sorted((c for c in candidates if c.fits and c is not chosen), key=_ranking)
    if others:
        nxt = others[0].estimate
        if nxt.inter_node_wire_bytes > e.inter_node_wire_bytes:
            factor = (
                ""
                if e.inter_node_wire_bytes == 0
                else f", {nxt.inter_node_wire_bytes / e.inter_node_wire_bytes:.1f}x as much"
            )
            lines.append(
                f"least inter-node traffic of those that fit: {format_bytes(e.inter_node_wire_bytes)} per step "
                f"per GPU; the next best, --shard {others[0].shard_size}, sends "
                f"{format_bytes(nxt.inter_node_wire_bytes)}{factor}"
            )
        else:
            lines.append(
                f"equal inter-node traffic ({format_bytes(e.inter_node_wire_bytes)} per step per GPU) to "
                f"--shard {others[0].shard_size}, and less traffic inside the node "
                f"({format_bytes(e.intra_node_wire_bytes)} against {format_bytes(nxt.intra_node_wire_bytes)})"
            )
    return lines


@record
class TpRecommendation:
    """:func:`recommend` at every TP size the nodes allow, and the choice among them."""

    by_tp: tuple[tuple[int, Recommendation], ...]
    """(T, the shard-size recommendation at T), T ascending."""
    chosen_tp: int | None
    """The smallest T at which some shard size fits; None when none does."""
    reasons: tuple[str, ...]

    @property
    def chosen(self) -> Recommendation | None:
        return dict(self.by_tp)[self.chosen_tp] if self.chosen_tp is not None else None

    def to_dict(self) -> dict:
        chosen = self.chosen
        return {
            "recommended_tp_size": self.chosen_tp,
            "recommended_shard_size": chosen.chosen.shard_size if chosen and chosen.chosen else None,
            "reasons": list(self.reasons),
            "by_tp": [{"tp_size": t, **rec.to_dict()} for t, rec in self.by_tp],
        }


def recommend_tp(
    plan: TopologyPlan,
    *,
    gpu_memory: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    params_for_shard: ParamsForShard,
    activations: ActivationShape | None,
    tp_sizes: list[int] | None = None,
    blocks: int | None = None,
) -> TpRecommendation:
    """The TP size T and shard size S for ``plan``'s nodes: T divides every node (a TP group stays
    inside one node); the smallest T at which parameters, gradients, optimizer state and
    activations (over S x T and T) fit; at that T, the shard size :func:`recommend` chooses (the
    least inter-node traffic). A larger T splits the activations further but adds the TP group's
    all-gathers and reduce-scatters of activations to every block. ``tp_sizes``: those the model
    can be split over (:func:`hpc_hsdp.plan.shapes.tp_refusal`), of the nodes' (default: all)."""
    by_tp = []
    for t in valid_tp_sizes(plan.tasks_per_node) if tp_sizes is None else tp_sizes:
        at_t = TopologyPlan(tasks_per_node=plan.tasks_per_node, shard_size=1, node_names=plan.node_names, tp_size=t)
        rec = recommend(
            at_t,
            gpu_memory=gpu_memory,
            precision=precision,
            optimizer=optimizer,
            params_for_shard=params_for_shard,
            activations=activations,
            blocks=blocks,
        )
        by_tp.append((t, rec))
    fitting = [t for t, rec in by_tp if rec.chosen is not None]
    chosen_tp = fitting[0] if fitting else None
    reasons = []
    if chosen_tp is None:
        # only what the user has not done already
        ways = ["more GPUs"]
        ways += ["--precision bf16"] if PRECISION_BYTES[resolve_precision(precision)].activation > 2 else []
        ways += ["--activation-checkpointing"] if activations is not None and not activations.checkpointing else []
        ways += ["a shorter sequence"]
        ways += ["a smaller micro-batch"] if activations is not None and activations.batch_size > 1 else []
        reasons.append(
            f"no TP size fits: even --tp {by_tp[-1][0]} needs more than the budget at every shard size; use "
            f"{', '.join(ways[:-1])} or {ways[-1]}"
        )
    else:
        too_small = [t for t, rec in by_tp if t < chosen_tp]
        if too_small:
            reasons.append(
                f"--tp {chosen_tp}: the smallest TP size at which the model and its activations fit "
                f"(--tp {', '.join(map(str, too_small))}: no shard size fits)"
            )
        else:
            reasons.append(
                f"--tp {chosen_tp}: the model and its activations fit without splitting layers; a larger --tp "
                f"adds the TP group's activation traffic to every block"
            )
    return TpRecommendation(by_tp=tuple(by_tp), chosen_tp=chosen_tp, reasons=tuple(reasons))


# ----------------------------------------------------------------------------- saving within KillWait

SLURM_KILL_WAIT_S = 30
"""Slurm's default ``KillWait``: seconds from SIGTERM (scancel, preemption, the time limit)
to SIGKILL. A checkpoint started on SIGTERM must be written within it."""
DEFAULT_SAVE_RATE = 10**9
"""Assumed write rate of one node to the checkpoint file system, bytes per second (1 GB/s:
a parallel file system's client; local NVMe is faster, NFS slower): ``plan --write-bandwidth``."""


@record
class SaveTime:
    """How long a full checkpoint takes, against ``KillWait``."""

    checkpoint_bytes: int
    """Parameters and optimizer state of the whole model (one replica: DCP writes replicated
    shards once)."""
    seconds: float
    """``checkpoint_bytes`` written by every node at ``rate`` bytes/s each."""
    kill_wait_s: int
    rate: int
    lead_s: int | None = None
    """Seconds between the job's warning signal and its time limit (None: no signal, or not known)."""

    @property
    def fits(self) -> bool:
        return self.seconds <= self.kill_wait_s

    def warning(self) -> str | None:
        if self.fits:
            return None
        head = (
            f"warning: a checkpoint of {format_bytes(self.checkpoint_bytes)} takes about {self.seconds:.0f} s at "
            f"{self.rate / 1e9:g} GB/s per node, more than KillWait ({self.kill_wait_s} s): a save started on "
            f"SIGTERM (scancel, preemption, the time limit) is killed half-written and the run resumes from the "
            f"previous one; "
        )
        needed = signal_lead_for(self.seconds)
        if self.lead_s is not None and self.lead_s >= needed:
            return head + (
                f"the warning signal, {self.lead_s} s before the time limit, leaves the save time; for scancel and "
                f"preemption checkpoint more often (--checkpoint-every)"
            )
        return head + (
            f"save on the warning signal (--signal USR2@{needed}: 1.5x the save and 30 s) or checkpoint more often "
            f"(--checkpoint-every)"
        )

    def to_dict(self) -> dict:
        return {
            "checkpoint_bytes": self.checkpoint_bytes,
            "seconds": round(self.seconds, 1),
            "kill_wait_s": self.kill_wait_s,
            "rate_bytes_per_s": self.rate,
            "fits": self.fits,
        }


def save_time(
    plan: TopologyPlan,
    est: Estimate,
    *,
    kill_wait_s: int = SLURM_KILL_WAIT_S,
    rate: int = DEFAULT_SAVE_RATE,
    lead_s: int | None = None,
) -> SaveTime:
    """A full checkpoint's size and write time for ``est`` on ``plan``'s nodes (``lead_s``: the warning
    signal's seconds before the time limit)."""
    checkpoint = (est.param_bytes + est.optimizer_bytes) * plan.ranks_per_copy
    return SaveTime(
        checkpoint_bytes=checkpoint,
        seconds=checkpoint / (plan.nodes * rate),
        kill_wait_s=kill_wait_s,
        rate=rate,
        lead_s=lead_s,
    )


DEFAULT_WRITE_BANDWIDTH = "1GB"
"""Bytes per second one node writes to the checkpoint's file system, when not measured
(``benchmarks/bench_checkpoint.py`` measures the disk and what a save reaches of it)."""


@record
class SaveEstimate:
    """How long writing one checkpoint of the model takes, against the warning signal's lead."""

    checkpoint_bytes: int
    """Parameters and optimizer state (fp32 in every precision), replicated shards stored once."""
    per_node_bytes: int
    node_write_bandwidth: int
    seconds: float
    signal: str | None
    lead_s: int | None
    """Seconds between the warning signal and the time limit (None: no signal)."""
    upload_bandwidth: int | None = None
    """Bytes per second one node uploads to ``--checkpoint-store`` (None: no store)."""

    @property
    def upload_seconds(self) -> float:
        """The upload after the local save: every node its share at ``upload_bandwidth``."""
        return self.per_node_bytes / self.upload_bandwidth if self.upload_bandwidth else 0.0

    @property
    def total_seconds(self) -> float:
        """The save on the warning signal until it is committed (in the store, with one)."""
        return self.seconds + self.upload_seconds

    @property
    def too_slow(self) -> bool:
        return self.lead_s is not None and self.total_seconds > self.lead_s

    @property
    def suggested_lead_s(self) -> int:
        return signal_lead_for(self.total_seconds)

    def to_dict(self) -> dict:
        return {
            "checkpoint_bytes": self.checkpoint_bytes,
            "per_node_bytes": self.per_node_bytes,
            "node_write_bandwidth": self.node_write_bandwidth,
            "seconds": self.seconds,
            "signal": self.signal,
            "lead_s": self.lead_s,
            "too_slow": self.too_slow,
            **(
                {"upload_bandwidth": self.upload_bandwidth, "upload_seconds": self.upload_seconds}
                if self.upload_bandwidth
                else {}
            ),
        }

    def lines(self) -> list[str]:
        head = (
            f"checkpoint: {format_bytes(self.checkpoint_bytes)} (parameters and optimizer state, replicas stored "
            f"once), {format_bytes(self.per_node_bytes)} per node: about {self.seconds:,.0f} s at "
            f"{self.node_write_bandwidth / 1e9:g} GB/s per node (--write-bandwidth)"
        )
        if self.upload_bandwidth:
            head += (
                f", then about {self.upload_seconds:,.0f} s to upload it at {self.upload_bandwidth / 1e9:g} GB/s per "
                f"node (--upload-bandwidth): {self.total_seconds:,.0f} s until it is committed in the store"
            )
        if self.lead_s is None:
            return [head, "no warning signal (--signal none): a time limit or preemption ends the job without a save"]
        if self.too_slow:
            return [
                head,
                f"warning: that is longer than the {self.lead_s} s between --signal {self.signal} and the time "
                f"limit: the save on the warning would not finish; give --signal USR2@{self.suggested_lead_s} "
                f"(1.5x the save and 30 s), or a faster file system"
                + (" and a faster store" if self.upload_bandwidth else ""),
            ]
        if self.lead_s < self.suggested_lead_s:
            return [
                head,
                f"fits the {self.lead_s} s between --signal {self.signal} and the time limit with little to spare; "
                f"--signal USR2@{self.suggested_lead_s} leaves 1.5x the save and 30 s",
            ]
        return [head, f"fits the {self.lead_s} s between --signal {self.signal} and the time limit"]


def signal_lead_for(save_seconds: float) -> int:
    """Seconds of warning a save of ``save_seconds`` asks for: 1.5x the save and 30 s (rounded up)."""
    return int(-(-(1.5 * save_seconds + 30) // 1))


def signal_lead_s(signal: str | None) -> int | None:
    """Seconds before the time limit that ``--signal`` sends its signal (None: no signal)."""
    if signal is None or signal.strip().lower() == "none":
        return None
    return signal_lead_seconds(signal)


def parse_bandwidth(text: str, *, option: str = "--write-bandwidth") -> int:
    """``2GB``, ``2GB/s``, ``500MiB/s`` -> bytes per second."""
    return parse_bytes(str(text).strip().removesuffix("/s"), option=option)


def save_estimate(
    plan: TopologyPlan,
    *,
    model_params: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    node_write_bandwidth: int,
    signal: str | None,
    upload_bandwidth: int | None = None,
) -> SaveEstimate:
    """The time to write one checkpoint: every node writes its share of the unique bytes (DCP
    spreads the replicated shards over the ranks) at ``node_write_bandwidth``; with
    ``upload_bandwidth`` (``--checkpoint-store``), then uploads it at that rate."""
    precision = resolve_precision(precision)
    check_model_options(precision=precision, optimizer=optimizer)
    total = model_params * (PRECISION_BYTES[precision].state + 4 * OPTIMIZER_STATES[optimizer])
    per_node = -(-total // plan.nodes)
    return SaveEstimate(
        checkpoint_bytes=total,
        per_node_bytes=per_node,
        node_write_bandwidth=node_write_bandwidth,
        seconds=per_node / node_write_bandwidth,
        signal=signal,
        lead_s=signal_lead_s(signal),
        upload_bandwidth=upload_bandwidth,
    )
