"""``hpc-hsdp layout``: what this SLURM task derives from its environment."""

from __future__ import annotations

import json
import os

import click

from hpc_hsdp.plan.address import FIRST_PORT_VARIABLE, hostfile_lines, node_address, pick_port
from hpc_hsdp.plan.slurm_facts import DISTRIBUTIONS
from hpc_hsdp.plan.topology import RankLayout, parse_tasks_per_node, rendezvous_from_env


@click.command()
@click.option("--shard", "shard_size", type=int, default=1, show_default=True, help="Shard-group size S of the job.")
@click.option(
    "--nproc-per-node",
    type=int,
    default=None,
    help="Workers per node: this task is the torchrun launcher of its node.  [default: this task is one rank]",
)
@click.option(
    "--field",
    default=None,
    help="Print only this field, raw (for scripts), e.g. node_rank; in the batch script: rendezvous "
    "(\"ADDRESS PORT\": this node's reachable address and the job's port: the one derived from the job id, "
    "else a free one of 10000-19999, which no job derives).",
)
@click.option(
    "--hostfile",
    "hostfile_counts",
    default=None,
    metavar="COUNTS",
    help="In the batch script: print SLURM_HOSTFILE lines placing COUNTS ('8,4') tasks on the job's nodes.",
)
@click.option(
    "--distribution",
    type=click.Choice(DISTRIBUTIONS),
    default="block",
    show_default=True,
    help="Order of the --hostfile lines.",
)
def layout(shard_size, nproc_per_node, field, hostfile_counts, distribution) -> None:
    """Inside a SLURM task, print the layout this task derives, as one JSON object.

    The rank is node-major (tasks on earlier nodes + SLURM_LOCALID), whatever
    SLURM_PROCID says; `slurm_procid` and `procid_differs` show where they disagree.
    The first thing to run when a job hangs:

    \b
    srun hpc-hsdp layout --shard 4
    """
    if hostfile_counts is not None:
        click.echo("\n".join(hostfile_lines(os.environ, parse_tasks_per_node(hostfile_counts), distribution)))
        return
    if field == "rendezvous":
        env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
        address = node_address(os.environ)
        _, derived = rendezvous_from_env(env)
        first = int(env[FIRST_PORT_VARIABLE]) if env.get(FIRST_PORT_VARIABLE, "").strip().isdigit() else derived
        port = pick_port(first, where=f"node {env.get('SLURMD_NODENAME') or '?'}")  # a port in use is no failed job
        click.echo(f"{address} {port}")
        return
    if field in ("master_addr", "master_port"):
        addr, port = rendezvous_from_env(os.environ)  # job-level variables suffice (batch script)
        click.echo(addr if field == "master_addr" else port)
        return
    derived = RankLayout.from_env(os.environ, shard_size=shard_size, nproc_per_node=nproc_per_node).to_dict()
    if field is None:
        click.echo(json.dumps(derived, sort_keys=False))
        return
    if field not in derived:
        raise click.BadParameter(
            f"{field!r} is not a layout field; choose one of {', '.join(derived)}", param_hint="--field"
        )
    value = derived[field]
    click.echo(json.dumps(value) if isinstance(value, (list, dict)) else ("" if value is None else value))
