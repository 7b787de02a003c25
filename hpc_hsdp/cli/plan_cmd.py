"""``hpc-hsdp plan``: the layout of a job before it is submitted."""

from __future__ import annotations

import json
from pathlib import Path

import click

from hpc_hsdp.errors import SpecError
from hpc_hsdp.estimates import estimate, parse_bytes, parse_count, smallest_fitting_shard
from hpc_hsdp.planview import plan_svg, plan_text
from hpc_hsdp.topology import TopologyPlan, expand_nodelist, parse_tasks_per_node, plan_for


@click.command()
@click.option("--nodes", type=int, default=None, help="Nodes in the job.  [default: 1, or as many as --nodelist names]")
@click.option("--gpus-per-node", type=int, default=8, show_default=True, help="GPUs (one task each) per node.")
@click.option("--shard", "shard_size", type=int, required=True,
              help="Shard-group size S: ranks that shard one model copy. Divides a node, or is a multiple of it.")
@click.option("--nodelist", default=None, help="Name the nodes as SLURM does, e.g. 'gpu-a[01-02]'.")
@click.option("--tasks-per-node", "tasks_per_node_text", default=None, metavar="SLURM_TASKS_PER_NODE",
              help="An uneven allocation in SLURM's form, e.g. '8(x2),4'; overrides --nodes/--gpus-per-node.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of a table.")
@click.option("--svg", "svg_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Also draw the layout as an SVG picture into this file.")
@click.option("--model-params", default=None, help="Add per-GPU memory and traffic estimates for this many parameters (7B, 350M, ...).")
@click.option("--dtype", default="fp32", show_default=True, help="Parameter dtype for the estimates: fp32, bf16, fp16.")
@click.option("--optimizer", default="adamw", show_default=True, help="Optimizer for the estimates: adamw, adam, sgd, sgd-momentum.")
@click.option("--gpu-memory", default=None, help="GPU memory (80GiB); adds the smallest shard size that fits.")
def plan(nodes, gpus_per_node, shard_size, nodelist, tasks_per_node_text, as_json, svg_path, model_params, dtype,
         optimizer, gpu_memory) -> None:  # fmt: skip
    """Show which GPU of which node holds each rank, shard group and replicate group.

    Ranks are node-major; shard groups are S consecutive ranks, replicate groups every
    S-th rank: the mesh ("replicate", "shard") that `hpc-hsdp run` builds on each task.

    \b
    hpc-hsdp plan --nodes 2 --gpus-per-node 8 --shard 4
    hpc-hsdp plan --nodes 4 --shard 16 --svg layout.svg
    hpc-hsdp plan --tasks-per-node '8(x2),4' --shard 4 --json
    hpc-hsdp plan --nodes 2 --shard 8 --model-params 7B --dtype bf16 --gpu-memory 80GiB
    """
    the_plan = _build_plan(nodes, gpus_per_node, shard_size, nodelist, tasks_per_node_text)
    params = parse_count(model_params) if model_params is not None else None
    memory = parse_bytes(gpu_memory) if gpu_memory is not None else None
    if memory is not None and params is None:
        raise SpecError("--gpu-memory needs --model-params to say what must fit; add e.g. --model-params 7B")
    est = estimate(the_plan, model_params=params, dtype=dtype, optimizer=optimizer) if params else None
    fit = (smallest_fitting_shard(the_plan, model_params=params, gpu_memory=memory, dtype=dtype, optimizer=optimizer)
           if memory is not None else None)  # fmt: skip
    if svg_path:
        Path(svg_path).write_text(plan_svg(the_plan))
    if as_json:
        data = the_plan.to_dict()
        if est is not None:
            data["estimate"] = est.to_dict()
        if memory is not None:
            data["gpu_memory"] = memory
            data["smallest_fitting_shard"] = fit.shard_size if fit else None
        click.echo(json.dumps(data))
    else:
        click.echo(plan_text(the_plan, estimate=est, fit=fit, gpu_memory=memory), nl=False)


def _build_plan(nodes, gpus_per_node, shard_size, nodelist, tasks_per_node_text) -> TopologyPlan:
    names = expand_nodelist(nodelist) if nodelist else ()
    if tasks_per_node_text:
        counts = parse_tasks_per_node(tasks_per_node_text)
        if nodes is not None and nodes != len(counts):
            raise SpecError(f"--nodes {nodes} but --tasks-per-node {tasks_per_node_text!r} describes {len(counts)} nodes; drop one")
        if names and len(names) != len(counts):
            raise SpecError(f"--nodelist names {len(names)} nodes but --tasks-per-node describes {len(counts)}; make them agree")
        return TopologyPlan(tasks_per_node=counts, shard_size=shard_size, node_names=names)
    if nodes is None:
        nodes = len(names) or 1
    elif names and len(names) != nodes:
        raise SpecError(f"--nodes {nodes} but --nodelist {nodelist!r} names {len(names)} nodes; make them agree")
    return plan_for(nodes=nodes, gpus_per_node=gpus_per_node, shard_size=shard_size, node_names=names)
