"""--comm-stats: measured collectives equal the plan's prediction, byte for byte.

One launch of 16 processes (an emulated 2 x 8 SLURM job, gloo on CPU) serves every shard
size: the task joins with ``--shard 4 --comm-stats`` (the real path: init wraps, the
payload logs ``comm`` into metrics.jsonl), then builds meshes for S = 1, 2 and 8 on the
same process group and trains the built-in payload on each under its own recorder. Per
step, per rank, the recorded tensor bytes of every (axis, collective) must EQUAL
``estimate(plan, model_params, root_params)`` with the counts of
``models.builtin.parameter_counts`` (seq_len 12 makes S = 8 pad ``pos_emb``: padding is
modelled, not avoided), and the wire bytes the ring formulas. FSDP2's own memory tracker
then checks the per-rank memory estimate (parameters + gradients + AdamW states).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest
from dist_helpers import launch

from hpc_hsdp.job.spec import RunSpec
from hpc_hsdp.plan.estimates import estimate
from hpc_hsdp.plan.shapes import parameter_counts
from hpc_hsdp.plan.topology import TopologyPlan
from hpc_hsdp.rundir.files import read_jsonl
from tests.comm_stats_helpers import MODEL

TASKS_PER_NODE = (8, 8)
SHARD_SIZES = (1, 2, 4, 8)
EXTRA_SHARD_SIZES = (1, 2, 8)  # 4 is the job's own --shard
GRAD_ACCUMS = (1, 2)


def plan_of(shard_size: int) -> TopologyPlan:
    return TopologyPlan(tasks_per_node=TASKS_PER_NODE, shard_size=shard_size, node_names=("n1", "n2"))


def predicted(shard_size: int, grad_accum: int = 1):
    counts = parameter_counts(**MODEL.options(), shard_size=shard_size)
    return estimate(
        plan_of(shard_size), model_params=counts.params, root_params=counts.root_params, grad_accum=grad_accum
    )


# ----------------------------------------------------------------------------- child side


def _memory_of_one_step(ctx, training):
    """Sharded params + grads + optimizer states per rank after one step, by FSDPMemTracker."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.task.training.loader import read_rows
    from hpc_hsdp.task.training.model import build_model, make_optimizer
    from hpc_hsdp.task.training.run_data import open_data

    adapter = resolve_model(training)
    model = build_model(ctx, adapter, training)
    optimizer = make_optimizer(model, training.optimizer)
    data = open_data(training, ctx.world_size)
    inputs, targets = read_rows(data.train, data.order.sample_ids(data.layout.positions(1, 0, ctx.rank)))
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((inputs, targets))
    with tracker:
        loss = adapter.loss(model, inputs, targets)
        loss.backward()
        optimizer.step()
    snapshot = tracker.get_tracker_snapshot("current")
    per_kind = {getattr(k, "value", str(k)): int(v) for k, v in next(iter(snapshot.values())).items()}
    return {k: per_kind.get(k, 0) for k in ("Sharded Param", "Sharded Grad", "OptState", "Total")}


def measure_every_shard_size(ctx):
    """fn of run_task: the job's own shard size through the payload, then the others."""
    from torch.distributed.device_mesh import init_device_mesh

    from hpc_hsdp.task.observation.comm_stats import CommStats
    from hpc_hsdp.task.parallelism.dist import MESH_AXES, RunContext
    from hpc_hsdp.task.training.loop import train
    from tests.runtime_helpers import wrapped_collectives

    out = {"comm": {}, "memory": {}, "accum": {}}
    steps: dict[int, dict] = {}
    train(ctx, MODEL, on_step=lambda step, record: steps.__setitem__(step, record["comm"]), verbose=False)
    out["comm"][ctx.plan.shard_size] = steps
    ctx.comm_stats.close()
    out["wrapped_after_close"] = bool(wrapped_collectives())
    nodes = [d["node"] for d in ctx.realized]
    for s in EXTRA_SHARD_SIZES:
        plan = TopologyPlan(tasks_per_node=ctx.plan.tasks_per_node, shard_size=s, node_names=ctx.plan.node_names)
        mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=MESH_AXES)
        steps = {}
        with CommStats(mesh=mesh, node_of_rank=nodes) as recorder:
            sub = RunContext(
                layout=dataclasses.replace(ctx.layout, plan=plan),
                mesh=mesh,
                device=ctx.device,
                realized=ctx.realized,
                comm_stats=recorder,
                _active=False,
            )
            train(
                sub, MODEL, on_step=lambda step, record, out=steps: out.__setitem__(step, record["comm"]), verbose=False
            )
        out["comm"][s] = steps
    for accum in GRAD_ACCUMS:  # same mesh (S = 4), same global batch, N micro-batches per step
        training = MODEL.replace(global_batch_size=MODEL.dataset.batch_size * ctx.world_size * 2, grad_accum=accum)
        steps = {}
        with CommStats(mesh=ctx.mesh, node_of_rank=nodes) as recorder:
            sub = RunContext(
                layout=ctx.layout,
                mesh=ctx.mesh,
                device=ctx.device,
                realized=ctx.realized,
                comm_stats=recorder,
                _active=False,
            )
            train(
                sub,
                training,
                on_step=lambda step, record, out=steps: out.__setitem__(step, record["comm"]),
                verbose=False,
            )
        out["accum"][accum] = steps
    for s in (1, 8):
        plan = TopologyPlan(tasks_per_node=ctx.plan.tasks_per_node, shard_size=s, node_names=ctx.plan.node_names)
        mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=MESH_AXES)
        sub = RunContext(
            layout=dataclasses.replace(ctx.layout, plan=plan),
            mesh=mesh,
            device=ctx.device,
            realized=ctx.realized,
            _active=False,
        )
        out["memory"][s] = _memory_of_one_step(sub, MODEL)
    out["memory"][ctx.plan.shard_size] = _memory_of_one_step(ctx, MODEL)
    return out


