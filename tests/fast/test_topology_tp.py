"""The (replicate, shard, tp) plan: coordinates, groups and refusals, table-driven (no torch)."""

from __future__ import annotations

import itertools

import pytest

from hpc_hsdp.errors import TopologyError
from hpc_hsdp.plan.slurm_env import task_environments
from hpc_hsdp.plan.topology import RankLayout, TopologyPlan, plan_for, valid_shard_sizes, valid_tp_sizes


def _runs(first, count, size, stride=1):
    """``count`` groups of ``size`` ranks, the k-th starting at ``first[k]``, ``stride`` apart."""
    return [list(range(start, start + size * stride, stride)) for start in first[:count]]


CASES = {
    "acceptance 2x8 shard 4 (tp 1, unchanged)": {
        "nodes": 2,
        "gpus": 8,
        "shard": 4,
        "tp": 1,
        "mesh": [4, 4],
        "axes": ["replicate", "shard"],
        "tp_groups": [[r] for r in range(16)],
        "shard_groups": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "replicate_groups": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
        "coordinates": {0: (0, 0, 0), 5: (1, 1, 0), 15: (3, 3, 0)},
        "cross": {"tp": False, "shard": False, "replicate": True},
        "kind": "hybrid shard (HSDP)",
    },
    "2x8 shard 2 tp 4": {
        "nodes": 2,
        "gpus": 8,
        "shard": 2,
        "tp": 4,
        "mesh": [2, 2, 4],
        "axes": ["replicate", "shard", "tp"],
        "tp_groups": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "shard_groups": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
        "replicate_groups": [[o, o + 8] for o in range(8)],
        "coordinates": {0: (0, 0, 0), 6: (0, 1, 2), 13: (1, 1, 1), 15: (1, 1, 3)},
        "cross": {"tp": False, "shard": False, "replicate": True},
        "kind": "hybrid shard (HSDP) + tensor parallel (TP)",
    },
    "4x8 shard 16 tp 2 (one copy over all nodes)": {
        "nodes": 4,
        "gpus": 8,
        "shard": 16,
        "tp": 2,
        "mesh": [1, 16, 2],
        "axes": ["replicate", "shard", "tp"],
        "tp_groups": _runs(range(0, 32, 2), 16, 2),
        "shard_groups": [list(range(0, 32, 2)), list(range(1, 32, 2))],
        "replicate_groups": [[r] for r in range(32)],
        "coordinates": {0: (0, 0, 0), 1: (0, 0, 1), 17: (0, 8, 1), 31: (0, 15, 1)},
        "cross": {"tp": False, "shard": True, "replicate": False},
        "kind": "full shard (FSDP) + tensor parallel (TP)",
    },
    "4x8 shard 8 tp 2 (a copy spans 2 nodes)": {
        "nodes": 4,
        "gpus": 8,
        "shard": 8,
        "tp": 2,
        "mesh": [2, 8, 2],
        "axes": ["replicate", "shard", "tp"],
        "tp_groups": _runs(range(0, 32, 2), 16, 2),
        "shard_groups": [
            list(range(0, 16, 2)),
            list(range(1, 16, 2)),
            list(range(16, 32, 2)),
            list(range(17, 32, 2)),
        ],
        "replicate_groups": [[o, o + 16] for o in range(16)],
        "coordinates": {9: (0, 4, 1), 16: (1, 0, 0), 30: (1, 7, 0)},
        "cross": {"tp": False, "shard": True, "replicate": True},
        "kind": "hybrid shard (HSDP) + tensor parallel (TP)",
    },
    "2x8 shard 1 tp 8 (TP per node, replicated)": {
        "nodes": 2,
        "gpus": 8,
        "shard": 1,
        "tp": 8,
        "mesh": [2, 1, 8],
        "axes": ["replicate", "shard", "tp"],
        "tp_groups": [list(range(8)), list(range(8, 16))],
        "shard_groups": [[r] for r in range(16)],
        "replicate_groups": [[o, o + 8] for o in range(8)],
        "coordinates": {3: (0, 0, 3), 12: (1, 0, 4)},
        "cross": {"tp": False, "shard": False, "replicate": True},
        "kind": "replicate (DDP-like) + tensor parallel (TP)",
    },
    "1x4 shard 1 tp 4 (TP only)": {
        "nodes": 1,
        "gpus": 4,
        "shard": 1,
        "tp": 4,
        "mesh": [1, 1, 4],
        "axes": ["replicate", "shard", "tp"],
        "tp_groups": [[0, 1, 2, 3]],
        "shard_groups": [[0], [1], [2], [3]],
        "replicate_groups": [[0], [1], [2], [3]],
        "coordinates": {2: (0, 0, 2)},
        "cross": {"tp": False, "shard": False, "replicate": False},
        "kind": "tensor parallel (TP)",
    },
}


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_three_axis_plans(case):
    plan = plan_for(nodes=case["nodes"], gpus_per_node=case["gpus"], shard_size=case["shard"], tp_size=case["tp"])
    assert list(plan.mesh_shape) == case["mesh"]
    assert list(plan.mesh_axis_names) == case["axes"]
    assert [list(g) for g in plan.tp_groups] == case["tp_groups"]
    assert [list(g) for g in plan.shard_groups] == case["shard_groups"]
    assert [list(g) for g in plan.replicate_groups] == case["replicate_groups"]
    for rank, coords in case["coordinates"].items():
        assert plan.coordinates(rank) == coords
    assert plan.tp_groups_cross_nodes is case["cross"]["tp"]
    assert plan.shard_groups_cross_nodes is case["cross"]["shard"]
    assert plan.replicate_groups_cross_nodes is case["cross"]["replicate"]
    assert plan.kind == case["kind"]


