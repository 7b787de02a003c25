"""The baseline of bench_runtime.py: a minimal hand-written FSDP2 HSDP job, no hpc-hsdp.

Run once per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT set (what
srun + a few export lines give): init_process_group, init_device_mesh, fully_shard each
block then the root, AdamW, train. The model is the same architecture as hpc-hsdp's
built-in one, written out here so that none of hpc-hsdp is imported. Writes one JSON line
per step to --out (rank 0): step, wall_time (end of the step), step_time_s, cpu_time_s (the
process's CPU seconds in the step, all threads).

    python benchmarks/handwritten_fsdp2.py --shard 2 --steps 20 --out times.jsonl [--layers 4 --width 128 ...]

The training options of bench_loop.py, written the way a person writes them by hand:
``--precision bf16`` (MixedPrecisionPolicy: bf16 params, fp32 reduction), ``--grad-accum N``
(set_requires_all_reduce on the last micro-batch only), ``--clip-grad`` (clip_grad_norm_ on
the DTensor gradients), ``--cosine`` with ``--warmup-steps`` (LambdaLR), and ``--data FILE.bin``
(uint16/uint32 tokens read with np.memmap at random offsets, nanoGPT's get_batch).
"""

import argparse
import json
import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


class Block(nn.Module):
    def __init__(self, w, heads):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.LayerNorm(w), nn.LayerNorm(w)
        self.qkv, self.proj = nn.Linear(w, 3 * w), nn.Linear(w, w)
        self.fc, self.out = nn.Linear(w, 4 * w), nn.Linear(4 * w, w)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.mlp_norm(x))))


class Model(nn.Module):
    def __init__(self, vocab, seq, w, heads, layers):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, w), nn.Embedding(seq, w)
        self.blocks = nn.ModuleList(Block(w, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(w), nn.Linear(w, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def init_weights(model):
    """As the built-in model: norms 1/0, biases 0, weights N(0, 0.02), seed 0."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0, 0.02)


def main():
    p = argparse.ArgumentParser()
    for name, default in (
        ("shard", 1),
        ("steps", 20),
        ("layers", 2),
        ("width", 64),
        ("heads", 4),
        ("seq-len", 32),
        ("batch-size", 4),
        ("vocab-size", 256),
        ("grad-accum", 1),
        ("warmup-steps", 0),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--clip-grad", type=float, default=0.0)
    p.add_argument("--cosine", action="store_true")
    p.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True), as hpc-hsdp's loop builds it on CPU")
    p.add_argument("--data", default=None)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // a.shard, a.shard), mesh_dim_names=("replicate", "shard"))
    with torch.device("meta"):
        model = Model(a.vocab_size, a.seq_len, a.width, a.heads, a.layers)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if a.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cpu")
    init_weights(model)
    kernel = {"fused": True} if a.fused_adamw else {}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, **kernel)

    def lr_factor(i):  # i = 0 for the first step
        if a.warmup_steps and i < a.warmup_steps:
            return (i + 1) / a.warmup_steps
        if not a.cosine:
            return 1.0
        progress = (i + 1 - a.warmup_steps) / max(1, a.steps - a.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(rank)
    if a.data:
        meta = json.load(open(a.data[: -len(".bin")] + ".json"))
        tokens_file = np.memmap(a.data, dtype=np.dtype(meta["dtype"]), mode="r")

    def get_batch():
        if not a.data:
            return torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len + 1), generator=gen)
        ix = torch.randint(len(tokens_file) - a.seq_len - 1, (a.batch_size,), generator=gen).tolist()
        return torch.from_numpy(np.stack([tokens_file[i : i + a.seq_len + 1].astype(np.int64) for i in ix]))

    loss_sum = torch.zeros(())
    out = open(a.out, "w") if rank == 0 else None
    for step in range(1, a.steps + 1):
        t0, cpu0 = time.perf_counter(), time.process_time()
        for micro in range(a.grad_accum):
            if a.grad_accum > 1:
                model.set_requires_all_reduce(micro == a.grad_accum - 1)
            tokens = get_batch()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
            (loss / a.grad_accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip_grad if a.clip_grad > 0 else float("inf"))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)
        loss_value = loss_sum.item() / (world * a.grad_accum)
        loss_sum.zero_()
        norm_value = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        step_time, cpu_time = time.perf_counter() - t0, time.process_time() - cpu0
        if out is not None:
            out.write(
                json.dumps(
                    {
                        "step": step,
                        "wall_time": time.time(),
                        "step_time_s": step_time,
                        "cpu_time_s": cpu_time,
                        "loss": loss_value,
                        "grad_norm": norm_value,
                    }
                )
                + "\n"
            )
            out.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