# ----------------------------------------------------------------------------- the shared run


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("comm") / "run"
    spec = RunSpec(shard_size=4, run_dir=str(run_dir), device="cpu", training=MODEL, comm_stats=True)
    outcomes = launch(spec, tasks_per_node=TASKS_PER_NODE, fn=measure_every_shard_size, timeout_s=240)
    return {"values": [o.value for o in outcomes], "run_dir": run_dir}


@pytest.mark.dist
@pytest.mark.parametrize("shard_size", SHARD_SIZES)
def test_measured_bytes_equal_the_prediction(measured, shard_size):
    est = predicted(shard_size)
    expected = {(t.axis, t.kind): t for t in est.traffic}
    for rank, value in enumerate(measured["values"]):
        steps = value["comm"][shard_size]
        assert sorted(steps) == [1, 2]
        for step, comm in steps.items():
            seen = {
                (axis, kind): comm[axis][kind]
                for axis in ("shard", "replicate")
                if axis in comm
                for kind in ("all_gather", "reduce_scatter", "all_reduce")
                if kind in comm[axis]
            }
            assert set(seen) == set(expected), (rank, step, comm)
            for key, t in expected.items():
                assert seen[key]["tensor_bytes"] == t.tensor_bytes, (rank, step, key)
                assert seen[key]["wire_bytes"] == t.wire_bytes, (rank, step, key)
                assert comm[key[0]]["inter_node"] is t.inter_node, (rank, step, key)
            # the loop's one all-reduce of its own: loss, squared gradient norm, the stop agreement's
            # two counts (warning, SIGTERM) and the debugger's request (hpc-hsdp debug), five fp32 values
            assert comm["world"]["all_reduce"] == {
                "calls": 1,
                "tensor_bytes": 20,
                "wire_bytes": int(Fraction(2 * 15, 16) * 20),
            }
            assert comm["world"]["inter_node"] is True
            model_inter = sum(comm[a][k]["wire_bytes"] for a, k in seen if comm[a]["inter_node"])
            assert model_inter == est.inter_node_wire_bytes
            assert (
                comm["inter_node_wire_bytes"] == est.inter_node_wire_bytes + comm["world"]["all_reduce"]["wire_bytes"]
            )
            assert comm["intra_node_wire_bytes"] == est.intra_node_wire_bytes


@pytest.mark.dist
@pytest.mark.parametrize("grad_accum", GRAD_ACCUMS)
def test_accumulation_all_reduces_across_replicas_once_per_step(measured, grad_accum):
    """--grad-accum N: the shard group reduce-scatters (and gathers) every micro-batch, the
    replicas all-reduce once per optimizer step: replicate-axis bytes do not depend on N,
    and the plan's estimate says the same."""
    est = predicted(4, grad_accum)
    expected = {(t.axis, t.kind): t.tensor_bytes for t in est.traffic}
    assert expected[("replicate", "all_reduce")] == predicted(4).traffic[-1].tensor_bytes
    for value in measured["values"]:
        for step, comm in value["accum"][grad_accum].items():
            seen = {
                (axis, kind): comm[axis][kind]["tensor_bytes"]
                for axis in ("shard", "replicate")
                for kind in ("all_gather", "reduce_scatter", "all_reduce")
                if kind in comm[axis]
            }
            assert seen == expected, (step, grad_accum)
            assert (
                comm["replicate"]["all_reduce"]["calls"] == value["accum"][1][step]["replicate"]["all_reduce"]["calls"]
            )
    one, two = (measured["values"][0]["accum"][n][2] for n in (1, 2))
    assert two["shard"]["reduce_scatter"]["tensor_bytes"] == 2 * one["shard"]["reduce_scatter"]["tensor_bytes"]
    assert two["replicate"] == one["replicate"]


@pytest.mark.dist
def test_shapes_of_the_layout(measured):
    """2 x 8: S = 8 keeps the heavy traffic inside a node, only the all-reduce crosses; S = 1
    sends everything across; the prediction says so and the measurement agrees."""
    comm = {s: measured["values"][0]["comm"][s][2] for s in SHARD_SIZES}
    assert comm[8]["shard"]["inter_node"] is False and comm[8]["replicate"]["inter_node"] is True
    assert comm[4]["replicate"]["group_size"] == 4 and comm[4]["shard"]["group_size"] == 4
    assert "shard" not in comm[1] and comm[1]["replicate"]["group_size"] == 16
    inter = [comm[s]["inter_node_wire_bytes"] for s in SHARD_SIZES]
    assert inter == sorted(inter, reverse=True)


@pytest.mark.dist
def test_metrics_jsonl_carries_rank0_comm(measured):
    records = read_jsonl(measured["run_dir"] / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["comm"] == measured["values"][0]["comm"][4][2]
    assert not any(v["wrapped_after_close"] for v in measured["values"])


@pytest.mark.dist
@pytest.mark.parametrize("shard_size", (1, 4, 8))
def test_memory_estimate_matches_fsdp_mem_tracker(measured, shard_size):
    est = predicted(shard_size)
    for value in measured["values"]:
        mem = value["memory"][shard_size]
        tracked = mem["Sharded Param"] + mem["Sharded Grad"] + mem["OptState"]
        assert tracked == pytest.approx(est.total_bytes, rel=0.03), mem
        assert mem["Sharded Param"] == pytest.approx(est.param_bytes, rel=0.03)
