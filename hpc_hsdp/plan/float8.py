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

from collections.abc import Iterable
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
