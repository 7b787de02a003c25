"""What a real allocation would have given an emulated job: its nodes and tasks, the job-level
SLURM variables of its batch script, and this machine's GPUs (where every task runs)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.address import FIRST_PORT_VARIABLE
from hpc_hsdp.plan.slurm_env import compress_nodelist
from hpc_hsdp.plan.topology import default_node_names, format_tasks_per_node

MAX_LOCAL_TASKS = 64
"""The emulator runs every task as a process on this machine; more would only exhaust it."""


EMULATOR_VARIABLE = "HPC_HSDP_EMULATOR"
"""Set to ``1`` in every emulated job's environment: a task can tell that its job is the emulator's."""


@dataclass(frozen=True, kw_only=True)
class LocalAllocation:
    """What a real allocation would have given the job."""

    tasks_per_node: tuple[int, ...]
    node_names: tuple[str, ...]
    job_name: str
    gpus_per_node: int = 0


def allocation_for(*, tasks_per_node: Sequence[int], gpus_per_node: int, job_name: str) -> LocalAllocation:
    """The allocation of ``tasks_per_node`` (the job spec's: one task per GPU, ``--ntasks``
    laid out as SLURM would, or one per node for torchrun) on nodes ``n1, n2, ...``, named as
    ``plan`` and the dev cluster name them."""
    counts = tuple(tasks_per_node)
    if sum(counts) > MAX_LOCAL_TASKS:
        raise SpecError(
            f"the local emulator runs every task as a process on this machine: {sum(counts):,} tasks are more "
            f"than its {MAX_LOCAL_TASKS}; submit to SLURM (--cluster slurm) or use fewer --nodes/--gpus-per-node"
        )
    names = default_node_names(len(counts))
    return LocalAllocation(tasks_per_node=counts, node_names=names, job_name=job_name, gpus_per_node=gpus_per_node)


NVIDIA_SMI_TIMEOUT_S = 10.0


DRIVER_MARKERS = ("/proc/driver/nvidia/gpus", "/dev/nvidia0", "/dev/kfd")
"""What a GPU driver leaves on a machine without ``nvidia-smi`` (NVIDIA's; ``/dev/kfd``: ROCm's)."""


def local_gpus(*, which=shutil.which) -> list[tuple[str, tuple[int, int] | None]] | None:
    """This machine's GPUs, where the emulator's tasks run, read without torch: ``nvidia-smi``'s
    (name, compute capability; None where the driver is too old to say it); ``[]``: no GPU here
    (no ``nvidia-smi`` and no driver); None: it cannot be told (a driver without ``nvidia-smi``,
    an ``nvidia-smi`` that fails): the tasks decide."""
    smi = which("nvidia-smi")
    if smi is None:
        return None if any(Path(marker).exists() for marker in DRIVER_MARKERS) else []
    for fields in ("name,compute_cap", "name"):  # compute_cap: drivers from 510 on
        try:
            out = subprocess.run(
                [smi, f"--query-gpu={fields}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=NVIDIA_SMI_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0:
            break
    else:
        return None
    gpus = []
    for line in out.stdout.splitlines():
        if not line.strip():
            continue
        name, _, cap = line.rpartition(",") if fields == "name,compute_cap" else (line, "", "")
        major, dot, minor = cap.strip().partition(".")
        capability = (int(major), int(minor)) if dot and major.isdigit() and minor.isdigit() else None
        gpus.append((name.strip(), capability))
    return gpus


def job_environment(
    alloc: LocalAllocation, *, job_id: str, submit_dir: str, shim_dir: Path, port: int
) -> dict[str, str]:
    """The batch script's environment: job-level SLURM variables, rendezvous on loopback."""
    nodelist = compress_nodelist(alloc.node_names)
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("SLURM") or k in ("MASTER_ADDR", "MASTER_PORT")]:
        del env[key]
    env.update(
        {
            "SLURM_JOB_ID": job_id,
            "SLURM_JOBID": job_id,
            "SLURM_JOB_NAME": alloc.job_name,
            "SLURM_JOB_NODELIST": nodelist,
            "SLURM_NODELIST": nodelist,
            "SLURM_JOB_NUM_NODES": str(len(alloc.node_names)),
            "SLURM_NNODES": str(len(alloc.node_names)),
            "SLURM_NTASKS": str(sum(alloc.tasks_per_node)),
            "SLURM_NPROCS": str(sum(alloc.tasks_per_node)),
            "SLURM_TASKS_PER_NODE": format_tasks_per_node(alloc.tasks_per_node),
            "SLURM_SUBMIT_DIR": submit_dir,
            "SLURMD_NODENAME": alloc.node_names[0],
            "SLURM_NODEID": "0",
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_CLUSTER_NAME": "local-emulator",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),  # a script that keeps it uses it; the rendered one picks from the next
            FIRST_PORT_VARIABLE: str(port),
            EMULATOR_VARIABLE: "1",
            "HPC_HSDP_EMULATED_GPUS_PER_NODE": str(alloc.gpus_per_node),
            "PATH": os.pathsep.join([str(shim_dir), str(Path(sys.executable).parent), env.get("PATH", "")]),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env
