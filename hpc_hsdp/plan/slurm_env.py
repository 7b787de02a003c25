"""The environment SLURM gives each task of a step, for the local emulator and tests.

Pure: returns one dict per task, with the variables a real allocation sets (see
``RankLayout.from_env`` for how they are read). Node names need not resolve; the
emulator runs every task on this machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import hostlist

from hpc_hsdp.plan.slurm_facts import DISTRIBUTIONS
from hpc_hsdp.plan.topology import format_tasks_per_node


def compress_nodelist(names: Sequence[str]) -> str:
    return hostlist.collect_hostlist(list(names))


def task_environments(
    *,
    tasks_per_node: Sequence[int],
    node_names: Sequence[str],
    job_id: str,
    distribution: str = "block",
    gpus_per_node: int = 0,
    job_name: str = "hpc-hsdp",
) -> list[dict[str, str]]:
    """One environment per task, in SLURM_PROCID order.

    ``block`` numbers tasks node by node (PROCID 0-7 on the first node); ``cyclic``
    deals them round-robin over the nodes, as ``srun --distribution=cyclic`` does.
    With ``gpus_per_node`` > 0 every task sees all of its node's GPUs.
    """
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"distribution {distribution!r}: choose one of {DISTRIBUTIONS}")
    nodelist = compress_nodelist(node_names)
    ntasks = sum(tasks_per_node)
    placement: list[tuple[int, int]] = []  # (node, local id) in PROCID order
    if distribution == "block":
        placement = [(node, local) for node, count in enumerate(tasks_per_node) for local in range(count)]
    else:
        next_local = [0] * len(tasks_per_node)
        while len(placement) < ntasks:
            for node, count in enumerate(tasks_per_node):
                if next_local[node] < count:
                    placement.append((node, next_local[node]))
                    next_local[node] += 1
    common = {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_JOB_NAME": job_name,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist,
        "SLURM_STEP_NODELIST": nodelist,
        "SLURM_JOB_NUM_NODES": str(len(tasks_per_node)),
        "SLURM_NNODES": str(len(tasks_per_node)),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_TASKS_PER_NODE": format_tasks_per_node(tasks_per_node),
        "SLURM_STEP_TASKS_PER_NODE": format_tasks_per_node(tasks_per_node),
        "SLURM_DISTRIBUTION": distribution,
    }
    envs = []
    for procid, (node, local) in enumerate(placement):
        env = dict(common)
        env.update(
            {
                "SLURM_PROCID": str(procid),
                "SLURM_LOCALID": str(local),
                "SLURM_NODEID": str(node),
                "SLURMD_NODENAME": node_names[node],
            }
        )
        if gpus_per_node > 0:
            env["SLURM_GPUS_ON_NODE"] = str(gpus_per_node)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(gpus_per_node))
        envs.append(env)
    return envs
