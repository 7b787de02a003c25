"""A model of your own under `hpc-hsdp run --model my_model:build` (the factory contract of
hpc_hsdp.models.factory): blocks named in ``shard_units``, a ``vocab_size``, and either a
``loss(inputs, targets)`` method or a ``forward`` that returns logits.

    PYTHONPATH=examples hpc-hsdp run --shard 2 --run-dir runs/mine --model my_model:build --data data/
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.out = nn.Linear(width, width, bias=False)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    shard_units = (Block,)

    def __init__(self, *, vocab_size: int, width: int, heads: int, layers: int, max_len: int = 1024) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, width)
        self.pos = nn.Parameter(torch.zeros(max_len, width))  # set by init_module below
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied: both stay in the root unit

    def init_module(self, module: nn.Module) -> None:
        """Called for every module after its reset_parameters(), under a seeded RNG."""
        if module is self:  # the root comes last: its own tensors, and the tied embedding/head
            nn.init.normal_(self.pos, std=0.01)
            nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs) + self.pos[: inputs.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(training):
    """The factory: the run's TrainingSpec in, a module built on the current default device out."""
    return TinyLM(
        vocab_size=training.model.vocab_size,
        width=training.model.width,
        heads=training.model.heads,
        layers=training.model.layers,
    )
