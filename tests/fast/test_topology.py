"""The topology core: node lists, tasks-per-node strings, plans and per-task layouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_hsdp.errors import SlurmEnvError, TopologyError
from hpc_hsdp.plan.slurm_env import task_environments
from hpc_hsdp.plan.topology import (
    RankLayout,
    TopologyPlan,
    expand_nodelist,
    format_tasks_per_node,
    parse_tasks_per_node,
    plan_for,
    rendezvous_port,
    select_device,
)

# ------------------------------------------------------------------------------ parsers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("n[1-2]", ("n1", "n2")),
        ("gpu-a[01-04,07],login2", ("gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04", "gpu-a07", "login2")),
        ("dgx-b0[7-8]", ("dgx-b07", "dgx-b08")),
        ("node[009-011]", ("node009", "node010", "node011")),
        ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
        ("a[1-2],b[3-4]", ("a1", "a2", "b3", "b4")),
        ("single", ("single",)),
        ("n2,n1", ("n2", "n1")),
    ],
)
def test_expand_nodelist(text, expected):
    assert expand_nodelist(text) == expected


@pytest.mark.parametrize("text", ["", "n[1-", "n[2-1]", "n[a-b]", "n]1[", "n[1-2", "n[,]"])
def test_expand_nodelist_rejects_malformed(text):
    with pytest.raises(TopologyError, match="node list"):
        expand_nodelist(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8(x2)", (8, 8)),
        ("8(x2),4", (8, 8, 4)),
        ("4,8", (4, 8)),
        ("1(x3)", (1, 1, 1)),
        ("2,3(x2),1", (2, 3, 3, 1)),
        ("16", (16,)),
    ],
)
def test_parse_tasks_per_node(text, expected):
    assert parse_tasks_per_node(text) == expected
    assert parse_tasks_per_node(format_tasks_per_node(expected)) == expected


@pytest.mark.parametrize("text", ["", "0", "8(x0)", "8(x)", "x2", "8(2)", "8,,4", "-1", "8 (x2)x", "4.0"])
def test_parse_tasks_per_node_rejects_malformed(text):
    with pytest.raises(TopologyError, match="tasks-per-node"):
        parse_tasks_per_node(text)


# ------------------------------------------------------------------------------ plans

THREAD_SHARD = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
THREAD_REPLICATE = [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_public_thread_case():
    plan = plan_for(nodes=2, gpus_per_node=8, shard_size=4)
    data = plan.to_dict()
    assert data["world_size"] == 16 and data["num_replicas"] == 4 and data["shard_size"] == 4
    assert data["shard_groups"] == THREAD_SHARD
    assert data["replicate_groups"] == THREAD_REPLICATE
    assert data["node_of_rank"] == [0] * 8 + [1] * 8
    assert data["shard_groups_cross_nodes"] is False
    assert data["gpus_per_node"] == 8 and data["nodes"] == 2


@pytest.mark.parametrize(
    ("tasks", "shard", "replicas", "shard_groups", "cross"),
    [
        ((8, 8, 8, 8), 16, 2, [list(range(16)), list(range(16, 32))], True),
        ((8, 4), 4, 3, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], False),
        ((4, 8), 2, 6, [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]], False),
        ((4, 4), 1, 8, [[r] for r in range(8)], False),
        ((4, 4), 8, 1, [list(range(8))], True),
        ((8,), 8, 1, [list(range(8))], False),
        ((1, 1, 1), 3, 1, [[0, 1, 2]], True),
        ((2, 2, 2, 2), 4, 2, [[0, 1, 2, 3], [4, 5, 6, 7]], True),
    ],
)
def test_plans(tasks, shard, replicas, shard_groups, cross):
    plan = TopologyPlan(tasks_per_node=tasks, shard_size=shard)
    assert plan.num_replicas == replicas
    assert [list(g) for g in plan.shard_groups] == shard_groups
    assert plan.shard_groups_cross_nodes is cross
    # replicate groups are strided by S and together with shard groups tile the world
    for offset, group in enumerate(plan.replicate_groups):
        assert list(group) == list(range(offset, plan.world_size, shard))
    assert sorted(r for g in plan.shard_groups for r in g) == list(range(plan.world_size))


def test_cross_node_shard_spans_whole_nodes():
    plan = plan_for(nodes=4, gpus_per_node=8, shard_size=16)
    assert [plan.nodes_of_group(g) for g in plan.shard_groups] == [(0, 1), (2, 3)]
    assert [plan.nodes_of_group(g) for g in plan.replicate_groups][:2] == [(0, 2), (0, 2)]


def test_kinds():
    assert plan_for(nodes=2, gpus_per_node=8, shard_size=1).kind.startswith("replicate")
    assert plan_for(nodes=2, gpus_per_node=8, shard_size=16).kind.startswith("full shard")
    assert plan_for(nodes=2, gpus_per_node=8, shard_size=4).kind.startswith("hybrid")


@pytest.mark.parametrize(
    ("tasks", "shard", "message"),
    [
        ((8, 8), 0, "shard size 0 is invalid"),
        ((8, 8), -2, "shard size -2 is invalid"),
        ((8, 8), 3, "does not divide the 8 tasks"),
        ((8, 8), 12, "not a multiple of it"),
        ((8, 8, 8), 16, "spans 2 nodes but the job has 3 nodes"),
        ((8, 4), 8, "larger than the smallest node"),
        ((4, 6), 4, "does not divide the 6 tasks"),
        ((), 1, "no nodes"),
        ((8, 0), 1, "below 1"),
    ],
)
def test_rejected_plans(tasks, shard, message):
    with pytest.raises(TopologyError, match=message):
        TopologyPlan(tasks_per_node=tasks, shard_size=shard)


@pytest.mark.parametrize(("nodes", "gpus"), [(0, 8), (2, 0), (-1, 8)])
def test_rejected_counts(nodes, gpus):
    with pytest.raises(TopologyError, match="at least 1"):
        plan_for(nodes=nodes, gpus_per_node=gpus, shard_size=1)


# ------------------------------------------------------------------------------ layouts from SLURM's env


def _layouts(envs, shard):
    return [RankLayout.from_env(env, shard_size=shard) for env in envs]


@pytest.mark.parametrize("distribution", ["block", "cyclic"])
@pytest.mark.parametrize(
    ("tasks", "shard"), [((8, 8), 4), ((4, 4), 2), ((8, 8, 8, 8), 16), ((8, 4), 4), ((8, 8), 1), ((2, 2), 4)]
)
def test_layout_agrees_with_plan_for_every_rank(tasks, shard, distribution):
    names = [f"gpu-a{i + 1:02d}" for i in range(len(tasks))]
    envs = task_environments(tasks_per_node=tasks, node_names=names, job_id="4242", distribution=distribution)
    plan = TopologyPlan(tasks_per_node=tasks, shard_size=shard, node_names=tuple(names))
    layouts = _layouts(envs, shard)
    assert sorted(lay.rank for lay in layouts) == list(range(plan.world_size))
    for env, lay in zip(envs, layouts):
        assert lay.plan == plan
        assert lay.node == env["SLURMD_NODENAME"]
        assert plan.node_of_rank[lay.rank] == lay.node_rank
        assert lay.local_rank == int(env["SLURM_LOCALID"])
        assert lay.shard_group == plan.shard_group_of(lay.rank)
        assert lay.replicate_group == plan.replicate_group_of(lay.rank)
        assert lay.master_addr == "gpu-a01" and lay.master_port == 20000 + 4242
        assert lay.slurm_procid == int(env["SLURM_PROCID"])
        assert lay.launch_mode == "task-per-gpu"
        assert lay.device == "cpu"
    differs = any(lay.procid_differs for lay in layouts)
    assert differs is (distribution == "cyclic" and len(tasks) > 1)


def test_cyclic_thread_case_keeps_shard_groups_on_one_node():
    envs = task_environments(tasks_per_node=(8, 8), node_names=["n1", "n2"], job_id="7", distribution="cyclic")
    layouts = _layouts(envs, 4)
    # SLURM says PROCID 1 is on n2; the node-major rank says 8
    procid_1 = next(lay for lay in layouts if lay.slurm_procid == 1)
    assert procid_1.node == "n2" and procid_1.rank == 8 and procid_1.shard_group == (8, 9, 10, 11)
    by_rank = {lay.rank: lay for lay in layouts}
    for group in THREAD_SHARD:
        assert len({by_rank[r].node for r in group}) == 1


def test_layout_json_fields():
    env = task_environments(tasks_per_node=(8, 8), node_names=["n1", "n2"], job_id="1", gpus_per_node=8)[9]
    data = RankLayout.from_env(env, shard_size=4).to_dict()
    for key in (
        "rank",
        "local_rank",
        "node_rank",
        "local_world_size",
        "world_size",
        "node",
        "nodes",
        "shard_size",
        "num_replicas",
        "shard_group",
        "replicate_group",
        "master_addr",
        "master_port",
        "device",
        "slurm_procid",
    ):
        assert key in data
    assert (data["rank"], data["local_rank"], data["node"], data["device"]) == (9, 1, "n2", "cuda:1")
    assert data["shard_group"] == [8, 9, 10, 11] and data["replicate_group"] == [1, 5, 9, 13]


@pytest.mark.parametrize(
    ("visible", "gpus_on_node", "local", "expected"),
    [
        (None, None, 3, "cpu"),
        ("", None, 0, "cpu"),
        ("NoDevFiles", None, 0, "cpu"),
        ("0,1,2,3,4,5,6,7", "8", 5, "cuda:5"),
        ("3", "8", 3, "cuda:0"),  # --gpu-bind=single:1
        ("0,1,2,3,4,5,6,7", None, 7, "cuda:7"),
    ],
)
def test_select_device(visible, gpus_on_node, local, expected):
    env = {}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    if gpus_on_node is not None:
        env["SLURM_GPUS_ON_NODE"] = gpus_on_node
    assert select_device(env, local_rank=local, local_world_size=8) == expected


def test_select_device_rejects_local_rank_beyond_gpus():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "SLURM_GPUS_ON_NODE": "4"}
    with pytest.raises(SlurmEnvError, match="SLURM_LOCALID=5 but only 4 GPUs"):
        select_device(env, local_rank=5, local_world_size=8)


CAPTURED = Path(__file__).resolve().parents[1] / "data" / "slurm-env"
"""Task environments captured on the dev cluster (Slurm 22.05, `env` in an srun task)."""


def captured(name: str) -> dict[str, str]:
    lines = (CAPTURED / f"{name}.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_torchrun_launcher_task_is_said_by_the_launcher_not_guessed():
    """`srun --ntasks-per-node=1 --gpus-per-node=8` on two nodes: one task per node sees 8
    GPUs. Only the torchrun launcher (which passes --nproc-per-node) is the launcher task."""
    envs = [captured("pernode.0"), captured("pernode.1")]
    launchers = [RankLayout.from_env(env, shard_size=4, nproc_per_node=8) for env in envs]
    assert [lay.launch_mode for lay in launchers] == ["task-per-node", "task-per-node"]
    assert [lay.node_rank for lay in launchers] == [0, 1]
    assert [lay.rank for lay in launchers] == [0, 8]
    assert launchers[1].plan.to_dict()["shard_groups"] == THREAD_SHARD


def test_one_task_per_node_srun_job_is_one_rank_per_node():
    """The same step running `hpc-hsdp run` itself: world 2, one rank per node on its cuda:0,
    not a torchrun launcher with 16 workers that never start."""
    layouts = [RankLayout.from_env(captured(f"pernode.{i}"), shard_size=1) for i in (0, 1)]
    assert [lay.launch_mode for lay in layouts] == ["task-per-gpu", "task-per-gpu"]
    assert [(lay.rank, lay.world_size, lay.device) for lay in layouts] == [(0, 2, "cuda:0"), (1, 2, "cuda:0")]


def test_nproc_per_node_needs_one_task_per_node():
    with pytest.raises(SlurmEnvError, match="one task per node"):
        RankLayout.from_env(captured("mask.0"), shard_size=1, nproc_per_node=4)


def test_gpus_per_task_maps_each_task_to_its_own_gpu():
    """`srun -n2 --gpus-per-task=2` (node of 4 GPUs): each task sees its own pair."""
    layouts = [RankLayout.from_env(captured(f"gpt2.{i}"), shard_size=2) for i in (0, 1)]
    assert [(lay.device, captured(f"gpt2.{lay.rank}")["CUDA_VISIBLE_DEVICES"]) for lay in layouts] == [
        ("cuda:0", "0,1"),
        ("cuda:0", "2,3"),
    ]


@pytest.mark.parametrize("name", ["mask.0", "mask.2"])
def test_gpus_shared_by_several_tasks_are_refused_with_the_fix(name):
    """`--gpu-bind=mask_gpu:0x3,0x3,0xc,0xc` (like --gpu-bind=closest on a two-socket node):
    tasks 0 and 1 both see GPUs 0,1. Taking cuda:0 would put two ranks on one GPU."""
    with pytest.raises(SlurmEnvError, match=r"sees 2 of its node's 4 GPUs .*drop --gpu-bind"):
        RankLayout.from_env(captured(name), shard_size=2)


def test_one_task_per_node_without_gpus_is_one_rank_per_node():
    envs = task_environments(tasks_per_node=(1, 1), node_names=["n1", "n2"], job_id="9")
    assert [lay.launch_mode for lay in _layouts(envs, 1)] == ["task-per-gpu"] * 2


def test_torchrun_worker_layout():
    env = {
        "TORCHELASTIC_RUN_ID": "x",
        "GROUP_RANK": "1",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "8",
        "WORLD_SIZE": "16",
        "RANK": "10",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_PROCID": "1",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    }
    lay = RankLayout.from_env(env, shard_size=4)
    assert (lay.rank, lay.node, lay.launch_mode, lay.device) == (10, "n2", "torchrun", "cuda:2")
    assert lay.shard_group == (8, 9, 10, 11) and lay.master_port == 29500


def test_torchrun_with_non_node_major_rank_is_refused():
    env = {
        "TORCHELASTIC_RUN_ID": "x",
        "GROUP_RANK": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "8",
        "WORLD_SIZE": "16",
        "RANK": "3",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
    }
    with pytest.raises(SlurmEnvError, match="static rendezvous"):
        RankLayout.from_env(env, shard_size=4)


TORCHRUN_WORKER = {
    "TORCHELASTIC_RUN_ID": "x",
    "GROUP_RANK": "0",
    "LOCAL_RANK": "0",
    "LOCAL_WORLD_SIZE": "8",
    "WORLD_SIZE": "16",
    "RANK": "0",
    "MASTER_ADDR": "n1",
    "MASTER_PORT": "29500",
}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"GROUP_RANK": "2", "RANK": "16"}, "GROUP_RANK=2 but WORLD_SIZE=16 / LOCAL_WORLD_SIZE=8 gives 2 nodes"),
        ({"LOCAL_RANK": "8", "RANK": "8"}, "LOCAL_RANK=8 but LOCAL_WORLD_SIZE=8"),  # would pass as node 1's rank 8
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is not a positive multiple of LOCAL_WORLD_SIZE=8"),
        ({"WORLD_SIZE": "12"}, "WORLD_SIZE=12 is not a positive multiple"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE=0"),
        ({"MASTER_PORT": "\u0663\u0663"}, "is not a port number"),  # Arabic-Indic digits: str.isdigit() says yes
    ],
)
def test_torchrun_layout_rejects_inconsistent_env(overrides, message):
    with pytest.raises(SlurmEnvError, match=message):
        RankLayout.from_env({**TORCHRUN_WORKER, **overrides}, shard_size=4)


@pytest.mark.parametrize(("procid", "expected"), [("3", 3), (" 3 ", 3), ("", None), ("x", None), ("\u0663", None)])
def test_slurm_procid_is_recorded_in_both_launch_modes(procid, expected):
    slurm = RankLayout.from_env(_env(SLURM_PROCID=procid), shard_size=4)
    torchrun = RankLayout.from_env({**TORCHRUN_WORKER, "SLURM_PROCID": procid}, shard_size=4)
    assert slurm.slurm_procid == torchrun.slurm_procid == expected


def test_rendezvous_port_is_stable_and_outside_ephemeral_range():
    ports = {rendezvous_port({"SLURM_JOB_ID": str(job)}) for job in range(0, 100000, 7)}
    assert all(20000 <= p < 30000 for p in ports)
    assert rendezvous_port({"SLURM_JOB_ID": "123_4"}) == rendezvous_port({"SLURM_JOB_ID": "123_4"})
    assert rendezvous_port({"SLURM_JOB_ID": "5", "MASTER_PORT": "29400"}) == 29400


def _env(**overrides):
    env = task_environments(tasks_per_node=(8, 8), node_names=["n1", "n2"], job_id="5")[3]
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"SLURM_JOB_ID": None, "SLURM_PROCID": None}, "no SLURM environment"),
        ({"SLURM_STEP_NUM_TASKS": "12"}, "SLURM_STEP_NUM_TASKS=12 but tasks per node"),
        ({"SLURM_LOCALID": "8"}, "SLURM_LOCALID=8 but node n1 runs only 8 tasks"),
        ({"SLURM_LOCALID": None}, "SLURM_LOCALID is not set"),
        ({"SLURM_LOCALID": "x"}, "not an integer"),
        ({"SLURMD_NODENAME": "n9"}, "not in the node list"),
        ({"SLURM_STEP_TASKS_PER_NODE": "8(x3)"}, "lists 3 nodes but the node list"),
        ({"SLURM_STEP_NODELIST": "n[1-"}, "malformed node list"),
        ({"SLURM_STEP_TASKS_PER_NODE": "8(x"}, "malformed tasks-per-node"),
        ({"MASTER_PORT": "http"}, "MASTER_PORT='http' is not a port"),
    ],
)
def test_layout_rejects_inconsistent_env(overrides, message):
    with pytest.raises((SlurmEnvError, TopologyError), match=message):
        RankLayout.from_env(_env(**overrides), shard_size=4)


def test_node_falls_back_to_nodeid():
    lay = RankLayout.from_env(_env(SLURMD_NODENAME=None, SLURM_NODEID="1"), shard_size=4)
    assert lay.node == "n2" and lay.rank == 11


def test_layout_rejects_shard_not_fitting_uneven_allocation():
    env = task_environments(tasks_per_node=(8, 4), node_names=["n1", "n2"], job_id="5")[0]
    assert RankLayout.from_env(env, shard_size=4).num_replicas == 3
    with pytest.raises(TopologyError, match="larger than the smallest node"):
        RankLayout.from_env(env, shard_size=8)
