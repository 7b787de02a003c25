"""The step's speed settings (issue 14): the fused AdamW kernel and --reshard-after-forward.

One launch of 4 processes (an emulated 2 x 2 SLURM job, --shard 2, gloo on CPU) trains the
built-in model four times on the same mesh under the collective recorder: resharding after
forward (always), keeping the gathered parameters (never), the default (auto: never here,
the tiny model fits any host) and always with torch's single-tensor AdamW. Keeping the
gathered parameters must change no number of the training (the same parameters are
gathered, once instead of twice) and all-gather exactly ``bP`` bytes per step in the shard
group instead of ``b(2P - P_root)``, each as the plan's estimate says; the fused kernel must
train like the single-tensor one (to float rounding) and be what make_optimizer builds.
``auto`` decides on the smallest memory of all ranks, so that no rank re-gathers alone.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from dist_helpers import launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.models import resolve_model
from hpc_hsdp.plan.estimates import estimate
from hpc_hsdp.plan.shapes import parameter_counts
from hpc_hsdp.plan.topology import TopologyPlan
from hpc_hsdp.task.observation.comm_stats import CommStats
from hpc_hsdp.task.parallelism import reshard
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.training import engine, loop

MODEL = TrainingSpec.of(layers=2, width=32, heads=4, seq_len=12, batch_size=2, vocab_size=64, steps=3, seed=1)
TASKS_PER_NODE = (2, 2)


def train_three_ways(ctx):
    """fn of run_task: per variant, the losses, grad norms and the shard axis' all-gather bytes per step."""
    nodes = [d["node"] for d in ctx.realized]
    single_tensor = engine.make_optimizer

    def make_single_tensor(model, optimizer):
        groups = [
            {"params": g["params"], "weight_decay": g["weight_decay"]}
            for g in single_tensor(model, optimizer).param_groups
        ]
        return torch.optim.AdamW(groups, lr=optimizer.lr, foreach=False, fused=False)

    always = MODEL.replace(reshard_after_forward="always")
    out = {"agreed": agreed_choice(ctx)}
    for name, training, make in (
        ("always", always, single_tensor),
        ("never", MODEL.replace(reshard_after_forward="never"), single_tensor),
        ("auto", MODEL, single_tensor),
        ("single-tensor", always, make_single_tensor),
    ):
        steps: dict[int, dict] = {}
        engine.make_optimizer = make  # the engine builds the loop's optimizer
        try:
            with CommStats(mesh=ctx.mesh, node_of_rank=nodes) as recorder:
                sub = RunContext(
                    layout=ctx.layout,
                    mesh=ctx.mesh,
                    device=ctx.device,
                    realized=ctx.realized,
                    comm_stats=recorder,
                    _active=False,
                )
                result = loop.train(
                    sub,
                    training,
                    on_step=lambda step, record, steps=steps: steps.__setitem__(step, record),
                    verbose=False,
                )
        finally:
            engine.make_optimizer = single_tensor
        out[name] = {
            "loss": [steps[s]["loss"] for s in sorted(steps)],
            "grad_norm": [steps[s]["grad_norm"] for s in sorted(steps)],
            "gathered": [steps[s]["comm"]["shard"]["all_gather"]["tensor_bytes"] for s in sorted(steps)],
            "optimizer": {k: result.optimizer.defaults.get(k) for k in ("fused", "foreach")},
        }
    return out


def agreed_choice(ctx):
    """auto with rank 0 seeing too little memory for the gathered model and the others plenty:
    every rank must choose to reshard (a lone re-gather would hang the shard group)."""
    adapter = resolve_model(MODEL)
    model = adapter.build_meta()
    memory = 1 << 16 if ctx.rank == 0 else 1 << 40
    with mock.patch.object(reshard, "device_memory_bytes", lambda device, local_world_size: memory):
        choice = reshard.choose_reshard(ctx, model, tuple(adapter.shard_units(model)), setting="auto", precision="fp32")
    return choice.reshard


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("settings") / "run"
    spec = RunSpec(shard_size=2, run_dir=str(run_dir), device="cpu", training=MODEL)
    return [o.value for o in launch(spec, tasks_per_node=TASKS_PER_NODE, fn=train_three_ways, timeout_s=240)]


def predicted_gather_bytes() -> tuple[int, int]:
    """The plan's all-gather bytes per step in the shard group: (resharding, keeping)."""
    counts = parameter_counts(**MODEL.options(), shard_size=2)
    plan = TopologyPlan(tasks_per_node=TASKS_PER_NODE, shard_size=2, node_names=("n1", "n2"))
    return tuple(
        next(
            t.tensor_bytes
            for t in estimate(
                plan, model_params=counts.params, root_params=counts.root_params, reshard_after_forward=reshard
            ).traffic
            if t.kind == "all_gather"
        )
        for reshard in (True, False)
    )


@pytest.mark.dist
def test_keeping_the_gathered_parameters_changes_no_number_and_gathers_once(trained):
    resharded, kept = predicted_gather_bytes()
    assert kept < resharded
    for value in trained:
        assert value["never"]["loss"] == value["always"]["loss"]
        assert value["never"]["grad_norm"] == value["always"]["grad_norm"]
        assert value["always"]["gathered"] == [resharded] * MODEL.optimizer.steps
        assert value["never"]["gathered"] == [kept] * MODEL.optimizer.steps


@pytest.mark.dist
def test_auto_keeps_what_fits_and_agrees_on_the_smallest_memory(trained):
    _, kept = predicted_gather_bytes()
    for value in trained:
        assert value["auto"]["gathered"] == [kept] * MODEL.optimizer.steps
        assert value["auto"]["loss"] == value["always"]["loss"]
        assert value["agreed"] is True


@pytest.mark.dist
def test_the_fused_optimizer_is_the_default_and_trains_like_the_single_tensor_one(trained):
    for value in trained:
        assert value["always"]["optimizer"]["fused"] is True
        assert value["single-tensor"]["optimizer"]["fused"] is False
        assert value["single-tensor"]["loss"][0] == value["always"]["loss"][0]  # before any optimizer step
        assert value["single-tensor"]["loss"] == pytest.approx(value["always"]["loss"], rel=1e-5)
        assert value["single-tensor"]["grad_norm"] == pytest.approx(value["always"]["grad_norm"], rel=1e-4)
