"""``hpc-hsdp layout``: what this SLURM task derives from its environment."""

from __future__ import annotations

import json
import os

import click

from hpc_hsdp.topology import RankLayout, rendezvous_from_env


@click.command()
@click.option("--shard", "shard_size", type=int, default=1, show_default=True, help="Shard-group size S of the job.")
@click.option("--nproc-per-node", type=int, default=None,
              help="Workers per node when this is a one-task-per-node (torchrun) step.  [default: GPUs visible]")
@click.option("--field", default=None, help="Print only this field, raw (for scripts), e.g. master_addr or node_rank.")
def layout(shard_size, nproc_per_node, field) -> None:
    """Inside a SLURM task, print the layout this task derives, as one JSON object.

    The rank is node-major (tasks on earlier nodes + SLURM_LOCALID), whatever
    SLURM_PROCID says; `slurm_procid` and `procid_differs` show where they disagree.
    The first thing to run when a job hangs:

    \b
    srun hpc-hsdp layout --shard 4
    """
    if field in ("master_addr", "master_port"):
        addr, port = rendezvous_from_env(os.environ)  # job-level variables suffice (batch script)
        click.echo(addr if field == "master_addr" else port)
        return
    derived = RankLayout.from_env(os.environ, shard_size=shard_size, nproc_per_node=nproc_per_node).to_dict()
    if field is None:
        click.echo(json.dumps(derived, sort_keys=False))
        return
    if field not in derived:
        raise click.BadParameter(f"{field!r} is not a layout field; choose one of {', '.join(derived)}", param_hint="--field")
    value = derived[field]
    click.echo(json.dumps(value) if isinstance(value, (list, dict)) else ("" if value is None else value))
