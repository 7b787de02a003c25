"""Switch-aware node order: SLURM's topology read, the order that keeps shard groups under one
leaf switch, ``--topology strict``'s refusals, and the layout each task derives from the
exported switches. Pure; the captured fixtures come from the dev cluster (Slurm 22.05,
topology/tree: n1, n3, site1 under leaf1; n2, site2 under leaf2; both under spine)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hpc_hsdp.errors import SlurmEnvError, SpecError, TopologyError
from hpc_hsdp.plan.slurm_env import task_environments
from hpc_hsdp.plan.slurm_facts import check_segment, check_switches
from hpc_hsdp.plan.switches import (
    NODE_SWITCHES_ENV,
    Switch,
    format_node_switches,
    parse_node_switches,
    parse_scontrol_topology,
    parse_topology_addr,
    switch_order,
    switches_from_addrs,
    switches_of_nodes,
)
from hpc_hsdp.plan.topology import RankLayout, TopologyPlan, plan_on_switches

DATA = Path(__file__).resolve().parents[1] / "data"
SCONTROL = (DATA / "slurm-topology" / "scontrol-show-topology.txt").read_text()
"""``scontrol show topology`` on the dev cluster."""


def captured_task(procid: int) -> dict[str, str]:
    """A task of ``srun -N3 --ntasks-per-node=2 --gpus-per-node=8`` on the dev cluster."""
    lines = (DATA / "slurm-env" / f"topo.{procid}.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


# ------------------------------------------------------------------------------ reading SLURM


def test_scontrol_show_topology_of_the_dev_cluster():
    assert parse_scontrol_topology(SCONTROL) == (
        Switch(name="leaf1", level=0, nodes=("n1", "n3", "site1")),
        Switch(name="leaf2", level=0, nodes=("n2", "site2")),
        Switch(name="spine", level=1, nodes=("n1", "n2", "n3", "site1", "site2"), switches=("leaf1", "leaf2")),
    )
    assert switches_of_nodes(parse_scontrol_topology(SCONTROL), ["n1", "n2", "n3", "elsewhere"]) == {
        "n1": ("spine", "leaf1"),
        "n2": ("spine", "leaf2"),
        "n3": ("spine", "leaf1"),
    }


def test_scontrol_agrees_with_each_tasks_own_address():
    """What every task of the captured 3-node step says of its node is what scontrol says."""
    addrs = [captured_task(p)["SLURM_TOPOLOGY_ADDR"] for p in range(6)]
    patterns = {captured_task(p)["SLURM_TOPOLOGY_ADDR_PATTERN"] for p in range(6)}
    assert patterns == {"switch.switch.node"}
    assert addrs == ["spine.leaf1.n1"] * 2 + ["spine.leaf2.n2"] * 2 + ["spine.leaf1.n3"] * 2
    from_tasks = switches_from_addrs(addrs)
    assert from_tasks == switches_of_nodes(parse_scontrol_topology(SCONTROL), ["n1", "n2", "n3"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("scontrol: error: No topology information available\n", ()),  # topology/none (captured, 22.05)
        ("", ()),
        (
            "BlockName=b1 BlockIndex=0 Nodes=gpu[01-04]\nBlockName=b2 BlockIndex=1 Nodes=gpu[05-08]\n",
            (
                Switch(name="b1", level=0, nodes=("gpu01", "gpu02", "gpu03", "gpu04")),
                Switch(name="b2", level=0, nodes=("gpu05", "gpu06", "gpu07", "gpu08")),
            ),
        ),
        (
            "SwitchName=s0 Level=0 LinkSpeed=1 Nodes=(null)\n",
            (Switch(name="s0", level=0, nodes=()),),
        ),
    ],
)
def test_scontrol_forms(text, expected):
    assert parse_scontrol_topology(text) == expected


def test_three_levels_give_the_path_from_the_top():
    text = (
        "SwitchName=l1 Level=0 Nodes=a[1-2]\nSwitchName=l2 Level=0 Nodes=a[3-4]\n"
        "SwitchName=agg Level=1 Nodes=a[1-4] Switches=l[1-2]\nSwitchName=core Level=2 Nodes=a[1-4] Switches=agg\n"
    )
    assert switches_of_nodes(parse_scontrol_topology(text), ["a1", "a4"]) == {
        "a1": ("core", "agg", "l1"),
        "a4": ("core", "agg", "l2"),
    }


@pytest.mark.parametrize(
    ("addr", "pattern", "expected"),
    [
        ("spine.leaf1.n1", "switch.switch.node", ("n1", ("spine", "leaf1"))),
        ("leaf.n7", "", ("n7", ("leaf",))),
        ("n1", "node", ("n1", ())),  # a node under no switch
        ("b3.gpu12", "block.node", ("gpu12", ("b3",))),
    ],
)
def test_topology_addr(addr, pattern, expected):
    assert parse_topology_addr(addr, pattern) == expected


@pytest.mark.parametrize(
    ("addr", "pattern", "message"),
    [
        ("", "", "is not a dot-separated address"),
        ("spine..n1", "", "is not a dot-separated address"),
        ("spine.leaf1.n1", "switch.node", "does not match SLURM_TOPOLOGY_ADDR_PATTERN"),
        ("spine.n1", "node.switch", "does not match"),
    ],
)
def test_topology_addr_refused(addr, pattern, message):
    with pytest.raises(SlurmEnvError, match=message):
        parse_topology_addr(addr, pattern)


# ------------------------------------------------------------------------------ the exported variable


def test_exported_switches_round_trip_and_stay_small():
    places = switches_of_nodes(parse_scontrol_topology(SCONTROL), ["n1", "n2", "n3"])
    text = format_node_switches(places, ["n1", "n2", "n3"])
    assert text == "spine.leaf1:n[1,3];spine.leaf2:n2"
    assert parse_node_switches(text) == places
    nodes = [f"gpu{i:04d}" for i in range(1, 4097)]
    big = {node: ("core", f"leaf{(i // 32) + 1}") for i, node in enumerate(nodes)}
    text = format_node_switches(big, nodes)
    assert parse_node_switches(text) == big
    assert len(text) < 8_000  # 4096 nodes on 128 leaves: far below the 128 KiB of one variable


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("spine.leaf1", "is not 'SWITCH.SWITCH:NODELIST'"),
        ("spine.leaf1:", "is not 'SWITCH.SWITCH:NODELIST'"),
        ("spine..leaf1:n1", "is not 'SWITCH.SWITCH:NODELIST'"),
        ("leaf1:n[1-", "is not a node list"),
        ("leaf1:n1;leaf2:n1", "puts node n1 under both leaf1 and leaf2"),
    ],
)
def test_exported_switches_refused(text, message):
    with pytest.raises(SlurmEnvError, match=message):
        parse_node_switches(text)


def test_switch_names_that_cannot_travel_are_refused():
    with pytest.raises(SlurmEnvError, match="rename it in topology.conf"):
        format_node_switches({"n1": ("sp:ine", "leaf")}, ["n1"])


# ------------------------------------------------------------------------------ the order


def _places(spec: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """{"n1": "spine.leaf1", ...} -> node -> switches."""
    return {node: tuple(path.split(".")) for node, path in spec.items()}


ORDERS = {
    "one leaf: node-list order": {
        "places": {"n1": "s.a", "n2": "s.a", "n3": "s.a"},
        "group_nodes": 1,
        "order": ["n1", "n2", "n3"],
    },
    "dev cluster (interleaved leaves), shard groups within a node": {
        "places": {"n1": "spine.leaf1", "n2": "spine.leaf2", "n3": "spine.leaf1"},
        "group_nodes": 1,
        "order": ["n1", "n3", "n2"],
    },
    "interleaved, 2-node shard groups: each under one leaf": {
        "places": {"n1": "s.a", "n2": "s.b", "n3": "s.a", "n4": "s.b"},
        "group_nodes": 2,
        "order": ["n1", "n3", "n2", "n4"],
    },
    "3 + 1 nodes, 2-node groups: one group must cross": {
        "places": {"n1": "s.a", "n2": "s.a", "n3": "s.b", "n4": "s.a"},
        "group_nodes": 2,
        "order": ["n1", "n2", "n4", "n3"],
    },
    "first leaf smaller than a group: its node stays first, leftovers lead": {
        "places": {"n1": "s.a", "n2": "s.b", "n3": "s.b", "n4": "s.b", "n5": "s.c", "n6": "s.b"},
        "group_nodes": 2,
        "order": ["n1", "n5", "n2", "n3", "n4", "n6"],
    },
    "5 + 5 + 6 nodes, 4-node groups: whole groups first, one mixed group last": {
        "places": {**{f"a{i}": "s.a" for i in range(5)}, **{f"b{i}": "s.b" for i in range(5)}}
        | {f"c{i}": "s.c" for i in range(6)},
        "group_nodes": 4,
        "order": [*(f"a{i}" for i in range(4)), *(f"b{i}" for i in range(4)), *(f"c{i}" for i in range(4))]
        + ["a4", "b4", "c4", "c5"],
    },
    "two levels: leaves grouped under their spine, spines where first seen": {
        "places": {"n1": "s1.a", "n2": "s2.c", "n3": "s1.b", "n4": "s1.a"},
        "group_nodes": 1,
        "order": ["n1", "n4", "n3", "n2"],
    },
    "a node of unknown switch: node-list order": {
        "places": {"n1": "s.a", "n3": "s.a"},
        "nodes": ["n1", "n2", "n3"],
        "group_nodes": 1,
        "order": ["n1", "n2", "n3"],
    },
}


@pytest.mark.parametrize("case", ORDERS.values(), ids=list(ORDERS))
def test_switch_order(case):
    places = _places(case["places"])
    nodes = case.get("nodes", list(case["places"]))
    assert list(switch_order(nodes, places, case["group_nodes"])) == case["order"]


def _crossing_groups(order, places, group_nodes):
    return sum(len({places[n][-1] for n in order[i : i + group_nodes]}) > 1 for i in range(0, len(order), group_nodes))


@pytest.mark.parametrize("seed", range(200))
def test_switch_order_leaves_the_fewest_crossings_the_allocation_allows(seed):
    """Random allocations: the order is a permutation with the first node first, keeps the
    node-list order within each leaf, and leaves exactly as many shard groups crossing leaves
    as must: every group that cannot be made of one leaf's nodes."""
    rng = random.Random(seed)
    group_nodes = rng.choice([1, 2, 3, 4])
    nodes = [f"x{i:03d}" for i in range(group_nodes * rng.randint(1, 8))]
    leaves = [f"spine{rng.randint(1, 2)}.leaf{k}" for k in range(rng.randint(1, 5))]
    places = {node: tuple(rng.choice(leaves).split(".")) for node in nodes}
    rng.shuffle(nodes)
    order = switch_order(nodes, places, group_nodes)
    assert sorted(order) == sorted(nodes) and order[0] == nodes[0]
    for leaf in {p for p in places.values()}:
        assert [n for n in order if places[n] == leaf] == [n for n in nodes if places[n] == leaf]
    per_leaf = [sum(1 for p in places.values() if p == leaf) for leaf in set(places.values())]
    must_cross = len(nodes) // group_nodes - sum(n // group_nodes for n in per_leaf)
    assert _crossing_groups(order, places, group_nodes) == must_cross


