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


@dataclass(frozen=True, kw_only=True)
class TpDims:
    """The sizes of a model that tensor parallelism splits over T ranks, each with where it is set."""

    model: str
    """How the messages name the model: ``the built-in model``, ``hf:/models/llama``."""
    heads: tuple[int, str]
    """(attention heads, where they are set): each rank computes whole heads."""
    kv_heads: tuple[int, str]
    """Key/value heads (grouped-query attention; the attention heads where there is no grouping)."""
    ffn_width: tuple[int, str]
    """The feed-forward layer's inner width: split by its columns, then rows."""
    vocab_size: tuple[int, str] | None
    """The embedding's and the head's rows (the loss runs on vocabulary shards); None: not known here."""
    seq_len: tuple[int, str] | None
    """Tokens per sample, where the plan is sequence parallel (it splits the activations between
    blocks over them: the built-in model's); None where it is not (a transformers model's plan)."""

    def sizes(self) -> list[tuple[str, int, str]]:
        named = [
            ("attention heads", self.heads),
            ("key/value heads", self.kv_heads),
            ("feed-forward width", self.ffn_width),
            ("vocabulary", self.vocab_size),
            ("sequence length", self.seq_len),
        ]
        return [(what, pair[0], pair[1]) for what, pair in named if pair is not None]


def builtin_tp_dims(*, heads: int, width: int, vocab_size: int | None, seq_len: int) -> TpDims:
    """The built-in model's :class:`TpDims` (no grouped-query attention; feed-forward width 4 x width);
    ``vocab_size`` None where the data decides it and is not read here."""
    return TpDims(
        model="the built-in model",
        heads=(heads, "--heads"),
        kv_heads=(heads, "--heads"),
        ffn_width=(4 * width, "4 x --width"),
        vocab_size=None if vocab_size is None else (vocab_size, "--vocab-size, or the data's"),
        seq_len=(seq_len, "--seq-len"),
    )


def tp_refusal(dims: TpDims, tp_size: int) -> str | None:
    """Why ``dims``' model cannot be split over ``tp_size`` ranks, in one line ending with the fix
    (None: it can). The one check of ``plan``, ``render``, ``submit`` and the tasks: T must divide
    the attention heads, the key/value heads, the feed-forward width, the vocabulary and, where the
    plan is sequence parallel, the sequence length."""
    if tp_size == 1:
        return None
    sizes = dims.sizes()
    for what, size, where in sizes:
        if size % tp_size:
            fits = [t for t in range(2, max(s for _, s, _ in sizes) + 1) if all(s % t == 0 for _, s, _ in sizes)]
            fix = (
                f"use --tp {', '.join(map(str, fits[:6]))}{' ...' if len(fits) > 6 else ''} (dividing every one)"
                if fits
                else "no --tp above 1 divides them all"
            )
            split = "heads, key/value heads, feed-forward width, vocabulary" + (
                " and sequence" if dims.seq_len is not None else ""
            )
            return (
                f"--tp {tp_size} does not divide {dims.model}'s {size} {what} ({where}): tensor parallelism splits "
                f"the {split} over the TP group; {fix}, or --tp 1"
            )
    return None
