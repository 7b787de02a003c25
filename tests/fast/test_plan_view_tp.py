"""``hpc-hsdp plan --tp T``: the table, the TP line, --json and --svg name each rank's (r, s, t) and
its groups by their index in the plan (table-driven; no torch). T = 1 is pinned by test_plan_golden."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

from hpc_hsdp.cli import cli
from hpc_hsdp.plan.topology import plan_for
from hpc_hsdp.plan.view import plan_svg, plan_text, replicate_group_index, shard_group_index, traffic_verdict

# (nodes, gpus, shard, tp) -> rank -> (r,s,t) cell, tp group cell, shard group cell, replicate group cell
ROWS = {
    (2, 8, 2, 4): {
        0: ("(0,0,0)", "0: [0-3]", "0: [0,4]", "0: [0,8]"),
        6: ("(0,1,2)", "1: [4-7]", "2: [2,6]", "6: [6,14]"),
        13: ("(1,1,1)", "3: [12-15]", "5: [9,13]", "5: [5,13]"),
    },
    (4, 8, 16, 2): {
        17: ("(0,8,1)", "8: [16,17]", "1: [1,3,5,...,31]", "17: [17]"),
        30: ("(0,15,0)", "15: [30,31]", "0: [0,2,4,...,30]", "30: [30]"),
    },
    (4, 8, 8, 2): {
        9: ("(0,4,1)", "4: [8,9]", "1: [1,3,5,7,9,11,13,15]", "9: [9,25]"),
        16: ("(1,0,0)", "8: [16,17]", "2: [16,18,20,22,24,26,28,30]", "0: [0,16]"),
    },
    (1, 8, 1, 8): {5: ("(0,0,5)", "0: [0-7]", "5: [5]", "5: [5]")},
    (2, 4, 1, 2): {3: ("(1,0,1)", "1: [2,3]", "3: [3]", "1: [1,3,5,7]")},
}


def _row(text: str, rank: int) -> list[str]:
    for line in text.splitlines():
        cells = line.split("  ")
        cells = [c.strip() for c in cells if c.strip()]
        if len(cells) == 7 and cells[2] == str(rank):
            return cells
    raise AssertionError(f"no row of rank {rank} in\n{text}")


@pytest.mark.parametrize(("shape", "rows"), ROWS.items(), ids=[f"{n}x{g} shard {s} tp {t}" for n, g, s, t in ROWS])
def test_table_names_coordinates_and_groups(shape, rows):
    nodes, gpus, shard, tp = shape
    plan = plan_for(nodes=nodes, gpus_per_node=gpus, shard_size=shard, tp_size=tp)
    text = plan_text(plan)
    assert text.splitlines()[0].split() == ["node", "gpu", "rank", "(r,s,t)", "tp", "group", "shard", "group",
                                            "replicate", "group"]  # fmt: skip
    for rank, cells in rows.items():
        assert tuple(_row(text, rank)[3:]) == cells


@pytest.mark.parametrize("shape", list(ROWS), ids=[f"{n}x{g} shard {s} tp {t}" for n, g, s, t in ROWS])
def test_group_labels_index_the_plans_groups(shape):
    nodes, gpus, shard, tp = shape
    plan = plan_for(nodes=nodes, gpus_per_node=gpus, shard_size=shard, tp_size=tp)
    for rank in range(plan.world_size):
        assert plan.shard_groups[shard_group_index(plan, rank)] == plan.shard_group_of(rank)
        assert plan.replicate_groups[replicate_group_index(plan, rank)] == plan.replicate_group_of(rank)
        assert rank in plan.shard_group_of(rank) and rank in plan.replicate_group_of(rank)


@pytest.mark.parametrize(
    ("shape", "lines"),
    [
        (
            (2, 8, 2, 4),
            [
                "hybrid shard (HSDP) + tensor parallel (TP): mesh (replicate=2, shard=2, tp=4) over 2 node(s), 16 ranks",
                "TP groups: 4 of 4 consecutive ranks ([0-3], [4-7], [8-11], [12-15]), each inside one node",
                # not only sequence parallelism: an hf: model's plan all-reduces
                "all-reduces under an hf: model's plan) stay on the node's links",
                "replicate groups: the all-reduce of 1/8 of the gradients crosses nodes",
            ],
        ),
        (
            (4, 8, 16, 2),
            [
                "TP groups: 16 of 2 consecutive ranks ([0,1], [2,3], [4,5], [6,7], ... 12 more), each inside one node",
                "shard groups span 4 whole nodes",
            ],
        ),
        (
            (1, 8, 1, 8),
            [
                "tensor parallel (TP): mesh (replicate=1, shard=1, tp=8)",
                "no sharding over the shard axis: each TP group holds a whole copy of the model (1/8 of every split "
                "layer per rank)",
            ],
        ),
        (
            (2, 4, 1, 2),
            ["replicate (DDP-like) + tensor parallel (TP)", "gradients are all-reduced across the replicas"],
        ),
    ],
)
def test_verdict_names_the_tp_groups(shape, lines):
    nodes, gpus, shard, tp = shape
    said = "\n".join(traffic_verdict(plan_for(nodes=nodes, gpus_per_node=gpus, shard_size=shard, tp_size=tp)))
    for line in lines:
        assert line in said


def test_svg_frames_each_tp_group_and_labels_coordinates():
    plan = plan_for(nodes=2, gpus_per_node=8, shard_size=2, tp_size=4)
    root = ET.fromstring(plan_svg(plan))
    ns = "{http://www.w3.org/2000/svg}"
    texts = [t.text for t in root.iter(f"{ns}text")]
    assert "S2 R6 T1" in texts and "(0,1,2)" in texts  # rank 6
    assert sum(1 for t in texts if t and t.startswith("rank ")) == 16
    frames = [r for r in root.iter(f"{ns}rect") if r.get("stroke-dasharray")]
    assert len(frames) == len(plan.tp_groups) == 4
    assert "mesh (replicate, shard, tp) = (2, 2, 4)" in " ".join(t for t in texts if t)


def test_cli_plan_tp_text_json_svg(tmp_path):
    path = tmp_path / "tp.svg"
    args = ["plan", "--nodes", "2", "--shard", "2", "--tp", "4"]
    text = CliRunner().invoke(cli, [*args, "--svg", str(path)])
    assert text.exit_code == 0, text.output
    assert _row(text.output, 6)[3:] == ["(0,1,2)", "1: [4-7]", "2: [2,6]", "6: [6,14]"]
    assert "(0,1,2)" in path.read_text()
    data = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
    assert data["coordinates"][6] == [0, 1, 2] and data["tp_groups"][1] == [4, 5, 6, 7]
    assert data["mesh_shape"] == [2, 2, 4] and data["tp_groups_cross_nodes"] is False