SHAPES = [
    ((8, 8), 4, 1),
    ((8, 8), 2, 4),
    ((8, 8), 1, 8),
    ((8, 8, 8, 8), 16, 2),
    ((8, 8, 8, 8), 8, 2),
    ((8, 8, 8, 8), 4, 4),
    ((8, 4), 2, 2),
    ((4, 8), 1, 4),
    ((2, 2, 2, 2), 2, 2),
    ((8,), 2, 2),
]


@pytest.mark.parametrize(("tasks", "shard", "tp"), SHAPES)
def test_groups_follow_the_coordinates(tasks, shard, tp):
    """rank = (r * S + s) * T + t; a tp group shares (r, s), a shard group (r, t), a replicate
    group (s, t); each kind of group tiles the world; TP groups never leave a node."""
    plan = TopologyPlan(tasks_per_node=tasks, shard_size=shard, tp_size=tp)
    r_count, s_count, t_count = plan.num_replicas, shard, tp
    assert r_count * s_count * t_count == plan.world_size
    for rank in range(plan.world_size):
        r, s, t = plan.coordinates(rank)
        assert rank == (r * s_count + s) * t_count + t
        assert rank in plan.tp_group_of(rank) and rank in plan.shard_group_of(rank)
        assert rank in plan.replicate_group_of(rank)
    for groups, shared in ((plan.tp_groups, (0, 1)), (plan.shard_groups, (0, 2)), (plan.replicate_groups, (1, 2))):
        assert sorted(itertools.chain.from_iterable(groups)) == list(range(plan.world_size))
        for group in groups:
            assert len({tuple(plan.coordinates(rank)[i] for i in shared) for rank in group}) == 1
    assert not plan.tp_groups_cross_nodes
    assert all(len(plan.nodes_of_group(g)) == 1 for g in plan.tp_groups)
    # a copy of the model is S x T consecutive ranks: the tp groups of one shard group's copy
    for r in range(r_count):
        copy = range(r * shard * tp, (r + 1) * shard * tp)
        assert sorted(rank for g in plan.shard_groups[r * tp : (r + 1) * tp] for rank in g) == list(copy)


@pytest.mark.parametrize(("tasks", "shard", "tp"), SHAPES)
def test_to_dict_lists_the_tp_axis(tasks, shard, tp):
    data = TopologyPlan(tasks_per_node=tasks, shard_size=shard, tp_size=tp).to_dict()
    if tp == 1:
        assert not {"tp_size", "tp_groups", "coordinates", "tp_groups_cross_nodes"} & set(data)
        assert data["mesh_axis_names"] == ["replicate", "shard"]
    else:
        assert data["tp_size"] == tp and data["mesh_axis_names"] == ["replicate", "shard", "tp"]
        assert len(data["coordinates"]) == sum(tasks) and data["tp_groups_cross_nodes"] is False
        assert len(data["tp_groups"]) == sum(tasks) // tp


def test_tp_1_output_is_what_it_was():
    """The keys and their order of a plan without TP are those of the two-axis plan."""
    data = plan_for(nodes=2, gpus_per_node=8, shard_size=4).to_dict()
    assert list(data) == [
        "nodes",
        "gpus_per_node",
        "tasks_per_node",
        "node_names",
        "world_size",
        "shard_size",
        "num_replicas",
        "mesh_shape",
        "mesh_axis_names",
        "kind",
        "shard_groups",
        "replicate_groups",
        "node_of_rank",
        "local_rank_of_rank",
        "shard_groups_cross_nodes",
        "replicate_groups_cross_nodes",
    ]
    assert data["mesh_shape"] == [4, 4]


