"""Memory and traffic arithmetic of the plan, table-driven."""

from __future__ import annotations

import json

import pytest

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.estimates import estimate, parse_bytes, parse_count, smallest_fitting_shard
from hpc_hsdp.plan.topology import TopologyPlan, plan_for, valid_shard_sizes

P = 1_000_000


@pytest.mark.parametrize(
    ("shard", "ag_wire", "rs_wire", "ar_wire", "inter"),
    [
        # 2 x 8 layout, fp32, root holds 0 params
        (1, None, None, 2 * 4 * P * 15 // 16, 2 * 4 * P * 15 // 16),
        (4, 8 * P * 3 // 4, 4 * P * 3 // 4, 2 * (P * 4 // 4) * 3 // 4, 2 * (P * 4 // 4) * 3 // 4),
        (16, 8 * P * 15 // 16, 4 * P * 15 // 16, None, 8 * P * 15 // 16 + 4 * P * 15 // 16),
    ],
)
def test_traffic_per_rank(shard, ag_wire, rs_wire, ar_wire, inter):
    est = estimate(plan_for(nodes=2, gpus_per_node=8, shard_size=shard), model_params=P)
    wire = {t.kind: t.wire_bytes for t in est.traffic}
    assert wire.get("all_gather") == ag_wire
    assert wire.get("reduce_scatter") == rs_wire
    assert wire.get("all_reduce") == ar_wire
    assert est.inter_node_wire_bytes == inter


def test_root_params_are_gathered_once():
    plan = plan_for(nodes=1, gpus_per_node=8, shard_size=8)
    est = estimate(plan, model_params=P, root_params=1000)
    ag = next(t for t in est.traffic if t.kind == "all_gather")
    assert ag.tensor_bytes == 4 * (2 * P - 1000)


@pytest.mark.parametrize(
    ("dtype", "optimizer", "per_param"), [("fp32", "adamw", 16), ("bf16", "adamw", 12), ("fp32", "sgd", 8)]
)
def test_memory_per_gpu(dtype, optimizer, per_param):
    est = estimate(
        plan_for(nodes=2, gpus_per_node=8, shard_size=4), model_params=8 * P, dtype=dtype, optimizer=optimizer
    )
    assert est.total_bytes == per_param * 8 * P // 4


def test_valid_shard_sizes():
    assert valid_shard_sizes((8, 8, 8, 8)) == [1, 2, 4, 8, 16, 32]
    assert valid_shard_sizes((8, 8, 8)) == [1, 2, 4, 8, 24]
    assert valid_shard_sizes((8, 4)) == [1, 2, 4]
    for sizes, tasks in ((valid_shard_sizes((8, 8, 8)), (8, 8, 8)), (valid_shard_sizes((6, 6)), (6, 6))):
        for s in sizes:
            TopologyPlan(tasks_per_node=tasks, shard_size=s)


def test_smallest_fitting_shard():
    plan = plan_for(nodes=2, gpus_per_node=8, shard_size=1)
    fit = smallest_fitting_shard(plan, model_params=7 * 10**9, gpu_memory=80 * 2**30)
    assert fit.shard_size == 2 and fit.needed_bytes == 16 * 7 * 10**9 // 2
    assert smallest_fitting_shard(plan, model_params=10**12, gpu_memory=80 * 2**30) is None


@pytest.mark.parametrize(
    ("text", "value"), [("7B", 7 * 10**9), ("350M", 350 * 10**6), ("1.3e9", 1_300_000_000), ("125000", 125000)]
)
def test_parse_count(text, value):
    assert parse_count(text) == value


@pytest.mark.parametrize(
    ("text", "value"), [("80GiB", 80 * 2**30), ("40GB", 40 * 10**9), ("24G", 24 * 2**30), ("512B", 512)]
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_a_size_without_a_unit_is_refused_not_read_as_bytes():
    with pytest.raises(SpecError, match=r"--gpu-memory '80' has no unit; write e.g. 80GiB \(or 80B for bytes\)"):
        parse_bytes("80")


@pytest.mark.parametrize("text", ["lots", "-1", "0", "7X", "1e999"])
def test_parse_rejects(text):
    with pytest.raises(SpecError):
        parse_count(text)


@pytest.mark.parametrize("grad_accum", [1, 2, 4, 8])
def test_grad_accum_multiplies_shard_traffic_but_not_the_replicate_all_reduce(grad_accum):
    plan = plan_for(nodes=2, gpus_per_node=8, shard_size=4)
    one = {(t.axis, t.kind): t for t in estimate(plan, model_params=1_000_000, root_params=1000).traffic}
    many = {
        (t.axis, t.kind): t
        for t in estimate(plan, model_params=1_000_000, root_params=1000, grad_accum=grad_accum).traffic
    }
    assert many[("shard", "all_gather")].tensor_bytes == grad_accum * one[("shard", "all_gather")].tensor_bytes
    assert many[("shard", "reduce_scatter")].tensor_bytes == grad_accum * one[("shard", "reduce_scatter")].tensor_bytes
    assert many[("replicate", "all_reduce")] == one[("replicate", "all_reduce")]


def test_plan_cli_takes_grad_accum():
    import subprocess
    import sys

    def plan(*extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "hpc_hsdp",
                "plan",
                "--nodes",
                "2",
                "--shard",
                "8",
                "--model-params",
                "1B",
                "--json",
                *extra,
            ],
            capture_output=True,
            text=True,
        )

    def wire(*extra):
        out = plan(*extra)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)["estimate"]
        return data["inter_node_wire_bytes"], data["intra_node_wire_bytes"]

    assert wire("--grad-accum", "4")[0] == wire()[0]  # S = 8: only the all-reduce crosses nodes
    assert wire("--grad-accum", "4")[1] == 4 * wire()[1]
    bad = plan("--grad-accum", "0")
    assert bad.returncode == 2 and "--grad-accum 0" in bad.stderr