# ------------------------------------------------------------------------------ plans on switches

INTERLEAVED = _places({"n1": "spine.leaf1", "n2": "spine.leaf2", "n3": "spine.leaf1", "n4": "spine.leaf2"})


def test_no_switches_is_the_plain_plan():
    plain = TopologyPlan(tasks_per_node=(8,) * 4, shard_size=16)
    assert plan_on_switches(tasks_per_node=(8,) * 4, shard_size=16, node_names=("n1", "n2", "n3", "n4"), places={}) == (
        plain
    )
    off = plan_on_switches(
        tasks_per_node=(8,) * 4, shard_size=16, node_names=("n1", "n2", "n3", "n4"), places=INTERLEAVED, topology="off"
    )
    assert off == plain


@pytest.mark.parametrize(("shard", "tp"), [(16, 1), (8, 2), (4, 4)])
def test_shard_groups_spanning_nodes_sit_under_one_leaf(shard, tp):
    names = ("n1", "n2", "n3", "n4")
    plain = TopologyPlan(tasks_per_node=(8,) * 4, shard_size=shard, tp_size=tp, node_names=names)
    placed = plan_on_switches(
        tasks_per_node=(8,) * 4, shard_size=shard, tp_size=tp, node_names=names, places=INTERLEAVED
    )
    assert placed.node_names == ("n1", "n3", "n2", "n4")
    assert placed.node_switches == ("leaf1", "leaf1", "leaf2", "leaf2")
    assert placed.shard_groups_cross_nodes and placed.copies_across_switches == ()
    # the replicate groups cross the switches instead; the groups' ranks are the plain plan's
    assert all(
        {placed.node_switches[placed.node_of_rank[r]] for r in g} == {"leaf1", "leaf2"} for g in placed.replicate_groups
    )
    assert placed.shard_groups == plain.shard_groups and placed.tp_groups == plain.tp_groups
    data = placed.to_dict()
    assert (
        data["node_switches"] == ["leaf1", "leaf1", "leaf2", "leaf2"] and data["shard_groups_cross_switches"] is False
    )
    placed.check_under_one_switch()  # strict accepts it


