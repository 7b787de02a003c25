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

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hpc_hsdp.plan.shapes import ParameterCounts
from hpc_hsdp.plan.shapes import parameter_counts as _parameter_counts


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    seq_len: int
    width: int
    heads: int
    layers: int

    @classmethod
    def from_training(cls, training, *, vocab_size: int | None = None) -> ModelConfig:
        """The model of a TrainingSpec; ``vocab_size`` (a dataset's) replaces ``training.vocab_size``."""
        return cls(
            vocab_size=vocab_size or training.vocab_size,
            seq_len=training.seq_len,
            width=training.width,
            heads=training.heads,
            layers=training.layers,
        )


def parameter_counts(cfg: ModelConfig, *, shard_size: int = 1) -> ParameterCounts:
    """Parameters and root parameters of the built-in model on a shard group of ``shard_size``
    (dim 0 padded as FSDP2 pads it). The one helper the estimates, ``plan`` and tests use;
    pure (in ``runtime/shapes.py``) so that ``plan`` needs no torch."""
    return _parameter_counts(
        vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, width=cfg.width, layers=cfg.layers, shard_size=shard_size
    )


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


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


class BuiltinAdapter:
    """``--model builtin`` for the loop (see :mod:`hpc_hsdp.models.base`)."""

    name = "builtin"
    has_pretrained_weights = False

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
        init_parameters(model, seed=seed)

    def load_pretrained(self, model: nn.Module) -> None:
        raise NotImplementedError("the built-in model has no pretrained weights")

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(model(inputs), targets)

    def logits(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model(inputs)

    def describe(self) -> dict:
        """What run.json's model record holds (export rebuilds the model from it)."""
        return {"kind": "builtin", "config": asdict(self.cfg)}
