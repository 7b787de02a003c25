"""The layout ``hpc-hsdp plan``'s options describe (pure): ``--nodes``, ``--gpus-per-node``,
``--nodelist`` and ``--tasks-per-node`` read into a :class:`TopologyPlan` (:func:`build_plan`),
the range of a flexible ``--nodes MIN-MAX`` (:func:`node_range`), the plan placed on the switches
``--node-switches`` names (:func:`on_switches`) and the replica groups of ``--fault-tolerance
replica`` (:func:`replica_plan`)."""

from __future__ import annotations

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.replica_layout import ReplicaShape, replica_shape
from hpc_hsdp.plan.slurm_env import compress_nodelist
from hpc_hsdp.plan.switches import parse_node_switches
from hpc_hsdp.plan.topology import (
    TopologyPlan,
    expand_nodelist,
    parse_tasks_per_node,
    plan_for,
    plan_on_switches,
)


def build_plan(
    *,
    nodes: int | None,
    gpus_per_node: int,
    shard_size: int,
    nodelist: str | None = None,
    tasks_per_node_text: str | None = None,
    tp_size: int = 1,
) -> TopologyPlan:
    """The plan of ``--nodes`` x ``--gpus-per-node``, or of the uneven ``--tasks-per-node`` (SLURM's
    form); ``--nodelist`` names the nodes (without ``--nodes``, their count is the number of nodes)."""
    names = expand_nodelist(nodelist) if nodelist else ()
    if tasks_per_node_text:
        counts = parse_tasks_per_node(tasks_per_node_text)
        if nodes is not None and nodes != len(counts):
            raise SpecError(
                f"--nodes {nodes} but --tasks-per-node {tasks_per_node_text!r} describes {len(counts)} nodes; drop one"
            )
        if names and len(names) != len(counts):
            raise SpecError(
                f"--nodelist names {len(names)} nodes but --tasks-per-node describes {len(counts)}; make them agree"
            )
        return TopologyPlan(tasks_per_node=counts, shard_size=shard_size, node_names=names, tp_size=tp_size)
    if nodes is None:
        nodes = len(names) or 1
    elif names and len(names) != nodes:
        raise SpecError(f"--nodes {nodes} but --nodelist {nodelist!r} names {len(names)} nodes; make them agree")
    return plan_for(nodes=nodes, gpus_per_node=gpus_per_node, shard_size=shard_size, node_names=names, tp_size=tp_size)


def node_range(nodes: tuple[int, int] | None, *, one_allocation: bool) -> tuple[int | None, int | None]:
    """``--nodes`` as parsed, (fewest, most) -> (fewest, most) with fewest None unless the allocation
    is flexible; (None, None) without ``--nodes``. ``one_allocation``: other options describe one
    allocation (``--nodelist``, ``--tasks-per-node``, ``--recommend``), which a range cannot be."""
    if nodes is None:
        return None, None
    fewest_nodes, most_nodes = nodes
    if fewest_nodes == most_nodes:
        return None, most_nodes
    if one_allocation:
        raise SpecError(
            f"--nodes {fewest_nodes}-{most_nodes} (flexible) with --nodelist, --tasks-per-node or --recommend: "
            f"those describe one allocation; give --nodes N"
        )
    return fewest_nodes, most_nodes


def on_switches(the_plan: TopologyPlan, text: str, topology: str) -> TopologyPlan:
    """``the_plan`` over the switches ``text`` names (``HPC_HSDP_NODE_SWITCHES``'s form), ordered and
    checked as a job with ``--topology`` would be."""
    places = parse_node_switches(text)
    if text.strip() and not set(places) & set(the_plan.node_names):
        raise SpecError(
            f"--node-switches names none of the job's nodes ({compress_nodelist(the_plan.node_names)}); name the "
            f"nodes with --nodelist as SLURM does"
        )
    return plan_on_switches(
        tasks_per_node=the_plan.tasks_per_node,
        shard_size=the_plan.shard_size,
        node_names=the_plan.node_names,
        places=places,
        tp_size=the_plan.tp_size,
        topology=topology,
    )


def replica_plan(
    the_plan: TopologyPlan, *, fault_tolerance: str, min_replicas: int, spare_nodes: int, fewest_nodes: int | None
) -> ReplicaShape | None:
    """The replica groups, spares and lighthouse of ``--fault-tolerance replica`` (None without it)."""
    if fault_tolerance != "replica":
        if spare_nodes:
            raise SpecError(f"--spare-nodes {spare_nodes} needs --fault-tolerance replica")
        return None
    if fewest_nodes is not None:
        raise SpecError("--fault-tolerance replica does not work with a flexible allocation (--nodes MIN-MAX) yet")
    return replica_shape(the_plan, min_replicas=min_replicas, spare_nodes=spare_nodes)