def test_strict_refuses_groups_that_must_cross_and_names_the_fix():
    places = _places({"n1": "s.leaf1", "n2": "s.leaf1", "n3": "s.leaf2", "n4": "s.leaf1"})
    auto = plan_on_switches(tasks_per_node=(8,) * 4, shard_size=16, node_names=("n1", "n2", "n3", "n4"), places=places)
    assert auto.node_names == ("n1", "n2", "n4", "n3") and auto.copies_across_switches == (1,)
    with pytest.raises(TopologyError) as refused:
        plan_on_switches(
            tasks_per_node=(8,) * 4,
            shard_size=16,
            node_names=("n1", "n2", "n3", "n4"),
            places=places,
            topology="strict",
        )
    assert str(refused.value) == (
        "--topology strict: shard group 1 (ranks 16-31 on n4,n3 under leaf1,leaf2) must cross leaf switches: "
        "the job's nodes are 3 under leaf1, 1 under leaf2, not whole multiples of the 2 nodes a shard group spans; "
        "ask for nodes under one switch (--switches 1), or use --shard 8, or --topology auto"
    )


def test_strict_suggests_the_largest_shard_the_switches_hold():
    places = _places({f"n{i}": ("s.a" if i <= 4 else "s.b") for i in range(1, 7)} | {"n7": "s.c", "n8": "s.c"})
    with pytest.raises(TopologyError, match=r"--shard 16, or --topology auto"):
        plan_on_switches(
            tasks_per_node=(8,) * 8, shard_size=32, node_names=tuple(places), places=places, topology="strict"
        )


