"""A peer of bench_peers.py: the same HSDP job written with Lightning Fabric, no hpc-hsdp.

Runs in the benchmark's own virtual environment (benchmarks/.peers-venv, made by
bench_peers.py) once per task of an emulated SLURM job step: Fabric's SLURMEnvironment
reads the task's SLURM variables (it needs SLURM_NTASKS_PER_NODE, which sbatch
--ntasks-per-node sets). Writes one JSON line per step to --out (rank 0): step,
wall_time (end of the step), step_time_s, loss, grad_norm.

    python benchmarks/peer_lightning.py --strategy fsdp1|fsdp2 --shard 2 --steps 20 --out times.jsonl
        [--layers 4 --width 128 ...] [--hf-config DIR]

``fsdp2``: ``ModelParallelStrategy`` (FSDP2), whose ``parallelize_fn`` calls ``fully_shard``
on each block then the root on Fabric's 2-D ``(data_parallel, tensor_parallel)`` mesh used
as ``(replicate, shard)``: the same HSDP layout as hpc-hsdp's.

``fsdp1``: ``FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(R, S))`` with each
block its own FSDP unit. Lightning refuses it on CPU (``fabric/connector.py`` checks
``type(strategy) is FSDPStrategy`` against a GPU accelerator), builds the tuple mesh with
``init_device_mesh("cuda", ...)`` and passes ``device_id=root_device.index`` (None on CPU).
The workaround here is a subclass, :class:`CPUHybridFSDP`, that passes the type check, builds
the mesh on CPU and wraps with ``device_id=torch.device("cpu")``; everything else is
Lightning's own code path.

Same model (benchmarks/handwritten_fsdp2.py's, or a transformers model from --hf-config),
initialisation, synthetic data (torch.randint per rank), AdamW and loop (loss mean and
global gradient norm on the host every step) as the hand-written script.
"""

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402


class CPUHybridFSDP(FSDPStrategy):
    """Lightning's FSDP1 strategy, allowed on CPU (see the module docstring)."""

    def setup_environment(self) -> None:
        shape = self._fsdp_kwargs.get("device_mesh")
        if isinstance(shape, tuple):
            from torch.distributed.device_mesh import init_device_mesh

            self._fsdp_kwargs.pop("device_mesh")
            super().setup_environment()
            self._fsdp_kwargs["device_mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        else:
            super().setup_environment()

    def setup_module(self, module):
        from torch.distributed.fsdp import FullyShardedDataParallel

        kwargs = dict(self._fsdp_kwargs)
        module = FullyShardedDataParallel(
            module=module,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **kwargs,
        )
        self._fsdp_kwargs.pop("auto_wrap_policy", None)  # already applied above
        return super().setup_module(module)


def build_model(a):
    if a.hf_config:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(a.hf_config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        block_names = set(getattr(model, "_no_split_modules", None) or ())
        blocks = tuple({type(m) for m in model.modules() if type(m).__name__ in block_names})
        return model, blocks, config.vocab_size
    from handwritten_fsdp2 import Block, Model

    with torch.device("meta"):
        model = Model(a.vocab_size, a.seq_len, a.width, a.heads, a.layers)
    return model, (Block,), a.vocab_size


def main():
    p = argparse.ArgumentParser()
    for name, default in (
        ("shard", 2),
        ("steps", 20),
        ("layers", 2),
        ("width", 64),
        ("heads", 4),
        ("seq-len", 32),
        ("batch-size", 4),
        ("vocab-size", 256),
    ):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--strategy", choices=("fsdp1", "fsdp2"), required=True)
    p.add_argument("--hf-config", default=None, help="a directory with a transformers config.json")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    nodes, per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
    world = nodes * per_node
    model, blocks, vocab = build_model(a)
    if a.strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        def parallelize(module, mesh):  # Fabric's (data_parallel, tensor_parallel) mesh as (replicate, shard)
            for m in [m for m in module.modules() if isinstance(m, blocks)]:
                fully_shard(m, mesh=mesh)
            fully_shard(module, mesh=mesh, reshard_after_forward=False)
            return module

        strategy = ModelParallelStrategy(parallelize, data_parallel_size=world // a.shard, tensor_parallel_size=a.shard)
    else:
        strategy = CPUHybridFSDP(
            sharding_strategy="HYBRID_SHARD",
            device_mesh=(world // a.shard, a.shard),
            auto_wrap_policy=set(blocks),
            use_orig_params=True,
        )
    fabric = Fabric(accelerator="cpu", devices=per_node, num_nodes=nodes, strategy=strategy, precision="32-true")
    fabric.launch()
    rank = fabric.global_rank
    if a.strategy == "fsdp2":
        model = fabric.setup_module(model)  # parallelize_fn, then materialised on the CPU
    else:
        model.to_empty(device="cpu")  # FSDP1 flattens real tensors: materialise before wrapping
    if a.hf_config:  # transformers' own initialisation, as benchmarks/handwritten_hf_fsdp2.py
        torch.manual_seed(0)
        with torch.no_grad():
            model.apply(model._init_weights)
    else:
        from handwritten_fsdp2 import init_weights

        init_weights(model)
    if a.strategy == "fsdp1":
        model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0))
    gen = torch.Generator().manual_seed(rank)
    out = open(a.out, "w") if rank == 0 else None
    for step in range(1, a.steps + 1):
        t0 = time.perf_counter()
        tokens = torch.randint(0, vocab, (a.batch_size, a.seq_len + 1), generator=gen)
        if a.hf_config:
            logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        else:
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        fabric.backward(loss)
        grad_norm = fabric.clip_gradients(model, opt, max_norm=math.inf)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = fabric.all_reduce(loss.detach(), reduce_op="mean").item()
        norm_value = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        step_time = time.perf_counter() - t0
        if out is not None:
            out.write(
                json.dumps(
                    {
                        "step": step,
                        "wall_time": time.time(),
                        "step_time_s": step_time,
                        "loss": loss_value,
                        "grad_norm": norm_value,
                    }
                )
                + "\n"
            )
            out.flush()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
