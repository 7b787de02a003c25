"""A model of one's own with a tensor-parallel plan (``--model tp_factory:build``; the factory
contract's item 7): separate q/k/v projections split by heads, the feed-forward by width, the LM
head by vocabulary with its logits left sharded for the loss; the heads come from the split's
width, so the forward works on either."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.out = nn.Linear(width, width, bias=False)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.out(y)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TPLM(nn.Module):
    shard_units = (Block,)
    loss_parallel = True

    def __init__(self, *, vocab_size: int, width: int, heads: int, layers: int) -> None:
        super().__init__()
        self.vocab_size, self.heads = vocab_size, heads
        self.embed = nn.Embedding(vocab_size, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def tp_plan(self, tp_size: int) -> dict:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from hpc_hsdp.errors import SpecError

        if self.heads % tp_size or self.vocab_size % tp_size:
            raise SpecError(f"--tp {tp_size} does not divide TPLM's {self.heads} heads and {self.vocab_size} tokens")
        plan = {"head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
        for i in range(len(self.blocks)):
            plan |= {f"blocks.{i}.{name}": ColwiseParallel() for name in ("q", "k", "v", "up")}
            plan |= {f"blocks.{i}.{name}": RowwiseParallel() for name in ("out", "down")}
        return plan


def build(training):
    return TPLM(
        vocab_size=training.model.vocab_size,
        width=training.model.width,
        heads=training.model.heads,
        layers=training.model.layers,
    )