def test_strict_without_switches_refuses_only_groups_spanning_nodes():
    names = ("n1", "n2")
    with pytest.raises(TopologyError, match=r"SLURM gave no leaf switch for n1, n2 .*--shard 8\)"):
        plan_on_switches(tasks_per_node=(8, 8), shard_size=16, node_names=names, places={}, topology="strict")
    within = plan_on_switches(tasks_per_node=(8, 8), shard_size=8, node_names=names, places={}, topology="strict")
    assert within == TopologyPlan(tasks_per_node=(8, 8), shard_size=8, node_names=names)


def test_unknown_topology_mode_is_refused():
    with pytest.raises(TopologyError, match="--topology 'tree' is not one of auto, off, strict"):
        plan_on_switches(tasks_per_node=(8,), shard_size=1, node_names=("n1",), places={}, topology="tree")


# ------------------------------------------------------------------------------ every task derives the same order


def _envs(tasks, names, switches, **kwargs):
    envs = task_environments(tasks_per_node=tasks, node_names=names, job_id="31", **kwargs)
    for env in envs:
        env[NODE_SWITCHES_ENV] = switches
    return envs


@pytest.mark.parametrize("distribution", ["block", "cyclic"])
def test_every_task_derives_the_same_switch_order(distribution):
    envs = _envs((8,) * 4, ["n1", "n2", "n3", "n4"], "spine.leaf1:n[1,3];spine.leaf2:n[2,4]", distribution=distribution)
    layouts = [RankLayout.from_env(env, shard_size=16) for env in envs]
    plans = {lay.plan for lay in layouts}
    assert len(plans) == 1
    (plan,) = plans
    assert plan.node_names == ("n1", "n3", "n2", "n4")
    assert sorted(lay.rank for lay in layouts) == list(range(32))
    for lay in layouts:
        assert plan.node_names[plan.node_of_rank[lay.rank]] == lay.node
        assert lay.node_switch == ("leaf1" if lay.node in ("n1", "n3") else "leaf2")
    rank0 = next(lay for lay in layouts if lay.rank == 0)
    assert rank0.node == "n1" == rank0.master_addr  # the first node keeps rank 0 and the rendezvous
    by_rank = {lay.rank: lay for lay in layouts}
    assert {by_rank[r].node for r in range(16)} == {"n1", "n3"}
    data = by_rank[9].to_dict()
    assert (data["node_switch"], data["node_switches"], data["shard_groups_cross_switches"]) == (
        "leaf1",
        ["leaf1", "leaf1", "leaf2", "leaf2"],
        False,
    )


