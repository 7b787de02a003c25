"""The built-in model (``--model builtin``): a small decoder-only transformer (nanoGPT-like).

Embedding + learned positions, ``layers`` pre-norm blocks (causal self-attention, MLP),
final norm, LM head (not tied, so that every parameter belongs to exactly one FSDP unit).

:func:`init_parameters` gives every parameter a full value that depends only on the seed
and the parameter's name; a sharded (DTensor) parameter takes its shard of that value.
So a model is the same whatever the mesh: (2, 4), (1, 8) or no FSDP at all.
:class:`BuiltinAdapter` is its :class:`~hpc_hsdp.models.base.ModelAdapter`.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hpc_hsdp.plan.shapes import ParameterCounts, builtin_tp_dims
from hpc_hsdp.plan.shapes import parameter_counts as _parameter_counts
from hpc_hsdp.plan.shapes import tp_refusal as shapes_tp_refusal


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    seq_len: int
    width: int
    heads: int
    layers: int

    @classmethod
    def from_training(cls, training, *, vocab_size: int | None = None) -> ModelConfig:
        """The model of a TrainingSpec; ``vocab_size`` (a dataset's) replaces ``training.model.vocab_size``."""
        return cls(
            vocab_size=vocab_size or training.model.vocab_size,
            seq_len=training.dataset.seq_len,
            width=training.model.width,
            heads=training.model.heads,
            layers=training.model.layers,
        )


def parameter_counts(cfg: ModelConfig, *, shard_size: int = 1) -> ParameterCounts:
    """Parameters and root parameters of the built-in model on a shard group of ``shard_size``
    (dim 0 padded as FSDP2 pads it). The one helper the estimates, ``plan`` and tests use;
    pure (in ``task/shapes.py``) so that ``plan`` needs no torch."""
    return _parameter_counts(
        vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, width=cfg.width, layers=cfg.layers, shard_size=shard_size
    )


class SelfAttention(nn.Module):
    """Causal self-attention. ``qkv``'s output rows are head-major: head 0's query, key and value,
    then head 1's, ...; so a tensor-parallel split of its rows into T equal parts gives each rank
    whole heads (query, key and value of each), and the forward reads the heads it holds."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.width // cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        heads = qkv.shape[-1] // (3 * self.head_dim)  # all of them, or this rank's under tensor parallelism
        q, k, v = (z.transpose(1, 2) for z in qkv.view(b, t, heads, 3, self.head_dim).unbind(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.proj = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class TransformerBlock(nn.Module):
    """Pre-norm: x + attn(norm(x)), then x + mlp(norm(x)). The unit ``fully_shard`` wraps."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.width)
        self.attn = SelfAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.width)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.width)
        self.blocks = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def full_init_value(name: str, shape: torch.Size, *, seed: int, layers: int) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``name``: seed and name only."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias") or name.endswith("norm.bias"):
        return torch.zeros(shape)
    std = 0.02
    if name.endswith("proj.weight"):  # residual outputs, GPT-2 scaling
        std = 0.02 / math.sqrt(2 * layers)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_parameters(model: Transformer, *, seed: int) -> None:
    """Set every parameter (plain or DTensor shard) to its seed-determined value.

    Each rank builds the full value on the CPU and keeps its own shard: simple and
    mesh-independent, at the cost of one full parameter at a time per rank.
    """
    layers = model.cfg.layers
    for name, param in model.named_parameters():
        full = full_init_value(name, param.shape, seed=seed, layers=layers)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


def build_model(cfg: ModelConfig, *, device: torch.device | str = "meta") -> Transformer:
    with torch.device(device):
        return Transformer(cfg)


def tp_refusal(cfg: ModelConfig, tp_size: int) -> str | None:
    """Why the model cannot be split over ``tp_size`` ranks (None: it can): the one check of
    :func:`hpc_hsdp.plan.shapes.tp_refusal`."""
    dims = builtin_tp_dims(heads=cfg.heads, width=cfg.width, vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
    return shapes_tp_refusal(dims, tp_size)


def tp_plan(cfg: ModelConfig, tp_size: int, *, layers: int) -> dict:
    """The built-in model's tensor-parallel plan (module name -> parallel style), in the style of
    Megatron's and torchtitan's: between blocks the activations are split over the sequence
    (sequence parallelism: the norms run on 1/T of the tokens); inside a block they are gathered,
    ``qkv`` and ``mlp.fc`` split by output rows (whole heads: see :class:`SelfAttention`), ``proj``
    by input columns, reduce-scattered back over the sequence; the embeddings split by rows, the
    LM head by vocabulary, its output left sharded for the loss. Raises SpecError (one line) where
    ``tp_size`` does not divide the model."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415 - only under --tp
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415 - only under --tp
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from hpc_hsdp.errors import SpecError  # noqa: PLC0415 - with the styles

    refusal = tp_refusal(cfg, tp_size)
    if refusal:
        raise SpecError(refusal)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(layers):
        plan |= {
            f"blocks.{i}.attn_norm": SequenceParallel(),
            f"blocks.{i}.attn": gather,
            f"blocks.{i}.attn.qkv": ColwiseParallel(),
            f"blocks.{i}.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
            f"blocks.{i}.mlp_norm": SequenceParallel(),
            f"blocks.{i}.mlp": gather,
            f"blocks.{i}.mlp.fc": ColwiseParallel(),
            f"blocks.{i}.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan


class BuiltinAdapter:
    """``--model builtin`` for the loop (see :mod:`hpc_hsdp.models.base`)."""

    name = "builtin"
    has_pretrained_weights = False
    layout = "qkv head-major"
    """How the model lays out its tensors, saved with each checkpoint: a checkpoint of another layout
    (the fused q|k|v rows of hpc-hsdp before tensor parallelism) is refused at resume, not misread."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.vocab_size = cfg.vocab_size

    @classmethod
    def from_training(cls, training, *, data_vocab_size: int | None = None) -> BuiltinAdapter:
        return cls(ModelConfig.from_training(training, vocab_size=data_vocab_size))

    def build_meta(self) -> Transformer:
        return build_model(self.cfg, device="meta")

    def shard_units(self, model: nn.Module) -> tuple[type, ...]:
        return (TransformerBlock,)

    def init_weights(self, model: nn.Module, *, seed: int) -> None:
        init_parameters(cast(Transformer, model), seed=seed)  # the model build_meta made

    def load_pretrained(self, model: nn.Module) -> None:
        raise NotImplementedError("the built-in model has no pretrained weights")

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(inputs), targets)

    def logits(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model(inputs)

    def tp_plan(self, model: nn.Module, tp_size: int) -> dict:
        """The tensor-parallel plan over ``tp_size`` ranks (see :func:`tp_plan`)."""
        return tp_plan(self.cfg, tp_size, layers=len(cast(Transformer, model).blocks))

    loss_parallel = True
    """Under tensor parallelism the LM head's output stays sharded over the vocabulary and the loss
    is computed on the shards (``torch.distributed.tensor.parallel.loss_parallel``)."""

    def describe(self) -> dict:
        """What run.json's model record holds (export rebuilds the model from it)."""
        return {"kind": "builtin", "config": asdict(self.cfg), "layout": self.layout}
