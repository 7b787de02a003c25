"""``hpc-hsdp layout``: what this SLURM task derives from its environment."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import click

from hpc_hsdp.errors import SchedulerError, SlurmEnvError
from hpc_hsdp.plan.address import FIRST_PORT_VARIABLE, hostfile_lines, node_address, pick_port
from hpc_hsdp.plan.slurm_facts import DISTRIBUTIONS
from hpc_hsdp.plan.switches import (
    NODE_SWITCHES_ENV,
    TOPOLOGY_MODES,
    format_node_switches,
    parse_node_switches,
    parse_scontrol_topology,
    switches_of_nodes,
)
from hpc_hsdp.plan.topology import (
    RankLayout,
    expand_nodelist,
    parse_tasks_per_node,
    plan_on_switches,
    rendezvous_from_env,
)
from hpc_hsdp.scheduler.backends import task_backend
from hpc_hsdp.scheduler.backends.slurm_command import show_topology


@click.command()
@click.option("--shard", "shard_size", type=int, default=1, show_default=True, help="Shard-group size S of the job.")
@click.option("--tp", "tp_size", type=int, default=1, show_default=True, help="Tensor-parallel size T of the job.")
@click.option(
    "--nproc-per-node",
    type=int,
    default=None,
    help="Workers per node: this task is the torchrun launcher of its node.  [default: this task is one rank]",
)
@click.option(
    "--topology",
    type=click.Choice(TOPOLOGY_MODES),
    default="auto",
    show_default=True,
    help="As the job's --topology: auto and strict order the nodes by the switches in $HPC_HSDP_NODE_SWITCHES; "
    "strict refuses shard groups that must cross leaf switches.",
)
@click.option(
    "--field",
    default=None,
    help="Print only this field, raw (for scripts), e.g. node_rank; in the batch script: rendezvous "
    "(\"ADDRESS PORT\": this node's reachable address and the job's port: the one derived from the job id, "
    "else a free one of 10000-19999, which no job derives) and node_switches (every node's switches, as "
    "$HPC_HSDP_NODE_SWITCHES holds them: given there, else from scontrol show topology).",
)
@click.option(
    "--tasks-per-node",
    "tasks_per_node_text",
    default=None,
    metavar="COUNTS",
    help="With --field node_switches --topology strict: the job's tasks per node ('8': every node; '8,4'), "
    "whose shard groups are checked against the switches.",
)
@click.option(
    "--scontrol-topology",
    "topology_text",
    default=None,
    metavar="TEXT",
    help="With --field node_switches: what `scontrol show topology` printed, instead of asking it (the batch "
    "shell hands it into a container, which has no scontrol).",
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
def layout(
    shard_size,
    tp_size,
    nproc_per_node,
    topology,
    field,
    tasks_per_node_text,
    topology_text,
    hostfile_counts,
    distribution,
) -> None:
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
        address = node_address(os.environ, one_machine=not task_backend(os.environ).separate_machines)
        _, derived = rendezvous_from_env(env)
        first = int(env[FIRST_PORT_VARIABLE]) if env.get(FIRST_PORT_VARIABLE, "").strip().isdigit() else derived
        port = pick_port(first, where=f"node {env.get('SLURMD_NODENAME') or '?'}")  # a port in use is no failed job
        click.echo(f"{address} {port}")
        return
    if field == "node_switches":
        click.echo(
            job_node_switches(
                os.environ, topology, shard_size, tasks_per_node_text, tp_size=tp_size, topology_text=topology_text
            )
        )
        return
    if field in ("master_addr", "master_port"):
        addr, port = rendezvous_from_env(os.environ)  # job-level variables suffice (batch script)
        click.echo(addr if field == "master_addr" else port)
        return
    fields = RankLayout.from_env(
        os.environ, shard_size=shard_size, nproc_per_node=nproc_per_node, topology=topology, tp_size=tp_size
    ).to_dict()
    if field is None:
        click.echo(json.dumps(fields, sort_keys=False))
        return
    if field not in fields:
        raise click.BadParameter(
            f"{field!r} is not a layout field; choose one of {', '.join(fields)}", param_hint="--field"
        )
    value = fields[field]
    click.echo(json.dumps(value) if isinstance(value, (list, dict)) else ("" if value is None else value))


def job_node_switches(
    env: Mapping[str, str],
    topology: str,
    shard_size: int,
    tasks_per_node_text: str | None,
    *,
    tp_size: int = 1,
    topology_text: str | None = None,
) -> str:
    """The batch shell's ``--field node_switches``: every node of the job under its switches (the
    value of ``HPC_HSDP_NODE_SWITCHES``): the one the job was given (``--env``), else SLURM's
    topology; none on the emulator, whose nodes are all this machine. With ``--topology strict``,
    TopologyError where the shard groups must cross leaf switches (or that cannot be told)."""
    nodelist = env.get("SLURM_JOB_NODELIST", "").strip()
    if not nodelist:
        raise SlurmEnvError("SLURM_JOB_NODELIST is not set; --field node_switches is for the job's batch script")
    nodes = expand_nodelist(nodelist)
    given = env.get(NODE_SWITCHES_ENV, "").strip()
    if given:
        places = parse_node_switches(given)
    elif topology_text is not None:  # read on the host by the batch shell (a container job)
        places = switches_of_nodes(parse_scontrol_topology(topology_text), nodes)
    elif task_backend(env).separate_machines:
        try:
            places = switches_of_nodes(parse_scontrol_topology(show_topology(env=env)), nodes)
        except SchedulerError as exc:
            if topology == "strict":
                raise
            click.echo(f"hpc-hsdp: the nodes' switches are unknown ({exc}); the node-list order stands", err=True)
            places = {}
    else:
        places = {}
    if topology == "strict":
        if not tasks_per_node_text:
            raise click.UsageError("--field node_switches --topology strict needs --tasks-per-node")
        counts = parse_tasks_per_node(tasks_per_node_text)
        counts = counts * len(nodes) if len(counts) == 1 else counts
        plan_on_switches(
            tasks_per_node=counts,
            shard_size=shard_size,
            node_names=nodes,
            places=places,
            topology="strict",
            tp_size=tp_size,
        )
    return format_node_switches(places, nodes)
