"""The baseline of bench_hf.py: a hand-written FSDP2 HSDP script for a transformers causal LM,
no hpc-hsdp. Run once per rank with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

From a config (--model DIR with config.json): meta build, fully_shard each
``_no_split_modules`` block then the root, to_empty, the model's own ``_init_weights``.
With --pretrained: what people do without hpc-hsdp, every rank loads the whole model with
``from_pretrained`` and then shards it. Data: the same token file (np.memmap), rank r takes
rows r*B..(r+1)*B of a seeded shuffle per step. Rank 0 writes one JSON line per step to
--out: step, wall_time, step_time_s, cpu_time_s (the process's CPU seconds in the step), loss,
peak_rss_bytes (ru_maxrss).
"""

import argparse
import json
import os
import resource
import time

os.environ["HF_HUB_OFFLINE"] = "1"
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--tokens", required=True, help="a .bin token file (uint16)")
    p.add_argument("--pretrained", action="store_true")
    p.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True), as hpc-hsdp's loop builds it on CPU")
    for name, default in (("shard", 1), ("steps", 10), ("seq-len", 64), ("batch-size", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // a.shard, a.shard), mesh_dim_names=("replicate", "shard"))
    if a.pretrained:
        model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.model), dtype=torch.float32)
    blocks = tuple(model._no_split_modules)
    for module in reversed(list(model.modules())):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not a.pretrained:
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.apply(model._init_weights)
    model.train()
    kernel = {"fused": True} if a.fused_adamw else {}
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0, **kernel)
    data = np.memmap(a.tokens, dtype=np.uint16, mode="r")
    samples = (len(data) - 1) // a.seq_len
    loss_sum = torch.zeros(())
    out = open(a.out, "w") if rank == 0 else None
    for step in range(1, a.steps + 1):
        t0, cpu0 = time.perf_counter(), time.process_time()
        order = np.random.default_rng(step).permutation(samples)[rank * a.batch_size : (rank + 1) * a.batch_size]
        rows = np.stack([data[i * a.seq_len : i * a.seq_len + a.seq_len + 1] for i in order]).astype(np.int64)
        tokens = torch.from_numpy(rows)
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_sum.copy_(loss.detach())
        dist.all_reduce(loss_sum)
        loss_value = loss_sum.item() / world
        if out is not None:
            out.write(
                json.dumps(
                    {
                        "step": step,
                        "wall_time": time.time(),
                        "step_time_s": time.perf_counter() - t0,
                        "cpu_time_s": time.process_time() - cpu0,
                        "loss": loss_value,
                        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                    }
                )
                + "\n"
            )
            out.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
