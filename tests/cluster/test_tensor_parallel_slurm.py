"""--tp on the real dev SLURM cluster: TP groups of consecutive node-major ranks, each inside one
node, whatever order SLURM dealt the tasks in."""

from __future__ import annotations

import json

import pytest
from cluster_helpers import hpc

from tests.slurm_job_helpers import TINY, _ranks

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]


def test_tp_groups_sit_inside_a_node_under_the_cyclic_distribution(slurm_cluster, tmp_path):
    run = tmp_path / "tp"
    out = hpc(
        *("submit", "--cluster", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--shard", "2", "--tp", "2"),
        *("--distribution", "cyclic", "--wait", "--run-dir", str(run), *TINY),
    )
    assert out.returncode == 0, out.stdout + out.stderr
    layout, ranks = _ranks(run)
    assert layout["plan"]["mesh_shape"] == [2, 2, 2]
    assert layout["plan"]["tp_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [r["node"] for r in ranks] == ["n1"] * 4 + ["n2"] * 4
    assert [r["slurm_procid"] for r in ranks] == [0, 2, 4, 6, 1, 3, 5, 7]  # dealt round-robin
    node_of = {r["rank"]: r["node"] for r in ranks}
    for r in ranks:
        assert r["tp_group"] == [r["rank"] // 2 * 2, r["rank"] // 2 * 2 + 1]
        assert len({node_of[m] for m in r["tp_group"] + r["shard_group"]}) == 1, r  # a copy on one node
        assert r["replicate_group"] == [r["rank"] % 4, r["rank"] % 4 + 4]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
