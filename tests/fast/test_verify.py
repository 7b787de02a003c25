"""The realized-group check, pure (no torch): plan + node names + realized groups -> problems."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpc_hsdp.plan.topology import TopologyPlan, plan_for
from hpc_hsdp.task.parallelism.verify import compare_groups, format_problems, mismatch_message


def planned(plan: TopologyPlan, node_names=None):
    """The realized inputs of a job that is exactly the plan."""
    names = node_names or plan.node_names
    nodes = [names[plan.node_of_rank[r]] for r in range(plan.world_size)]
    shard = [plan.shard_group_of(r) for r in range(plan.world_size)]
    replicate = [plan.replicate_group_of(r) for r in range(plan.world_size)]
    return nodes, shard, replicate


def cyclic_nodes(plan: TopologyPlan):
    """Node of each torch rank when RANK = SLURM_PROCID under --distribution=cyclic."""
    return [plan.node_names[r % plan.nodes] for r in range(plan.world_size)]


P_2x4_S2 = plan_for(nodes=2, gpus_per_node=4, shard_size=2, node_names=("n1", "n2"))
P_2x8_S4 = plan_for(nodes=2, gpus_per_node=8, shard_size=4, node_names=("n1", "n2"))
P_4x8_S16 = plan_for(nodes=4, gpus_per_node=8, shard_size=16, node_names=("a", "b", "c", "d"))
P_UNEVEN = TopologyPlan(tasks_per_node=(8, 8, 4), shard_size=4, node_names=("g1", "g2", "g3"))


def _case_exact(plan):
    return plan, *planned(plan)


def _case_torchrun_names():
    # torchrun outside SLURM: the plan says n1/n2, the hosts say otherwise.
    plan = plan_for(nodes=2, gpus_per_node=4, shard_size=4)
    return plan, *planned(plan, node_names=("gpu-a01", "gpu-a02"))


def _case_cyclic_ranks(plan):
    _, shard, replicate = planned(plan)
    return plan, cyclic_nodes(plan), shard, replicate


def _case_strided_shard_groups():
    plan = P_2x8_S4
    nodes, _, replicate = planned(plan)
    # shard groups built strided (as a column-major mesh would): [0,4,8,12], ...
    shard = [tuple(range(r % 4, 16, 4)) for r in range(16)]
    return plan, nodes, shard, replicate


def _case_two_planned_nodes_one_host():
    plan = P_2x4_S2
    _, shard, replicate = planned(plan)
    return plan, ["n1"] * 8, shard, replicate


def _case_big_shard_spans_three_nodes():
    plan = P_4x8_S16
    nodes, shard, replicate = planned(plan)
    nodes = list(nodes)
    nodes[7], nodes[16] = nodes[16], nodes[7]  # rank 7 really on c, rank 16 on a
    return plan, nodes, shard, replicate


CASES = [
    # (id, inputs, expected (axis, planned, realized) triples, in order)
    ("2x4 S2 exact", _case_exact(P_2x4_S2), []),
    ("2x8 S4 exact (forum example)", _case_exact(P_2x8_S4), []),
    ("4x8 S16 exact (shard spans 2 nodes)", _case_exact(P_4x8_S16), []),
    ("uneven 8,8,4 S4 exact", _case_exact(P_UNEVEN), []),
    ("torchrun node names differ from hosts", _case_torchrun_names(), []),
    (
        "RANK=PROCID under cyclic",
        _case_cyclic_ranks(P_2x4_S2),
        [
            ("node", (0, 1, 2, 3), (0, 1, 2, 3)),
            ("node", (4, 5, 6, 7), (4, 5, 6, 7)),
            ("shard", (0, 1), (0, 1)),
            ("shard", (2, 3), (2, 3)),
            ("shard", (4, 5), (4, 5)),
            ("shard", (6, 7), (6, 7)),
        ],
    ),
    (
        "strided shard groups",
        _case_strided_shard_groups(),
        # reported once per realized group, against the plan of the first rank holding it
        [
            ("shard", (0, 1, 2, 3), (0, 4, 8, 12)),
            ("shard", (0, 1, 2, 3), (1, 5, 9, 13)),
            ("shard", (0, 1, 2, 3), (2, 6, 10, 14)),
            ("shard", (0, 1, 2, 3), (3, 7, 11, 15)),
        ],
    ),
    ("two planned nodes on one host", _case_two_planned_nodes_one_host(), [("node", (), tuple(range(8)))]),
    (
        "S16 group over three nodes",
        _case_big_shard_spans_three_nodes(),
        [
            ("node", tuple(range(8)), tuple(range(8))),
            ("node", tuple(range(16, 24)), tuple(range(16, 24))),
            ("shard", tuple(range(16)), tuple(range(16))),
            ("shard", tuple(range(16, 32)), tuple(range(16, 32))),
        ],
    ),
]


@pytest.mark.parametrize("inputs, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_compare_groups(inputs, expected):
    problems = compare_groups(*inputs)
    assert [(p.axis, p.planned, p.realized) for p in problems] == expected


def test_problem_names_the_nodes_a_group_spans():
    problems = compare_groups(*_case_cyclic_ranks(P_2x4_S2))
    shard = [p for p in problems if p.axis == "shard"]
    assert all(p.nodes == ("n1", "n2") for p in shard)
    assert all("inside one node but it spans 2" in p.reason for p in shard)


def test_table_lists_every_problem_with_a_hint():
    plan = P_2x4_S2
    problems = compare_groups(*_case_cyclic_ranks(plan))
    table = format_problems(problems)
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["axis", "planned", "realized", "nodes"]
    assert len(lines) == 1 + len(problems)
    assert "[0,1]" in table and "n1,n2" in table
    message = mismatch_message(problems, plan)
    assert "does not match the plan" in message and "HINT" in message and "shard size 2" in message


def test_lengths_must_match_the_plan():
    nodes, shard, replicate = planned(P_2x4_S2)
    with pytest.raises(ValueError, match="7 node names for a plan of 8 ranks"):
        compare_groups(P_2x4_S2, nodes[:7], shard, replicate)


def test_verify_imports_no_torch():
    code = "import sys, hpc_hsdp.task.parallelism.verify; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_check_covers_the_tp_groups():
    """With --tp the realized TP groups are compared too: T consecutive ranks of one node."""
    plan = plan_for(nodes=2, gpus_per_node=4, shard_size=2, tp_size=2, node_names=("n1", "n2"))
    nodes, shard, replicate = planned(plan)
    tp = [plan.tp_group_of(r) for r in range(plan.world_size)]
    assert tp[:4] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert compare_groups(plan, nodes, shard, replicate, tp) == []
    strided = [tuple(range(r % 2, 8, 2))[:2] if r < 4 else tp[r] for r in range(8)]  # [0, 2], [1, 3] on n1
    problems = compare_groups(plan, nodes, shard, replicate, strided)
    assert {p.axis for p in problems} == {"tp"} and {p.realized for p in problems} == {(0, 2), (1, 3)}
    across = [(r, r + 4) if r < 4 else (r - 4, r) for r in range(8)]  # each TP group spanning n1 and n2
    problems = compare_groups(plan, nodes, shard, replicate, across)
    assert {p.axis for p in problems} == {"tp"} and all(p.nodes == ("n1", "n2") for p in problems)
