"""``--precision fp8``: which Linear layers train in Float8, and whether a GPU can.

The recipe is the one torchtitan and torchao's float8 training use (tensorwise dynamic
scaling, FSDP2's float8 all-gather): a Linear converts when both of its dimensions are
multiples of 16 (what the float8 matmul kernels take) and it is large enough that the casts
cost less than the faster matmul saves; torchao's measured threshold on H100 for tensorwise
scaling skips a layer whose input features are at most 4096 *and* output features at most
1024. The output head (the logits) stays in bf16: its gradient's range is the widest, the
usual recipes leave it out. Pure: no torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FP8_MIN_CAPABILITY = (8, 9)
"""Float8 matmuls need compute capability 8.9 (Ada) or 9.0+ (Hopper and newer)."""
DIM_MULTIPLE = 16
SMALL_IN_FEATURES = 4096
SMALL_OUT_FEATURES = 1024
HEAD_NAMES = ("head", "output", "lm_head")
"""Names of the output projection in the built-in model, torchtitan's Llama and ``hf:`` models."""


@dataclass(frozen=True)
class LinearChoice:
    name: str
    out_features: int
    in_features: int
    convert: bool
    reason: str


def choose_float8_linears(
    linears: Iterable[tuple[str, int, int]],
    *,
    skip_names: tuple[str, ...] = HEAD_NAMES,
    min_size: bool = True,
) -> list[LinearChoice]:
    """Each ``(qualified name, out_features, in_features)`` Linear, converted or not and why.
    ``skip_names``: a layer whose last name component is one of these stays as it is (the
    output head); ``min_size=False`` converts small layers too (the dimensions still must fit)."""
    chosen = []
    for name, out_features, in_features in linears:
        leaf = name.rsplit(".", 1)[-1]
        if leaf in skip_names:
            verdict, reason = False, "the output head stays in bf16"
        elif out_features % DIM_MULTIPLE or in_features % DIM_MULTIPLE:
            verdict, reason = False, f"{out_features} x {in_features}: not both multiples of {DIM_MULTIPLE}"
        elif min_size and in_features <= SMALL_IN_FEATURES and out_features <= SMALL_OUT_FEATURES:
            verdict, reason = (
                False,
                f"{out_features} x {in_features}: too small to gain (in <= {SMALL_IN_FEATURES} and "
                f"out <= {SMALL_OUT_FEATURES})",
            )
        else:
            verdict, reason = True, "converted"
        chosen.append(LinearChoice(name, out_features, in_features, verdict, reason))
    return chosen


def fp8_refusal(device_type: str, capability: tuple[int, int] | None, name: str | None = None) -> str | None:
    """Why ``--precision fp8`` cannot train on this device (None: it can)."""
    if device_type != "cuda":
        return (
            "--precision fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper or newer); this task runs on "
            f"{device_type}: use --precision bf16, or run on such GPUs"
        )
    if capability is None or tuple(capability) < FP8_MIN_CAPABILITY:
        shown = "unknown" if capability is None else f"{capability[0]}.{capability[1]}"
        return (
            f"--precision fp8 needs a GPU of compute capability >= 8.9 (Ada, Hopper or newer); "
            f"{name or 'this GPU'} has {shown}: use --precision bf16"
        )
    return None


# ----------------------------------------------------------------------------- GPUs known by name

_NEW = {
    # Hopper 9.0, Blackwell 10.x / 12.0, Ada 8.9
    **dict.fromkeys(("h100", "h200", "h800", "h20", "gh200"), (9, 0)),
    **dict.fromkeys(("b100", "b200", "gb200"), (10, 0)),
    **dict.fromkeys(("b300", "gb300"), (10, 3)),
    **dict.fromkeys(("rtx5090", "rtx5080", "rtxpro6000", "rtxpro6000blackwell"), (12, 0)),
    **dict.fromkeys(("l4", "l40", "l40s", "l20", "rtx4090", "rtx4080", "rtx4070", "rtx6000ada", "rtx5000ada"), (8, 9)),
    **dict.fromkeys(("rtx4500ada", "rtx4000ada", "rtx2000ada"), (8, 9)),
}
_OLD = {
    **dict.fromkeys(("a100", "a800", "a30"), (8, 0)),
    **dict.fromkeys(("a40", "a10", "a10g", "a16", "a2", "a6000", "a5000", "a4500", "a4000"), (8, 6)),
    **dict.fromkeys(("rtxa6000", "rtxa5000", "rtxa4000", "rtx3090", "rtx3080", "rtx3070"), (8, 6)),
    **dict.fromkeys(("v100", "v100s", "titanv"), (7, 0)),
    **dict.fromkeys(("t4", "rtx6000", "rtx8000", "rtx2080", "rtx2080ti", "titanrtx"), (7, 5)),
    "p100": (6, 0),
    **dict.fromkeys(("p40", "p4", "titanxp"), (6, 1)),
    **dict.fromkeys(("k80",), (3, 7)),
}
GPU_CAPABILITIES: dict[str, tuple[int, int]] = {**_NEW, **_OLD}
"""Compute capability of the NVIDIA GPUs known by name, as SLURM GRES types and node features
spell them (``h100``, ``a100``, ``rtx6000ada``) and as the driver names them (``NVIDIA H100 80GB
HBM3``): every other name is unknown, and a task that gets such a GPU decides at its start."""
_VENDOR_WORDS = frozenset(("nvidia", "tesla", "geforce", "quadro"))


