"""A flexible allocation, ``--nodes MIN-MAX`` (issue 13), without a cluster: the spec, render and
plan accept it where the shard groups fit at both ends and the global batch splits at both ends
(derived from ``--batch-size`` at MAX when not given), so the sample stream is the same whatever
SLURM grants; anything else is one line and exit 2. The real dev cluster's half:
tests/cluster/test_flexible_nodes.py.
"""

from __future__ import annotations

import json

import pytest
from cli_helpers import hpc

from hpc_hsdp.errors import HsdpError, SpecError


@pytest.mark.parametrize(
    "value, expected", [(2, (2, 2)), ("2", (2, 2)), ("1-2", (1, 2)), (" 3-8 ", (3, 8)), ("4-4", (4, 4))]
)
def test_parse_nodes(value, expected):
    from hpc_hsdp.job.spec import parse_nodes

    assert parse_nodes(value) == expected


@pytest.mark.parametrize(
    "value, words",
    [
        ("2-1", ["fewest", "write 1-2"]),
        ("x", ["not a node count", "MIN-MAX"]),
        ("1-", ["not a node count"]),
        ("-2", ["not a node count"]),
        ("1-2-3", ["not a node count"]),
    ],
)
def test_parse_nodes_rejects(value, words):
    from hpc_hsdp.job.spec import parse_nodes

    with pytest.raises(SpecError) as raised:
        parse_nodes(value)
    assert all(w in str(raised.value) for w in words), raised.value


def _spec(tmp_path, **options):
    from hpc_hsdp.cli.job_options import job_spec_from_options

    return job_spec_from_options(
        {"run_dir": str(tmp_path / "run"), "device": "cpu", **options}, environ={}, cwd=tmp_path, default_venv=None
    )


def test_the_global_batch_is_derived_at_the_most_nodes_and_kept_at_the_fewest(tmp_path):
    spec = _spec(tmp_path, nodes="1-2", gpus_per_node=2, shard_size=2, training_batch_size=3)
    assert (spec.min_nodes, spec.nodes, spec.flexible, spec.nodes_text) == (1, 2, True, "1-2")
    training = spec.run.training
    assert training.dataset.global_batch_size == 12  # 3 per rank x 4 ranks at 2 nodes
    assert (training.dataset.rank_batch_size(4), training.dataset.rank_batch_size(2)) == (3, 6)
    assert spec.plan_at(1).world_size == 2 and spec.plan.world_size == 4
    fixed = _spec(tmp_path, nodes="2-2", gpus_per_node=2, shard_size=2)
    assert (fixed.min_nodes, fixed.flexible, fixed.nodes_text, fixed.run.training.dataset.global_batch_size) == (
        None,
        False,
        "2",
        None,
    )


REJECTED = [
    # (options, words of the one line)
    (
        {"nodes": "2-3", "gpus_per_node": 2, "shard_size": 2, "training_batch_size": 1},
        ["--nodes 2-3", "global batch 6", "4 data-parallel ranks", "multiple of 12"],
    ),
    (
        {"nodes": "2-3", "gpus_per_node": 2, "shard_size": 2, "training_global_batch_size": 8},
        ["global batch 8", "6 data-parallel ranks", "multiple of 12"],
    ),
    ({"nodes": "1-2", "gpus_per_node": 2, "shard_size": 4}, ["--nodes 1-2", "at 1 node(s)", "shard size 4"]),
    ({"nodes": "1-2", "gpus_per_node": 2, "shard_size": 1, "ntasks": 3}, ["--ntasks 3", "fixed node count"]),
    ({"nodes": "3-2", "gpus_per_node": 2, "shard_size": 2}, ["fewest", "write 2-3"]),
]


@pytest.mark.parametrize(
    "options, words", REJECTED, ids=[str(o["nodes"]) + "-" + str(i) for i, (o, _) in enumerate(REJECTED)]
)
def test_flexible_allocations_that_cannot_keep_the_stream_are_refused(tmp_path, options, words):
    with pytest.raises(HsdpError) as raised:  # SpecError or TopologyError: one line, exit 2
        _spec(tmp_path, **options)
    assert all(w in str(raised.value) for w in words), raised.value


def test_render_writes_the_range_and_both_layouts_and_plan_shows_both_ends(tmp_path):
    out = hpc(
        "render",
        "--nodes",
        "1-2",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--device",
        "cpu",
        "--run-dir",
        str(tmp_path / "run"),
        "-o",
        str(tmp_path / "job.sbatch"),
    )
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1-2\n" in text and "#SBATCH --ntasks-per-node=2\n" in text
    assert "# layout at 2 nodes: 4 ranks" in text and "# layout at 1 node: 2 ranks" in text
    assert "--global-batch-size 16" in text  # the default --batch-size 4 x 4 ranks, fixed for both ends
    assert "export HPC_HSDP_REQUEUE_REQUEST='NumNodes=1-2 NumTasks=2'\n" in text  # a requeue restores the range
    torchrun = hpc(
        "render",
        "--nodes",
        "1-2",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--device",
        "cpu",
        "--launcher",
        "torchrun",
        "--run-dir",
        str(tmp_path / "run"),
    )
    assert '--nnodes="$SLURM_JOB_NUM_NODES"' in torchrun.stdout, torchrun.stderr
    bad = hpc(
        "render",
        "--nodes",
        "2-3",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--device",
        "cpu",
        "--batch-size",
        "1",
        "--run-dir",
        str(tmp_path / "bad"),
        "-o",
        str(tmp_path / "bad.sbatch"),
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "multiple of 12" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad.sbatch").exists() and not (tmp_path / "bad").exists()

    plan = hpc("plan", "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "2")
    assert plan.returncode == 0, plan.stderr
    assert "at 2 nodes (the most):" in plan.stdout and "at 1 node (the fewest):" in plan.stdout
    assert "mesh (replicate=2, shard=2)" in plan.stdout and "mesh (replicate=1, shard=2)" in plan.stdout
    data = json.loads(hpc("plan", "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "2", "--json").stdout)
    assert (data["world_size"], data["flexible"]["min_nodes"], data["flexible"]["at_min_nodes"]["world_size"]) == (
        4,
        1,
        2,
    )
    refused = hpc("plan", "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "4")
    assert refused.returncode == 2 and "at 1 node(s)" in refused.stderr and refused.stderr.count("\n") == 1


def test_a_config_file_takes_a_range(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('nodes = "1-2"\ngpus_per_node = 2\nshard = 2\n')
    spec = _spec(tmp_path, config=str(config))
    assert (spec.min_nodes, spec.nodes) == (1, 2)
