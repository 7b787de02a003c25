"""`hpc-hsdp plan` and `hpc-hsdp layout` as a person runs them: real subprocesses."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import pytest
from cli_helpers import assert_cli_imports_no_torch, hpc

from hpc_hsdp.plan.slurm_env import task_environments


def test_plan_json_is_the_public_thread_shape():
    out = hpc("plan", "--nodes", "2", "--gpus-per-node", "8", "--shard", "4", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    expected = {
        "nodes": 2,
        "gpus_per_node": 8,
        "world_size": 16,
        "shard_size": 4,
        "num_replicas": 4,
        "shard_groups": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
        "replicate_groups": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
        "node_of_rank": [0] * 8 + [1] * 8,
        "shard_groups_cross_nodes": False,
    }
    assert {k: data[k] for k in expected} == expected


def test_plan_table_names_nodes_and_traffic():
    out = hpc("plan", "--nodelist", "gpu-a[01-02]", "--gpus-per-node", "8", "--shard", "4")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["node", "gpu", "rank", "shard", "group", "replicate", "group"]
    row_rank_9 = next(line for line in lines if line.split()[:3] == ["gpu-a02", "1", "9"])
    assert "[8-11]" in row_rank_9 and "[1,5,9,13]" in row_rank_9
    assert "shard groups stay inside one node" in out.stdout


def test_plan_cross_node_and_uneven():
    cross = hpc("plan", "--nodes", "4", "--shard", "16")
    assert cross.returncode == 0 and "span 2 whole nodes" in cross.stdout
    uneven = json.loads(hpc("plan", "--tasks-per-node", "8,4", "--shard", "4", "--json").stdout)
    assert uneven["num_replicas"] == 3 and uneven["node_of_rank"] == [0] * 8 + [1] * 4


def test_plan_estimates_and_fit():
    out = hpc("plan", "--nodes", "2", "--shard", "4", "--model-params", "1B", "--gpu-memory", "16GiB", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    per_gpu = data["estimate"]["per_gpu_bytes"]
    assert per_gpu["total"] == 16 * 10**9 // 4  # fp32 AdamW: 16 bytes per parameter, over S=4
    kinds = {(t["kind"], t["inter_node"]) for t in data["estimate"]["per_step_per_gpu"]}
    assert kinds == {("all_gather", False), ("reduce_scatter", False), ("all_reduce", True)}
    # states need 16e9/S bytes; 80% of 16 GiB is 13.7e9: S=1 does not fit, S=2 (8e9) does
    assert data["smallest_fitting_shard"] == 2


def test_plan_svg(tmp_path):
    path = tmp_path / "layout.svg"
    out = hpc("plan", "--nodes", "2", "--shard", "4", "--svg", str(path))
    assert out.returncode == 0, out.stderr
    root = ET.fromstring(path.read_text())
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert sum(1 for t in texts if t and t.startswith("rank ")) == 16
    assert "S2 R1" in texts  # rank 9: shard group 2, replicate group 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "2", "--shard", "0"], "shard size 0 is invalid"),
        (["--nodes", "2", "--shard", "-4"], "shard size -4 is invalid"),
        (["--nodes", "2", "--shard", "3"], "does not divide the 8 tasks"),
        (["--nodes", "2", "--shard", "12"], "not a multiple of it"),
        (["--tasks-per-node", "8,4", "--shard", "8"], "larger than the smallest node"),
        (["--nodes", "0", "--shard", "1"], "--nodes 0 is invalid"),
        (["--nodes", "2", "--gpus-per-node", "0", "--shard", "1"], "--gpus-per-node 0 is invalid"),
        (["--nodelist", "n[1-", "--shard", "1"], "malformed node list"),
        (["--tasks-per-node", "8(x", "--shard", "1"], "malformed tasks-per-node"),
        (["--nodes", "2"], "Missing option '--shard'"),
        (["--nodes", "two", "--shard", "1"], "--nodes 'two' is not a node count; write N (e.g. 2) or MIN-MAX"),
        (["--nodes", "2", "--shard", "4", "--model-params", "lots"], "is not a count"),
        (["--nodes", "2", "--shard", "4", "--gpu-memory", "80GiB"], "needs --model-params"),
        (
            ["--nodes", "2", "--shard", "4", "--model-params", "1B", "--dtype", "int3"],
            "--dtype 'int3': the trainer has no",
        ),
        (["--nodes", "2", "--shard", "4", "--model-params", "1B", "--precision", "fp16"], "--precision"),
        (
            ["--nodes", "2", "--shard", "4", "--svg", "/nonexistent-dir/plan.svg"],
            "cannot write '/nonexistent-dir/plan.svg'",
        ),
    ],
)
def test_plan_bad_input_is_one_line_and_exit_2(args, message):
    out = hpc("plan", *args)
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpc-hsdp: error: "), out.stderr
    assert message in lines[0]


@pytest.mark.parametrize(
    ("args", "rank", "replicate_label"),
    [
        (["--nodes", "2", "--gpus-per-node", "8", "--shard", "4"], 9, "1: [1,5,9,13]"),
        (["--nodes", "2", "--gpus-per-node", "4", "--shard", "1"], 7, "0: [0-7]"),
        (["--nodes", "4", "--gpus-per-node", "4", "--shard", "2"], 3, "1: [1,3,5,7,9,11,13,15]"),  # 8 ranks: all listed
        (["--nodes", "512", "--gpus-per-node", "8", "--shard", "8"], 4091, "3: [3,11,19,...,4091]"),
    ],
)
def test_plan_table_writes_long_replicate_groups_short(args, rank, replicate_label):
    out = hpc("plan", *args)
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if line.split()[2:3] == [str(rank)])
    assert row.endswith(replicate_label)
    assert max(len(line) for line in out.stdout.splitlines()[:-4]) < 100  # a table, not a dump of every group


def test_layout_inside_a_task():
    env = task_environments(
        tasks_per_node=(8, 8), node_names=["n1", "n2"], job_id="77", distribution="cyclic", gpus_per_node=8
    )[3]
    out = hpc("layout", "--shard", "4", env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    # PROCID 3 under cyclic distribution is the second task on n2: node-major rank 9
    assert (data["slurm_procid"], data["node"], data["rank"], data["local_rank"]) == (3, "n2", 9, 1)
    assert data["shard_group"] == [8, 9, 10, 11] and data["device"] == "cuda:1"
    assert data["master_addr"] == "n1" and data["master_port"] == 20077
    assert hpc("layout", "--shard", "4", "--field", "node_rank", env=env).stdout.strip() == "1"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "no SLURM environment found"),
        ({"SLURM_NTASKS": "12", "SLURM_STEP_NUM_TASKS": "12"}, "but tasks per node"),
        ({"SLURM_LOCALID": "9"}, "SLURM_LOCALID=9 but node n1 runs only 8 tasks"),
        ({"SLURM_LOCALID": ""}, "SLURM_LOCALID is not set"),
    ],
)
def test_layout_bad_env_is_one_line_and_exit_2(env, message):
    base = task_environments(tasks_per_node=(8, 8), node_names=["n1", "n2"], job_id="77")[0] if env else {}
    out = hpc("layout", "--shard", "4", env={**base, **env})
    assert out.returncode == 2 and out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and message in out.stderr, out.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--nodes", "2", "--shard", "4"],
        ["plan", "--nodes", "2", "--shard", "4", "--json", "--model-params", "7B"],
        ["plan", "--nodes", "2", "--shard", "2", "--tp", "4", "--model", "builtin", "--seq-len", "64"],
        ["plan", "--nodes", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB", "--seq-len", "4096"],
        ["layout", "--shard", "4"],
        ["--help"],
    ],
)
def test_plan_and_layout_never_import_torch(args):
    env = task_environments(tasks_per_node=(8, 8), node_names=["n1", "n2"], job_id="77")[0]
    assert_cli_imports_no_torch(args, env={**os.environ, **env})


@pytest.mark.parametrize("tokenizer_args", [[], ["--train-tokenizer", "300"]])
def test_prepare_data_never_imports_torch(tmp_path, tokenizer_args):
    (tmp_path / "doc.txt").write_text("a small document to tokenize, twice: a small document\n")
    args = ["prepare-data", str(tmp_path / "doc.txt"), "-o", str(tmp_path / "out"), "-q", *tokenizer_args]
    assert_cli_imports_no_torch(args)
    assert (tmp_path / "out" / "dataset.json").is_file()
