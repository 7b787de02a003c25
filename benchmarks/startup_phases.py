"""Where `hpc-hsdp run`'s start-up goes: the calls it makes before step 1, timed one by one.

Run once per task of an emulated SLURM job step (bench_peers.py --startup does it) with
BENCH_LAUNCHED_AT set to the Unix time just before the processes started. Rank 0 prints
one JSON line: seconds from the launch to the end of each phase, in order:

  interpreter  the Python interpreter up, before any import
  imports      torch, torch.distributed, FSDP and hpc_hsdp's runtime (what `hpc-hsdp run` imports)
  layout       RankLayout.from_env (pure: SLURM's variables -> node-major rank)
  rendezvous   dist.init_process_group (gloo, env://): the TCP store, every rank connected
  mesh         init_device_mesh (the ("replicate", "shard") sub-groups)
  group check  all_gather_object of every rank's node and groups, compare_groups against the plan
  model        build_model: meta build, fully_shard per block + root, to_empty, initialisation
  optimizer    make_optimizer
  step 1       the first training step (loss + gradient norm on the host)

The calls are those of hpc_hsdp.task.parallelism.dist.init and hpc_hsdp.task.training.loop.train, made in
the same order without the run directory's files, signal handlers and watchdog.
"""

import json
import os
import sys
import time

marks = [("interpreter", time.time())]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from hpc_hsdp.job.spec import TrainingSpec  # noqa: E402
from hpc_hsdp.models import resolve_model  # noqa: E402
from hpc_hsdp.plan.topology import RankLayout  # noqa: E402
from hpc_hsdp.task.parallelism.dist import MESH_AXES, RunContext, _group_ranks  # noqa: E402
from hpc_hsdp.task.parallelism.verify import compare_groups  # noqa: E402
from hpc_hsdp.task.training.model import build_model, make_optimizer  # noqa: E402
from hpc_hsdp.task.training.run_data import make_loader, open_data  # noqa: E402
from hpc_hsdp.task.training.step import train_step  # noqa: E402

marks.append(("imports", time.time()))


def main():
    shape = json.loads(sys.argv[1])
    training = TrainingSpec.of(**shape)
    env = dict(os.environ)
    layout = RankLayout.from_env(env, shard_size=2)
    os.environ.update(layout.torch_env())
    marks.append(("layout", time.time()))
    rank = int(layout.torch_env()["RANK"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=layout.world_size)
    marks.append(("rendezvous", time.time()))
    mesh = init_device_mesh("cpu", layout.plan.mesh_shape, mesh_dim_names=MESH_AXES)
    marks.append(("mesh", time.time()))
    me = {
        "node": env["SLURMD_NODENAME"],
        "shard_group": _group_ranks(mesh, "shard"),
        "replicate_group": _group_ranks(mesh, "replicate"),
    }
    realized = [None] * layout.world_size
    dist.all_gather_object(realized, me)
    problems = compare_groups(
        layout.plan,
        [d["node"] for d in realized],
        [d["shard_group"] for d in realized],
        [d["replicate_group"] for d in realized],
    )
    assert not problems, problems
    marks.append(("group check", time.time()))
    ctx = RunContext(layout=layout, mesh=mesh, device=torch.device("cpu"), realized=realized, _active=False)
    data = open_data(training, ctx.world_size)
    adapter = resolve_model(training, data_vocab_size=data.vocab_size)
    model = build_model(ctx, adapter, training)
    marks.append(("model", time.time()))
    optimizer = make_optimizer(model, training.optimizer)
    marks.append(("optimizer", time.time()))
    with make_loader(ctx, data, first_step=1, last_step=1) as loader:
        batches, _ = loader.next_step(1)
        out = train_step(
            model,
            optimizer,
            adapter,
            batches,
            lr=training.optimizer.lr,
            clip_grad=0.0,
            dims=ctx.dims,
        )
        out.tolist()
    marks.append(("step 1", time.time()))
    if rank == 0:
        launched = float(os.environ["BENCH_LAUNCHED_AT"])
        print("PHASES " + json.dumps({name: at - launched for name, at in marks}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
