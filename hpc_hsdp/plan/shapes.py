"""Parameter shapes of the built-in model, without torch (so ``hpc-hsdp plan`` can use them).

``models/builtin.py`` builds the model these shapes describe and re-exports
:func:`parameter_counts`; a test checks the two agree parameter by parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True, kw_only=True)
class ParameterCounts:
    """Parameters of a model as FSDP2 holds them on a shard group of ``shard_size`` ranks."""

    params: int
    """All parameters (padded: every dim-0 rounded up to a multiple of ``shard_size``)."""
    root_params: int
    """Of those, the ones in the root module (not inside a block): gathered once per step."""
    unpadded_params: int
    """All parameters without padding (what ``sum(p.numel())`` says)."""
    shard_size: int


def builtin_shapes(
    *, vocab_size: int, seq_len: int, width: int, layers: int
) -> list[tuple[str, tuple[int, ...], bool]]:
    """``(name, shape, in_root)`` of every parameter of the built-in Transformer, in order."""
    w = width
    out: list[tuple[str, tuple[int, ...], bool]] = [
        ("tok_emb.weight", (vocab_size, w), True),
        ("pos_emb.weight", (seq_len, w), True),
    ]
    block = [
        ("attn_norm.weight", (w,)),
        ("attn_norm.bias", (w,)),
        ("attn.qkv.weight", (3 * w, w)),
        ("attn.qkv.bias", (3 * w,)),
        ("attn.proj.weight", (w, w)),
        ("attn.proj.bias", (w,)),
        ("mlp_norm.weight", (w,)),
        ("mlp_norm.bias", (w,)),
        ("mlp.fc.weight", (4 * w, w)),
        ("mlp.fc.bias", (4 * w,)),
        ("mlp.proj.weight", (w, 4 * w)),
        ("mlp.proj.bias", (w,)),
    ]
    for i in range(layers):
        out += [(f"blocks.{i}.{name}", shape, False) for name, shape in block]
    out += [("norm.weight", (w,), True), ("norm.bias", (w,), True), ("head.weight", (vocab_size, w), True)]
    return out


def padded_numel(shape: tuple[int, ...], shard_size: int) -> int:
    """Elements FSDP2 allocates for a parameter sharded on dim 0 over ``shard_size`` ranks."""
    rows = -(-shape[0] // shard_size) * shard_size
    return rows * prod(shape[1:])


def parameter_counts(
    *, vocab_size: int, seq_len: int, width: int, layers: int, shard_size: int = 1, **_ignored
) -> ParameterCounts:
    """The built-in model's parameter counts for ``hpc-hsdp plan --model-params`` and the
    estimates (accepts a TrainingSpec's fields as keywords; the others are ignored)."""
    shapes = builtin_shapes(vocab_size=vocab_size, seq_len=seq_len, width=width, layers=layers)
    return ParameterCounts(
        params=sum(padded_numel(s, shard_size) for _, s, _ in shapes),
        root_params=sum(padded_numel(s, shard_size) for _, s, root in shapes if root),
        unpadded_params=sum(prod(s) for _, s, _ in shapes),
        shard_size=shard_size,
    )
