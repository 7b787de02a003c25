"""``--stage-data`` on the tasks: every rank stages its node's copies of the token files
(:func:`hpc_hsdp.data.staging.stage_files`: one copier per node under a lock, the node's other
ranks wait), the ranks gather what each node did, and the datasets read the copies from then
on. Rank 0 logs the copy's time and writes ``staging.json`` (:mod:`hpc_hsdp.rundir.staging`).
A rank that cannot stage (the directory cannot be made or written, a shared file does not match
its sidecar's sha256) fails every rank with its one line (exit 2), not a hang."""

from __future__ import annotations

import os

import torch.distributed as dist

from hpc_hsdp.data.staging import launch_token, stage_files, stage_root
from hpc_hsdp.errors import DataError, HsdpError
from hpc_hsdp.plan.stage_dir import stage_base
from hpc_hsdp.rundir.staging import node_staging, staging_lines, write_staging_record
from hpc_hsdp.runtime import injected_faults
from hpc_hsdp.runtime.dist import RunContext
from hpc_hsdp.runtime.log import say
from hpc_hsdp.runtime.run_data import TrainData


def token_datasets(data: TrainData) -> list:
    """The token datasets the run reads (train, held-out; a mixture's sources' of both)."""
    found = []
    for entry in data.datasets:
        for ds in entry if isinstance(entry, tuple) else (entry,):
            if ds is not None and all(ds is not seen for seen in found):
                found.append(ds)
    return found


def _injected_free_bytes(root) -> int:
    return injected_faults.stage_free_bytes()


def stage_data(ctx: RunContext, data: TrainData, value: str, *, env=None, verbose: bool = True) -> dict | None:
    """Collective: every rank's datasets read their node's copies (a node whose disk is too
    small: the shared files). Returns the run's staging record (None: nothing to stage)."""
    env = os.environ if env is None else env
    datasets = token_datasets(data)
    if not datasets:
        return None
    layout = ctx.layout
    try:
        root = stage_root(stage_base(value, env))
        result = stage_files(
            [f for ds in datasets for f in ds.files],
            root,
            launch=launch_token(env, rendezvous=f"{layout.master_addr}:{layout.master_port}", parent_pid=os.getppid()),
            free_bytes=None if injected_faults.stage_free_bytes() is None else _injected_free_bytes,
        )
        mine = (layout.node, result.as_record())
    except HsdpError as exc:
        result, mine = None, (layout.node, {"error": " ".join(str(exc).split())})
    except OSError as exc:  # a disk that fails mid-copy (ENOSPC after the check, EIO): one line too
        result, mine = None, (layout.node, {"error": f"--stage-data on {layout.node}: {exc}"})
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    failed = [(node, r["error"]) for node, r in gathered if "error" in r]
    if failed:
        node, error = failed[0]
        raise DataError(error if node in error else f"{error} (on {node})")
    for ds in datasets:
        ds.read_from(result.local_paths())
    record = node_staging(gathered, value)
    if ctx.is_rank0:
        if ctx.run_dir is not None:
            write_staging_record(ctx.run_dir, record)
        if verbose:
            for line in staging_lines(record):
                say(line)
    return record
