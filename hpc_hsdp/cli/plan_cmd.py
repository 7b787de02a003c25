"""``hpc-hsdp plan``: the layout of a job before it is submitted."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from hpc_hsdp.cli import write_atomically
from hpc_hsdp.cli.click_options import job_option
from hpc_hsdp.errors import SpecError, TopologyError
from hpc_hsdp.job.model_sizing import model_options, params_for_shard, tp_training
from hpc_hsdp.job.spec import TrainingSpec, parse_nodes
from hpc_hsdp.plan.estimates import (
    DEFAULT_WRITE_BANDWIDTH,
    SLURM_KILL_WAIT_S,
    parse_bytes,
    recommend_tp,
)
from hpc_hsdp.plan.estimates import recommend as recommend_shard_size
from hpc_hsdp.plan.model_cost import ModelCost, Sizing, activation_shape, model_blocks, sizing
from hpc_hsdp.plan.plan_options import build_plan, node_range, on_switches, replica_plan
from hpc_hsdp.plan.topology import TopologyPlan, valid_tp_sizes
from hpc_hsdp.plan.view import plan_svg, plan_text, recommend_text, recommend_tp_text


@click.command()
@job_option("nodes", "plan")
@job_option("gpus_per_node", "plan")
@job_option("shard", "plan")
@job_option("tp", "plan")
@click.option("--nodelist", default=None, help="Name the nodes as SLURM does, e.g. 'gpu-a[01-02]'.")
@click.option(
    "--tasks-per-node",
    "tasks_per_node_text",
    default=None,
    metavar="SLURM_TASKS_PER_NODE",
    help="An uneven allocation in SLURM's form, e.g. '8(x2),4'; overrides --nodes/--gpus-per-node.",
)
@job_option("topology", "plan")
@click.option(
    "--node-switches",
    "node_switches",
    default=None,
    metavar="SWITCHES",
    help="The nodes' switches as a job's log prints them (HPC_HSDP_NODE_SWITCHES), e.g. "
    "'spine.leaf1:n[1-2];spine.leaf2:n[3-4]': the plan in their order, each node's switch and where the "
    "groups sit.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON instead of a table.")
@click.option(
    "--svg",
    "svg_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Also draw the layout as an SVG picture into this file.",
)
@click.option(
    "--model-params",
    default=None,
    help="Add per-GPU memory and traffic estimates for this many parameters (7B, 350M, ...), or 'builtin' "
    "for the built-in payload's model, e.g. 'builtin:layers=4,width=128' (dim 0 padded as FSDP2 pads it).",
)
@job_option("model", "plan")
@click.option(
    "--root-params",
    default=None,
    help="Of --model-params, those in the root module (embeddings, head): gathered once per step, not twice.  "
    "[default: 0]",
)
@job_option("precision", "plan")
@click.option("--dtype", default=None, hidden=True, help="Old name of --precision (bf16, fp32).")
@click.option(
    "--optimizer",
    default="adamw",
    show_default=True,
    help="Optimizer for the estimates: adamw, adam, sgd, sgd-momentum.",
)
@job_option("grad_accum", "plan")
@job_option("seq_len", "plan")
@job_option("batch_size", "plan")
@job_option("activation_checkpointing", "plan")
@click.option(
    "--write-bandwidth",
    default=DEFAULT_WRITE_BANDWIDTH,
    show_default=True,
    metavar="BYTES/s",
    help="What one node writes to the checkpoints' file system per second (e.g. 2GB/s); with --model-params, "
    "plan estimates the save time.",
)
@job_option("upload_bandwidth", "plan")
@job_option("signal", "plan")
@job_option("fault_tolerance", "plan")
@job_option("min_replicas", "plan")
@job_option("spare_nodes", "plan")
@click.option("--gpu-memory", default=None, help="GPU memory (80GiB); adds the smallest shard size that fits.")
@click.option(
    "--kill-wait",
    type=click.IntRange(min=1),
    default=SLURM_KILL_WAIT_S,
    show_default=True,
    metavar="SECONDS",
    help="The cluster's KillWait (scontrol show config): the time a save on SIGTERM has.",
)
@click.option(
    "--recommend",
    is_flag=True,
    help="Recommend the shard size that fits --gpu-memory and sends the least inter-node traffic, "
    "with a table of every shard size.",
)
def plan(
    nodes,
    gpus_per_node,
    shard_size,
    tp_size,
    nodelist,
    tasks_per_node_text,
    topology,
    node_switches,
    as_json,
    svg_path,
    training_model,
    model_params,
    root_params,
    training_precision,
    dtype,
    optimizer,
    training_grad_accum,
    training_seq_len,
    training_batch_size,
    training_activation_checkpointing,
    write_bandwidth,
    upload_bandwidth,
    signal,
    training_fault_tolerance,
    training_min_replicas,
    spare_nodes,
    gpu_memory,
    kill_wait,
    recommend: bool,
) -> None:
    """Show which GPU of which node holds each rank, shard group and replicate group.

    Ranks are node-major; shard groups are S consecutive ranks, replicate groups every
    S-th rank: the mesh ("replicate", "shard") that `hpc-hsdp run` builds on each task.
    With --tp T the mesh is ("replicate", "shard", "tp"): T consecutive ranks of one node
    form a TP group, and the table adds each rank's (r, s, t) and its TP group.

    \b
    hpc-hsdp plan --nodes 2 --gpus-per-node 8 --shard 4
    hpc-hsdp plan --nodes 4 --shard 16 --svg layout.svg
    hpc-hsdp plan --tasks-per-node '8(x2),4' --shard 4 --json
    hpc-hsdp plan --nodes 2 --shard 8 --model-params 7B --precision bf16 --gpu-memory 80GiB
    hpc-hsdp plan --nodes 2 --shard 8 --model-params 7B --grad-accum 4
    hpc-hsdp plan --nodes 2 --recommend --model-params 7B --gpu-memory 80GiB
    hpc-hsdp plan --nodes 2 --shard 8 --model hf:/models/llama-1b --precision bf16
    hpc-hsdp plan --nodes 2 --shard 2 --tp 4 --svg layout.svg
    hpc-hsdp plan --nodes 4 --shard 4 --tp 8 --model-params 70B --seq-len 8192 --batch-size 1
    hpc-hsdp plan --nodes 4 --recommend --model-params 70B --gpu-memory 80GiB --seq-len 8192
    hpc-hsdp plan --nodes 4 --shard 16 --node-switches 'spine.leaf1:n[1,3];spine.leaf2:n[2,4]'
    """
    precision = _precision(training_precision, dtype)
    model_params, model_info = model_options(
        training_model, model_params, root_params, recommend=recommend, gpu_memory=gpu_memory
    )
    if not recommend and shard_size is None:
        raise SpecError("Missing option '--shard': give the shard-group size, e.g. --shard 4, or ask with --recommend")
    fewest_nodes, nodes = node_range(
        None if nodes is None else parse_nodes(nodes),
        one_allocation=bool(nodelist or tasks_per_node_text or recommend),
    )
    the_plan = build_plan(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        shard_size=1 if shard_size is None else shard_size,
        nodelist=nodelist,
        tasks_per_node_text=tasks_per_node_text,
        tp_size=tp_size,
    )
    if node_switches is not None or topology == "strict":
        if recommend:
            raise SpecError("--node-switches and --topology strict show one shard size; drop --recommend")
        the_plan = on_switches(the_plan, node_switches or "", topology)
    fewest = None
    if fewest_nodes is not None:
        try:
            fewest = build_plan(nodes=fewest_nodes, gpus_per_node=gpus_per_node, shard_size=shard_size, tp_size=tp_size)
        except TopologyError as exc:
            raise TopologyError(f"--nodes {fewest_nodes}-{nodes}: at {fewest_nodes} node(s): {exc}") from None
    if model_info is not None:
        shard_counts = model_info["counts"]
    else:
        shard_counts = params_for_shard(model_params, root_params) if model_params is not None else None
    memory = parse_bytes(gpu_memory) if gpu_memory is not None else None
    if memory is not None and shard_counts is None:
        raise SpecError("--gpu-memory needs --model-params to say what must fit; add e.g. --model-params 7B")
    blocks = model_blocks(model_info, shard_counts)
    split_model = tp_training(training_model, model_params, training_seq_len)
    refusal = _tp_refusal(split_model, tp_size)
    if refusal:
        raise SpecError(refusal)
    activations = activation_shape(
        model_info,
        shard_counts,
        seq_len=training_seq_len,
        batch_size=training_batch_size,
        checkpointing=training_activation_checkpointing,
        wanted=training_seq_len is not None or (tp_size > 1 and not recommend),
    )
    if recommend and training_seq_len is not None:
        if tp_size > 1:
            raise SpecError(
                f"--recommend with --seq-len chooses --tp itself; drop --tp {tp_size}, or drop --seq-len to choose "
                f"the shard size at --tp {tp_size}"
            )
        assert memory is not None  # model_options: --recommend needs --gpu-memory
        rec = recommend_tp(
            the_plan,
            tp_sizes=[t for t in valid_tp_sizes(the_plan.tasks_per_node) if not _tp_refusal(split_model, t)],
            gpu_memory=memory,
            precision=precision,
            optimizer=optimizer,
            params_for_shard=shard_counts,
            activations=activations,
            blocks=blocks,
        )
        chosen = None
        if rec.chosen_tp is not None and rec.chosen is not None and rec.chosen.chosen is not None and as_json:
            chosen = build_plan(
                nodes=nodes,
                gpus_per_node=gpus_per_node,
                shard_size=rec.chosen.chosen.shard_size,
                nodelist=nodelist,
                tasks_per_node_text=tasks_per_node_text,
                tp_size=rec.chosen_tp,
            )
        _echo_tp_recommendation(rec, the_plan, chosen, model_info, activations, as_json=as_json)
        return
    if recommend:
        assert memory is not None  # model_options: --recommend needs --gpu-memory
        shard_rec = recommend_shard_size(
            the_plan,
            gpu_memory=memory,
            precision=precision,
            optimizer=optimizer,
            params_for_shard=shard_counts,
            activations=activations,
            blocks=blocks,
        )
        chosen = None
        if shard_rec.chosen is not None and as_json:
            chosen = build_plan(
                nodes=nodes,
                gpus_per_node=gpus_per_node,
                shard_size=shard_rec.chosen.shard_size,
                nodelist=nodelist,
                tasks_per_node_text=tasks_per_node_text,
                tp_size=the_plan.tp_size,
            )
        _echo_recommendation(shard_rec, the_plan, chosen, model_info, as_json=as_json)
        if not as_json and activations is None:
            click.echo(
                f"(at --tp {tp_size}: give --seq-len and --batch-size to choose the TP size too; without the "
                f"activations the states alone never need one above 1)"
            )
        return
    if training_grad_accum < 1:
        raise SpecError(f"--grad-accum {training_grad_accum} must be at least 1")
    model = ModelCost(
        shard_counts,
        precision=precision,
        optimizer=optimizer,
        grad_accum=training_grad_accum,
        activations=activations,
        blocks=blocks,
    )
    sized = sizing(
        the_plan,
        model,
        memory=memory,
        write_bandwidth=write_bandwidth,
        upload_bandwidth=upload_bandwidth,
        signal=signal,
        kill_wait=kill_wait,
    )
    replicas = replica_plan(
        the_plan,
        fault_tolerance=training_fault_tolerance,
        min_replicas=training_min_replicas,
        spare_nodes=spare_nodes,
        fewest_nodes=fewest_nodes,
    )
    if svg_path:
        write_atomically(Path(svg_path), plan_svg(the_plan), mode=0o644)
    if as_json:
        _echo_plan_json(
            the_plan,
            sized,
            model_info,
            memory=memory,
            fewest=fewest,
            node_range=(fewest_nodes, nodes),
            replicas=replicas,
            activations=activations,
        )
    else:
        _echo_plan_text(
            the_plan, sized, model_info, memory=memory, node_range=(fewest_nodes, nodes), activations=activations
        )
        if replicas is not None:
            click.echo("\n".join(replicas.describe(the_plan.node_names)))
        if fewest is not None and fewest_nodes is not None:  # the plan at --nodes MIN-MAX's MIN
            _echo_fewest_nodes(fewest, model, fewest_nodes=fewest_nodes)


def _echo_recommendation(rec, the_plan: TopologyPlan, chosen: TopologyPlan | None, model_info, *, as_json: bool):
    if as_json:
        data = {"recommendation": rec.to_dict()}
        if model_info is not None:
            data["model"] = model_info["record"]
        if chosen is not None:
            data["plan"] = chosen.to_dict()
            data["estimate"] = rec.chosen.estimate.to_dict()
        click.echo(json.dumps(data))
        return
    if model_info is not None:
        click.echo(model_info["line"])
    click.echo(recommend_text(rec, the_plan), nl=False)


def _echo_plan_json(
    the_plan: TopologyPlan, sized: Sizing, model_info, *, memory, fewest, node_range, replicas=None, activations=None
) -> None:
    data = the_plan.to_dict()
    if replicas is not None:
        data["replicas"] = replicas.to_dict()
    if model_info is not None:
        data["model"] = model_info["record"]
    if sized.estimate is not None:
        data["estimate"] = sized.estimate.to_dict()
        if activations is not None:
            data["activations"] = asdict(activations)
        if sized.on_sigterm is not None:  # with every estimate
            data["save_on_sigterm"] = sized.on_sigterm.to_dict()
    if sized.saving is not None:
        data["checkpoint_estimate"] = sized.saving.to_dict()
    if memory is not None:
        data["gpu_memory"] = memory
        data["smallest_fitting_shard"] = sized.fit.shard_size if sized.fit else None
    if fewest is not None:
        data["flexible"] = {"min_nodes": node_range[0], "max_nodes": node_range[1], "at_min_nodes": fewest.to_dict()}
    click.echo(json.dumps(data))


def _echo_plan_text(the_plan: TopologyPlan, sized: Sizing, model_info, *, memory, node_range, activations=None) -> None:
    if model_info is not None:
        click.echo(model_info["line"])
    fewest_nodes, nodes = node_range
    if fewest_nodes is not None:
        click.echo(
            f"flexible allocation --nodes {fewest_nodes}-{nodes}: SLURM grants between {fewest_nodes} and "
            f"{nodes} nodes; the mesh follows what it grants, the global batch stays the same\n"
            f"at {nodes} nodes (the most):"
        )
    click.echo(
        plan_text(
            the_plan,
            estimate=sized.estimate,
            fit=sized.fit,
            gpu_memory=memory,
            save=sized.on_sigterm,
            activations=activations,
        ),
        nl=False,
    )
    if sized.saving is not None:
        click.echo("\n".join(sized.saving.lines()))


def _echo_fewest_nodes(fewest: TopologyPlan, model: ModelCost, *, fewest_nodes: int) -> None:
    click.echo(f"\nat {fewest_nodes} node{'s' if fewest_nodes > 1 else ''} (the fewest):")
    click.echo(plan_text(fewest, estimate=model.estimate(fewest), activations=model.activations), nl=False)


def _echo_tp_recommendation(rec, the_plan, chosen, model_info, activations, *, as_json: bool) -> None:
    if as_json:
        data = {"recommendation": rec.to_dict()}
        if model_info is not None:
            data["model"] = model_info["record"]
        if activations is not None:
            data["activations"] = asdict(activations)
        if chosen is not None:
            data["plan"] = chosen.to_dict()
            data["estimate"] = rec.chosen.chosen.estimate.to_dict()
        click.echo(json.dumps(data))
        return
    if model_info is not None:
        click.echo(model_info["line"])
    click.echo(recommend_tp_text(rec, the_plan, activations), nl=False)


def _precision(precision: str, dtype: str | None) -> str:
    """``--precision``, or the old ``--dtype`` read as it (with a note: it no longer means 2-byte states)."""
    if dtype is None:
        return precision
    named = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}.get(dtype.lower())
    if named is None:
        raise SpecError(f"--dtype {dtype!r}: the trainer has no such precision; give --precision bf16, fp32 or fp8")
    click.echo(
        f"note: --dtype {dtype} reads as --precision {named}: the estimates count what the trainer keeps "
        f"(fp32 sharded parameters and gradients in every precision); write --precision {named}",
        err=True,
    )
    return named


def _tp_refusal(training: TrainingSpec | None, tp_size: int) -> str | None:
    if training is None or tp_size == 1:
        return None
    from hpc_hsdp.submit_host.preflight import tensor_parallel_refusal  # noqa: PLC0415  (only --tp: plan stays light)

    return tensor_parallel_refusal(training, tp_size)
