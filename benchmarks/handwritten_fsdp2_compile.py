"""The field's FSDP2 + per-block compile script, written by hand (torch and transformers only,
no hpc-hsdp): the baseline of ``gpu_compile_fp8.py`` at 1.1B.

As torchtitan writes it: the model built on the meta device, each decoder layer compiled
(``torch.compile`` of the layer, before ``fully_shard``), ``fully_shard`` of each layer then
of the root with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``to_empty``
and the model's own initialisation, AdamW (foreach), random tokens, one host sync a step for
the loss. One process; prints one JSON line: tokens/s (median of the timed steps), peak
memory, the first step's time (which holds the compile), the last loss.

    python benchmarks/handwritten_fsdp2_compile.py --config llama.json --seq-len 2048 --batch-size 4
    python benchmarks/handwritten_fsdp2_compile.py --tiny --device cpu     # the code path on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

TINY = {
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="a transformers config.json (model_type and its fields)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama, for the CPU")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true", help="the same script eager")
    args = parser.parse_args(argv)
    if not args.tiny and not args.config:
        parser.error("give --config FILE or --tiny")

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(TINY if args.tiny else json.loads(Path(args.config).read_text()))
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for index, layer in enumerate(model.model.layers):
        if not args.no_compile:
            layer = torch.compile(layer)
            model.model.layers.register_module(str(index), layer)
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights() if hasattr(model, "init_weights") else model.apply(model._init_weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    generator = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        tokens = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator)
        tokens = tokens.to(device, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # the step's one host sync
        times.append(time.perf_counter() - t0)
    timed = times[args.warmup :]
    tokens_per_step = args.batch_size * args.seq_len
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    print(
        json.dumps(
            {
                "tokens_per_s": tokens_per_step / statistics.median(timed),
                "step_time_s": statistics.median(timed),
                "first_step_s": times[0],
                "compile_s": max(0.0, times[0] - statistics.median(timed)) if not args.no_compile else 0.0,
                "peak_bytes": peak,
                "last_loss": losses[-1],
            }
        )
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