def gpu_capability(name: str | None) -> tuple[int, int] | None:
    """The compute capability of a GPU by its name (a GRES type such as ``h100``, ``h100_80gb``
    or ``nvidia_a100-sxm4-80gb``, a node feature, or the driver's ``NVIDIA GeForce RTX 4090``),
    case-insensitive; None: not a GPU this table knows. The longest run of the name's leading
    words that is a known name wins (``rtx 6000 ada`` before ``rtx 6000``); a first word that
    is a known name followed by letters is that name (``h100nvl``), one followed by digits is
    not (``h200`` is not ``h20``)."""
    if not name:
        return None
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w and w not in _VENDOR_WORDS]
    for size in range(min(len(words), 3), 0, -1):
        known = GPU_CAPABILITIES.get("".join(words[:size]))
        if known is not None:
            return known
    if words:  # a known name run on into letters: h100nvl, rtx4090d
        for known_name in sorted(GPU_CAPABILITIES, key=len, reverse=True):
            rest = words[0][len(known_name) :]
            if words[0].startswith(known_name) and rest[:1].isalpha():
                return GPU_CAPABILITIES[known_name]
    return None


def capability_text(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def can_train_fp8(capability: tuple[int, int] | None) -> bool | None:
    """True/False for a known compute capability, None for an unknown one."""
    return None if capability is None else tuple(capability) >= FP8_MIN_CAPABILITY


NEEDS = "--precision fp8 needs GPUs of compute capability >= 8.9 (Ada, Hopper or newer)"
NOTHING_SUBMITTED = "; nothing submitted"


def fp8_local_refusal(gpus: Sequence[tuple[str, tuple[int, int] | None]] | None) -> str | None:
    """Why the local emulator cannot train ``--precision fp8`` on this machine (its tasks run here).
    ``gpus``: this machine's NVIDIA GPUs as (name, compute capability or None when the driver did
    not say it); an empty list: no GPU at all; None: it could not be told (the tasks decide)."""
    if gpus is None:
        return None
    if not gpus:
        return (
            f"{NEEDS}; this machine has no GPU, so the local emulator's tasks train on CPU: use --precision bf16 "
            f"or fp32 on CPU, or submit to a cluster with such GPUs{NOTHING_SUBMITTED}"
        )
    verdicts = [(name, capability or gpu_capability(name)) for name, capability in gpus]
    if any(can_train_fp8(capability) is not False for _, capability in verdicts):
        return None
    shown = ", ".join(
        sorted({f"{name} ({capability_text(capability)})" for name, capability in verdicts if capability is not None})
    )
    return (
        f"{NEEDS}; this machine's GPUs, where the local emulator's tasks run, are {shown}: use --precision bf16"
        f"{NOTHING_SUBMITTED}"
    )


@dataclass(frozen=True)
class NodeGpus:
    """What SLURM says one node offers: its GPU GRES as (type or None when untyped, count), and
    its features (a site with untyped GRES often names the GPU there: ``Features=a100,ib``)."""

    node: str
    gpus: tuple[tuple[str | None, int], ...]
    features: tuple[str, ...] = ()

    @property
    def capabilities(self) -> tuple[tuple[str, tuple[int, int] | None], ...]:
        """(type, capability or None when unknown) of each kind of GPU the node has; a node
        without GPU GRES has none. An untyped GRES takes its type from a known feature."""
        found = []
        for gpu_type, count in self.gpus:
            if count < 1:
                continue
            if gpu_type is None:
                named = [(f, gpu_capability(f)) for f in self.features if gpu_capability(f) is not None]
                found.extend(named or [("gpu", None)])
            else:
                found.append((gpu_type, gpu_capability(gpu_type)))
        return tuple(found)


def fp8_slurm_refusal(nodes: Sequence[NodeGpus], *, where: str, gpus_per_node: int = 1) -> str | None:
    """Why ``--precision fp8`` cannot train on any node the job may get (``where``: those nodes
    in words, e.g. ``partition 'gpu'``); None when one may (a known-new or an unknown GPU type),
    or when no node is known (the scheduler says what is wrong, or the tasks decide). Of nodes
    with fewer than ``gpus_per_node`` GPUs (``--gpus-per-node``) SLURM gives none, when others have
    enough."""
    if not nodes:
        return None
    enough = [node for node in nodes if sum(count for _, count in node.gpus) >= gpus_per_node]
    nodes = enough or nodes
    found = [capability for node in nodes for capability in node.capabilities]
    if not found:
        return (
            f"{NEEDS}; the nodes of {where} have no GPUs (no gpu GRES), so the job's tasks would train on CPU: "
            f"use --precision bf16 or fp32, or a partition with such GPUs (--partition){NOTHING_SUBMITTED}"
        )
    if any(can_train_fp8(capability) is not False for _, capability in found):
        return None
    shown = ", ".join(
        sorted({f"{name} ({capability_text(capability)})" for name, capability in found if capability is not None})
    )
    gpuless = " and nodes without GPUs" if any(not node.capabilities for node in nodes) else ""
    return (
        f"{NEEDS}; {where} has only {shown}{gpuless}: use --precision bf16, or a partition (--partition) or "
        f"--constraint with such GPUs{NOTHING_SUBMITTED}"
    )
