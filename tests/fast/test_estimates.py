"""Memory and traffic arithmetic of the plan, table-driven."""

from __future__ import annotations

import json

import pytest
from cli_helpers import hpc

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
    ("precision", "optimizer", "per_param"),
    # the trainer keeps fp32 sharded parameters and gradients in every precision (FSDP2's mixed precision)
    [("fp32", "adamw", 16), ("bf16", "adamw", 16), ("fp8", "adamw", 16), ("auto", "adamw", 16), ("fp32", "sgd", 8)],
)
def test_memory_per_gpu(precision, optimizer, per_param):
    est = estimate(
        plan_for(nodes=2, gpus_per_node=8, shard_size=4), model_params=8 * P, precision=precision, optimizer=optimizer
    )
    assert est.total_bytes == per_param * 8 * P // 4


@pytest.mark.parametrize(
    ("precision", "gather", "reduce", "label"),
    [("fp32", 4, 4, "fp32"), ("bf16", 2, 4, "bf16"), ("fp8", 2, 4, "fp8"), ("auto", 2, 4, "bf16")],
)
def test_gathers_in_the_compute_dtype_and_reduces_in_fp32(precision, gather, reduce, label):
    est = estimate(plan_for(nodes=2, gpus_per_node=8, shard_size=8), model_params=8 * P, precision=precision)
    tensor = {t.kind: t.tensor_bytes for t in est.traffic}
    assert est.precision == label
    assert tensor == {"all_gather": gather * 2 * 8 * P, "reduce_scatter": reduce * 8 * P, "all_reduce": reduce * P}


@pytest.mark.parametrize(
    ("precision", "reshard", "working"),
    [
        # 8 blocks of P and a root of 2P: two blocks and the root gathered, one block's gradients in flight
        ("fp32", True, 4 * (2 * P + 2 * P) + (4 + 4) * P),
        ("bf16", True, 2 * (2 * P + 2 * P) + (2 + 4) * P),
        # the blocks kept gathered from forward to backward: the whole model
        ("fp32", False, 4 * 10 * P + (4 + 4) * P),
        ("bf16", False, 2 * 10 * P + (2 + 4) * P),
    ],
)
def test_the_working_set_is_the_gathered_blocks_and_one_blocks_gradients(precision, reshard, working):
    plan = plan_for(nodes=1, gpus_per_node=8, shard_size=8)
    est = estimate(
        plan, model_params=10 * P, root_params=2 * P, blocks=8, precision=precision, reshard_after_forward=reshard
    )
    assert est.working_bytes == working
    assert est.needed_bytes == est.total_bytes + working


def test_without_blocks_the_llama_model_nearest_the_count_gives_them():
    plan = plan_for(nodes=1, gpus_per_node=8, shard_size=8)
    assert estimate(plan, model_params=70 * 10**9).blocks == 80
    assert estimate(plan, model_params=7 * 10**9).blocks == 32


def test_an_unknown_precision_is_a_spec_error():
    with pytest.raises(SpecError, match="--precision 'fp16' is unknown"):
        estimate(plan_for(nodes=1, gpus_per_node=8, shard_size=8), model_params=P, precision="fp16")


def test_valid_shard_sizes():
    assert valid_shard_sizes((8, 8, 8, 8)) == [1, 2, 4, 8, 16, 32]
    assert valid_shard_sizes((8, 8, 8)) == [1, 2, 4, 8, 24]
    assert valid_shard_sizes((8, 4)) == [1, 2, 4]
    for sizes, tasks in ((valid_shard_sizes((8, 8, 8)), (8, 8, 8)), (valid_shard_sizes((6, 6)), (6, 6))):
        for s in sizes:
            TopologyPlan(tasks_per_node=tasks, shard_size=s)


def test_smallest_fitting_shard():
    plan = plan_for(nodes=2, gpus_per_node=8, shard_size=1)
    fit = smallest_fitting_shard(plan, model_params=7 * 10**9, gpu_memory=80 * 2**30, precision="fp32")
    block = -(-7 * 10**9 // 32)  # the 7B Llama model's 32 blocks
    assert fit.shard_size == 2 and fit.needed_bytes == 16 * 7 * 10**9 // 2 + 4 * 2 * block + 8 * block
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
    def plan(*extra):
        return hpc("plan", "--nodes", "2", "--shard", "8", "--model-params", "1B", "--json", *extra)

    def wire(*extra):
        out = plan(*extra)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)["estimate"]
        return data["inter_node_wire_bytes"], data["intra_node_wire_bytes"]

    assert wire("--grad-accum", "4")[0] == wire()[0]  # S = 8: only the all-reduce crosses nodes
    assert wire("--grad-accum", "4")[1] == 4 * wire()[1]
    bad = plan("--grad-accum", "0")
    assert bad.returncode == 2 and "--grad-accum 0" in bad.stderr


def test_a_small_count_without_a_unit_is_a_forgotten_unit_not_a_model():
    with pytest.raises(SpecError, match=r"--model-params '70' would be 70 parameters; write 70B \(billions\) or 70M"):
        parse_count("70")
    assert parse_count("70B") == 70 * 10**9 and parse_count("10000") == 10**4
