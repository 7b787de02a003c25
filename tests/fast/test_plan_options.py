"""plan/plan_options.py: the layout `hpc-hsdp plan`'s options describe, read without the command."""

from __future__ import annotations

import re

import pytest

from hpc_hsdp.errors import SpecError, TopologyError
from hpc_hsdp.plan.plan_options import build_plan, node_range, on_switches, replica_plan


@pytest.mark.parametrize(
    ("options", "tasks_per_node", "node_names"),
    [
        (dict(nodes=2, gpus_per_node=8, shard_size=4), (8, 8), ()),
        (dict(nodes=None, gpus_per_node=4, shard_size=2), (4,), ()),  # no --nodes: one node
        (
            dict(nodes=None, gpus_per_node=8, shard_size=4, nodelist="gpu-a[01-03]"),
            (8, 8, 8),
            ("gpu-a01", "gpu-a02", "gpu-a03"),
        ),
        (dict(nodes=None, gpus_per_node=8, shard_size=4, tasks_per_node_text="8(x2),4"), (8, 8, 4), ()),
        (
            dict(nodes=3, gpus_per_node=8, shard_size=4, tasks_per_node_text="8(x2),4", nodelist="n[1-3]"),
            (8, 8, 4),
            ("n1", "n2", "n3"),
        ),
    ],
)
def test_build_plan_reads_the_nodes_as_the_options_give_them(options, tasks_per_node, node_names):
    plan = build_plan(**options)
    assert plan.tasks_per_node == tasks_per_node
    assert plan.node_names[: len(node_names)] == node_names
    assert plan.shard_size == options["shard_size"]


def test_build_plan_keeps_the_tp_size():
    plan = build_plan(nodes=2, gpus_per_node=8, shard_size=2, tp_size=4)
    assert (plan.tp_size, plan.shard_size, plan.num_replicas) == (4, 2, 2)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(nodes=2, tasks_per_node_text="8(x2),4"), "--nodes 2 but --tasks-per-node '8(x2),4' describes 3 nodes"),
        (dict(nodes=None, tasks_per_node_text="8(x2),4", nodelist="n[1-2]"), "--nodelist names 2 nodes but"),
        (dict(nodes=3, nodelist="n[1-2]"), "--nodes 3 but --nodelist 'n[1-2]' names 2 nodes"),
    ],
)
def test_build_plan_refuses_options_that_disagree(options, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        build_plan(gpus_per_node=8, shard_size=4, **options)


def test_build_plan_passes_the_topologys_own_refusal():
    with pytest.raises(TopologyError):
        build_plan(nodes=2, gpus_per_node=8, shard_size=3)


@pytest.mark.parametrize(
    ("nodes", "one_allocation", "expected"),
    [
        (None, False, (None, None)),
        (None, True, (None, None)),
        ((2, 2), False, (None, 2)),
        ((2, 2), True, (None, 2)),  # a fixed count is one allocation
        ((1, 4), False, (1, 4)),
    ],
)
def test_node_range(nodes, one_allocation, expected):
    assert node_range(nodes, one_allocation=one_allocation) == expected


def test_a_flexible_range_is_not_one_allocation():
    with pytest.raises(SpecError, match=r"--nodes 1-4 \(flexible\) with --nodelist, --tasks-per-node or --recommend"):
        node_range((1, 4), one_allocation=True)


def test_on_switches_orders_the_nodes_by_switch():
    plan = build_plan(nodes=4, gpus_per_node=8, shard_size=16, nodelist="n[1-4]")
    placed = on_switches(plan, "spine.leaf1:n[1,3];spine.leaf2:n[2,4]", "auto")
    assert placed.node_names == ("n1", "n3", "n2", "n4")


def test_on_switches_refuses_switches_that_name_none_of_the_nodes():
    plan = build_plan(nodes=2, gpus_per_node=8, shard_size=4, nodelist="n[1-2]")
    with pytest.raises(SpecError, match=r"--node-switches names none of the job's nodes \(n\[1-2\]\)"):
        on_switches(plan, "a:x[1-2]", "auto")


@pytest.mark.parametrize(
    ("fault_tolerance", "spare_nodes", "fewest_nodes", "message"),
    [
        ("none", 1, None, "--spare-nodes 1 needs --fault-tolerance replica"),
        ("replica", 0, 1, "--fault-tolerance replica does not work with a flexible allocation"),
    ],
)
def test_replica_plan_refusals(fault_tolerance, spare_nodes, fewest_nodes, message):
    plan = build_plan(nodes=4, gpus_per_node=8, shard_size=8)
    with pytest.raises(SpecError, match=message):
        replica_plan(
            plan, fault_tolerance=fault_tolerance, min_replicas=1, spare_nodes=spare_nodes, fewest_nodes=fewest_nodes
        )


def test_replica_plan():
    plan = build_plan(nodes=4, gpus_per_node=8, shard_size=8)
    assert replica_plan(plan, fault_tolerance="none", min_replicas=1, spare_nodes=0, fewest_nodes=None) is None
    shape = replica_plan(plan, fault_tolerance="replica", min_replicas=1, spare_nodes=1, fewest_nodes=None)
    assert shape is not None
    # the spare comes on top of the plan's four nodes
    assert (shape.nodes_per_group, len(shape.groups), len(shape.spares)) == (1, 4, 1)