def test_node_id_fallback_follows_the_switch_order():
    env = _envs((8,) * 4, ["n1", "n2", "n3", "n4"], "s.a:n[1,3];s.b:n[2,4]")[8]  # SLURM's node 1: n2
    del env["SLURMD_NODENAME"]
    lay = RankLayout.from_env(env, shard_size=16)
    assert (lay.node, lay.node_rank, lay.rank) == ("n2", 2, 16)


def test_without_the_variable_or_with_off_the_order_is_the_node_list():
    env = task_environments(tasks_per_node=(8,) * 4, node_names=["n1", "n2", "n3", "n4"], job_id="31")[8]
    today = RankLayout.from_env(env, shard_size=16)
    assert today.plan == TopologyPlan(tasks_per_node=(8,) * 4, shard_size=16, node_names=("n1", "n2", "n3", "n4"))
    assert "node_switch" not in today.to_dict()
    off = RankLayout.from_env({**env, NODE_SWITCHES_ENV: "s.a:n[1,3];s.b:n[2,4]"}, shard_size=16, topology="off")
    assert off == today


def test_strict_task_refuses_with_the_same_message_everywhere():
    envs = _envs((8,) * 4, ["n1", "n2", "n3", "n4"], "s.a:n[1-2,4];s.b:n3")
    messages = set()
    for env in envs:
        with pytest.raises(TopologyError) as refused:
            RankLayout.from_env(env, shard_size=16, topology="strict")
        messages.add(str(refused.value))
    assert len(messages) == 1 and "--switches 1" in messages.pop()


def test_uneven_nodes_keep_their_task_counts_when_reordered():
    envs = _envs((8, 4, 8), ["n1", "n2", "n3"], "s.a:n[1,3];s.b:n2")
    layouts = [RankLayout.from_env(env, shard_size=4) for env in envs]
    plan = layouts[0].plan
    assert plan.node_names == ("n1", "n3", "n2") and plan.tasks_per_node == (8, 8, 4)
    assert sorted(lay.rank for lay in layouts) == list(range(20))
    assert {lay.rank for lay in layouts if lay.node == "n2"} == set(range(16, 20))


def test_torchrun_workers_follow_the_launchers_order():
    """The launcher task (one per node) passes its node rank to torchrun as --node-rank; the
    workers then find their rank in the same switch order."""
    envs = _envs((1,) * 4, ["n1", "n2", "n3", "n4"], "s.a:n[1,3];s.b:n[2,4]")
    launchers = [RankLayout.from_env(env, shard_size=16, nproc_per_node=8) for env in envs]
    assert [(lay.node, lay.node_rank, lay.rank) for lay in launchers] == [
        ("n1", 0, 0),
        ("n2", 2, 16),
        ("n3", 1, 8),
        ("n4", 3, 24),
    ]
    worker = {
        "TORCHELASTIC_RUN_ID": "x",
        "GROUP_RANK": "2",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "8",
        "WORLD_SIZE": "32",
        "RANK": "19",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
        "SLURM_JOB_NODELIST": "n[1-4]",
        NODE_SWITCHES_ENV: "s.a:n[1,3];s.b:n[2,4]",
    }
    lay = RankLayout.from_env(worker, shard_size=16)
    assert (lay.rank, lay.node, lay.node_switch) == (19, "n2", "b")