@pytest.mark.parametrize(
    ("tasks", "shard", "tp", "message"),
    [
        ((8, 8), 1, 3, "tp size 3 does not divide the 8 tasks (GPUs) on node n1; a tensor-parallel group stays "
         "inside one node: use a --tp that divides every node's task count (1, 2, 4, 8)"),
        ((8, 8), 1, 16, "tp size 16 does not divide the 8 tasks (GPUs) on node n1"),
        ((8, 4), 1, 8, "tp size 8 does not divide the 4 tasks (GPUs) on node n2;"),
        ((8, 6), 1, 4, "every node's task count (1, 2)"),
        ((8, 8), 1, 0, "tp size 0 is invalid"),
        ((8, 8), 1, True, "tp size True is invalid"),
        ((8, 8), 3, 2, "shard size 3 does not divide the 4 TP groups of 2 on node n1; choose a shard size that "
         "divides every node's TP-group count (1, 2, 4) or a multiple of 4 that divides 8"),
        ((8, 8), 6, 2, "shard size 6 is larger than a node (4 TP groups of 2) but not a multiple of it"),
        ((8, 8, 8), 8, 2, "shard size 8 spans 2 nodes but the job has 3 nodes (12 TP groups of 2)"),
        ((8, 4), 4, 2, "shard size 4 is larger than the smallest node (2 TP groups of 2) of the uneven "
         "allocation 8,4"),
    ],
)  # fmt: skip
def test_refused_tp_plans(tasks, shard, tp, message):
    with pytest.raises(TopologyError) as refused:
        TopologyPlan(tasks_per_node=tasks, shard_size=shard, tp_size=tp)
    assert message in str(refused.value)


@pytest.mark.parametrize("tasks", [(8, 8), (8, 8, 8, 8), (8, 4), (6, 6, 6), (4,), (2, 2, 2, 2)])
def test_valid_sizes_are_exactly_those_accepted(tasks):
    world = sum(tasks)
    accepted_tp = []
    for tp in range(1, max(tasks) + 1):
        try:
            TopologyPlan(tasks_per_node=tasks, shard_size=1, tp_size=tp)
        except TopologyError:
            continue
        accepted_tp.append(tp)
    assert valid_tp_sizes(tasks) == accepted_tp
    for tp in accepted_tp:
        accepted = []
        for shard in range(1, world // tp + 1):
            try:
                TopologyPlan(tasks_per_node=tasks, shard_size=shard, tp_size=tp)
            except TopologyError:
                continue
            accepted.append(shard)
        assert valid_shard_sizes(tasks, tp) == accepted


@pytest.mark.parametrize("distribution", ["block", "cyclic"])
@pytest.mark.parametrize(("tasks", "shard", "tp"), [((8, 8), 2, 4), ((8, 8, 8, 8), 8, 2), ((4, 4), 1, 4)])
def test_layouts_from_slurm_agree_with_the_plan(tasks, shard, tp, distribution):
    names = [f"gpu{i + 1}" for i in range(len(tasks))]
    envs = task_environments(tasks_per_node=tasks, node_names=names, job_id="77", distribution=distribution)
    plan = TopologyPlan(tasks_per_node=tasks, shard_size=shard, tp_size=tp, node_names=tuple(names))
    layouts = [RankLayout.from_env(env, shard_size=shard, tp_size=tp) for env in envs]
    assert sorted(lay.rank for lay in layouts) == list(range(plan.world_size))
    for lay in layouts:
        assert lay.plan == plan
        assert lay.coordinates == plan.coordinates(lay.rank)
        assert lay.tp_group == plan.tp_group_of(lay.rank) and lay.shard_group == plan.shard_group_of(lay.rank)
        assert {layouts_by_rank.node for layouts_by_rank in layouts if layouts_by_rank.rank in lay.tp_group} == {
            lay.node
        }
        data = lay.to_dict()
        assert data["tp_size"] == tp and data["coordinates"] == list(lay.coordinates)
        assert data["tp_group"] == list(lay.tp_group)


def test_layout_without_tp_has_no_tp_fields():
    env = task_environments(tasks_per_node=(8, 8), node_names=["n1", "n2"], job_id="1")[9]
    data = RankLayout.from_env(env, shard_size=4).to_dict()
    assert not {"tp_size", "coordinates", "tp_group", "node_switch", "node_switches"} & set(data)
