"""The one-task-per-node launcher: start torchrun's workers on this node, in node order.

torchrun runs with a static rendezvous (``--node-rank`` from this node's index in the
job's node list, ``--master-addr`` the first node), never c10d's arbitrary node order,
so the workers' ranks are node-major and match the plan. Imports no torch itself.
"""

from __future__ import annotations

import os
import subprocess
import sys

from hpc_hsdp.spec import RunSpec
from hpc_hsdp.topology import RankLayout


def torchrun_command(spec: RunSpec, *, nproc_per_node: int, env=None) -> list[str]:
    layout = RankLayout.from_env(os.environ if env is None else env, shard_size=spec.shard_size,
                                 nproc_per_node=nproc_per_node)  # fmt: skip
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={layout.plan.nodes}", f"--nproc-per-node={nproc_per_node}", f"--node-rank={layout.node_rank}",
        f"--master-addr={layout.master_addr}", f"--master-port={layout.master_port}",
        "-m", "hpc_hsdp", "run", *spec.to_args(),
    ]  # fmt: skip


def launch_torchrun(spec: RunSpec, nproc_per_node: int) -> int:
    """Run torchrun for this node with this task's interpreter (submitit started it from the
    job's environment) and wait; raises when a worker failed."""
    command = torchrun_command(spec, nproc_per_node=nproc_per_node)
    print("launching:", " ".join(command), flush=True)
    code = subprocess.call(command)
    if code != 0:
        raise RuntimeError(f"torchrun on this node exited with code {code}; see the workers' lines above")
    return code