def test_the_captured_dev_cluster_step_in_switch_order():
    """The real 3-node step, with the variable the batch shell would export from scontrol: n3
    (leaf1, like n1) takes ranks 2-3, n2 (leaf2) ranks 4-5."""
    exported = format_node_switches(
        switches_of_nodes(parse_scontrol_topology(SCONTROL), ["n1", "n2", "n3"]), ["n1", "n2", "n3"]
    )
    layouts = [RankLayout.from_env({**captured_task(p), NODE_SWITCHES_ENV: exported}, shard_size=2) for p in range(6)]
    assert [(lay.node, lay.rank, lay.node_switch) for lay in layouts] == [
        ("n1", 0, "leaf1"),
        ("n1", 1, "leaf1"),
        ("n2", 4, "leaf2"),
        ("n2", 5, "leaf2"),
        ("n3", 2, "leaf1"),
        ("n3", 3, "leaf1"),
    ]
    assert [lay.device for lay in layouts] == ["cuda:0", "cuda:1"] * 3


def test_a_node_outside_the_topology_keeps_the_order_and_strict_names_it():
    places = _places({"n1": "s.a", "n2": "s.b", "n4": "s.a"})
    names = ("n1", "n2", "n3", "n4")
    auto = plan_on_switches(tasks_per_node=(8,) * 4, shard_size=16, node_names=names, places=places)
    assert auto.node_names == names and auto.node_switches == ("a", "b", "", "a")
    assert auto.shard_groups_cross_switches is None and auto.to_dict()["shard_groups_cross_switches"] is None
    with pytest.raises(TopologyError, match=r"no leaf switch for n3 \(no topology plugin"):
        plan_on_switches(tasks_per_node=(8,) * 4, shard_size=16, node_names=names, places=places, topology="strict")


def test_strict_names_every_crossing_group_up_to_three():
    leaves = "abcde"
    places = {f"n{i + 1}": ("s", leaves[i % 5]) for i in range(10)}  # 2 nodes under each leaf
    with pytest.raises(TopologyError) as refused:
        plan_on_switches(
            tasks_per_node=(8,) * 10, shard_size=40, node_names=tuple(places), places=places, topology="strict"
        )
    assert str(refused.value).startswith(
        "--topology strict: shard groups 0 (ranks 0-39 on n1,n6,n2,n7,n3 under a,b,c); "
        "1 (ranks 40-79 on n8,n4,n9,n5,n10 under c,d,e) must cross leaf switches: "
        "the job's nodes are 2 under a, 2 under b, 2 under c, 2 under d, 2 under e, not whole multiples of the 5 "
        "nodes a shard group spans; ask for nodes under one switch (--switches 1), or use --shard 16"
    )


# ------------------------------------------------------------------------------ sbatch's options


@pytest.mark.parametrize("value", ["1", "2@10:00", "1@1-12", "4@30", "1@0"])
def test_switches_option_accepted(value):
    assert check_switches(value) == value


@pytest.mark.parametrize("value", ["", "0", "-1", "x", "1@", "1@soon", "@10", "1@10:00\n#SBATCH -A x", "\u0663"])
def test_switches_option_refused(value):
    with pytest.raises(SpecError, match="--switches"):
        check_switches(value)


@pytest.mark.parametrize(("value", "ok"), [(2, True), (1, True), (0, False), (True, False), ("2", False)])
def test_segment_option(value, ok):
    if ok:
        assert check_segment(value) == value
    else:
        with pytest.raises(SpecError, match="--segment"):
            check_segment(value)
