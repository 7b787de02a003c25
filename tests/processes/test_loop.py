"""The training loop's options with real gloo processes on synthetic data.

One 2 x 2 run (shard 2) with accumulation, clipping, warm-up + cosine, weight decay and
eval is the reference for the rest: a single-process model on the same global batches
must end where it ends; the same global batch on 1 node x 2 sees the same samples; a run
stopped by a signal and resumed on the same mesh ends bit-identical, resumed on 1 x 2 it
sees exactly the same samples and ends equal within float tolerance. The same launch
checks bf16 and activation checkpointing, and that the eval loss is the same on every
mesh shape.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from dist_helpers import in_child, launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.task.checkpointing.checkpoint import complete_checkpoints
from hpc_hsdp.task.training.schedule import learning_rate
from tests.loop_helpers import _train_recording, max_param_diff, train_recording, train_signalled_at_3, union_of_samples

# 4 ranks x 2 samples x 2 micro-batches = a global batch of 16
TRAIN = TrainingSpec.of(
    layers=2,
    width=32,
    heads=4,
    seq_len=16,
    batch_size=2,
    grad_accum=2,
    vocab_size=64,
    steps=6,
    seed=11,
    lr=1e-2,
    weight_decay=0.1,
    lr_schedule="cosine",
    warmup_steps=2,
    min_lr=1e-3,
    clip_grad=0.5,
    eval_every=3,
    eval_batches=2,
    precision="fp32",
    keep_checkpoints=3,
)
GLOBAL = TRAIN.replace(batch_size=4, global_batch_size=16)  # the same on any number of ranks


# ----------------------------------------------------------------------------- pure


@pytest.mark.parametrize(
    ("schedule", "step", "expected"),
    [
        ("constant", 1, 0.25),
        ("constant", 4, 1.0),
        ("constant", 10, 1.0),  # warm-up 4 steps, then flat
        ("cosine", 4, 1.0),
        ("cosine", 7, 0.1 + 0.9 * 0.5),
        ("cosine", 10, 0.1),  # half-way: the mean of lr and min_lr
        ("linear", 4, 1.0),
        ("linear", 7, 0.55),
        ("linear", 10, 0.1),
        ("linear", 2, 0.5),
    ],
)
def test_learning_rate_schedules(schedule, step, expected):
    got = learning_rate(step, lr=1.0, schedule=schedule, warmup_steps=4, min_lr=0.1, total_steps=10)
    assert got == pytest.approx(expected)


def test_schedules_without_warmup_start_at_lr_and_end_at_min_lr():
    for schedule in ("cosine", "linear"):
        lrs = [
            learning_rate(s, lr=1.0, schedule=schedule, warmup_steps=0, min_lr=0.0, total_steps=5) for s in range(1, 6)
        ]
        assert lrs[-1] == pytest.approx(0.0) and lrs == sorted(lrs, reverse=True) and lrs[0] >= 0.8 - 1e-12


# ----------------------------------------------------------------------------- child side


def train_and_more(ctx):
    """The reference run, then (no run dir) bf16 with and without activation checkpointing,
    then the eval loss of one fresh model on three mesh shapes."""
    import numpy as np
    from torch.distributed.device_mesh import init_device_mesh

    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.plan.topology import TopologyPlan
    from hpc_hsdp.task.parallelism.dist import MESH_AXES, RunContext
    from hpc_hsdp.task.training.loop import train
    from hpc_hsdp.task.training.model import build_model
    from hpc_hsdp.task.training.run_data import open_data
    from hpc_hsdp.task.training.step import evaluate

    out = _train_recording(ctx, TRAIN)
    scratch = RunContext(layout=ctx.layout, mesh=ctx.mesh, device=ctx.device, realized=ctx.realized, _active=False)
    bf16 = TRAIN.replace(precision="bf16", steps=3, eval_every=0)
    out["bf16"] = {
        ac: train(scratch, bf16.replace(activation_checkpointing=ac), verbose=False).losses for ac in (True, False)
    }
    out["eval_by_shard"] = {}
    data = open_data(TRAIN, ctx.world_size)
    ids = np.arange(40)  # 40 samples: not a multiple of 4 ranks x 2 rows, so some ranks run a weight-0 forward
    for s in (1, 2, 4):
        plan = TopologyPlan(tasks_per_node=ctx.plan.tasks_per_node, shard_size=s, node_names=ctx.plan.node_names)
        mesh = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=MESH_AXES)
        sub = RunContext(
            layout=dataclasses.replace(ctx.layout, plan=plan),
            mesh=mesh,
            device=ctx.device,
            realized=ctx.realized,
            _active=False,
        )
        adapter = resolve_model(TRAIN)
        model = build_model(sub, adapter, TRAIN)
        out["eval_by_shard"][s] = evaluate(sub, model, adapter, data.val, ids[:38], rows_per_rank=3)
    return out


def reference_run(training: TrainingSpec, world_size: int, ckpt_path):
    """One process, no FSDP: the same global batches, accumulation as one big batch, the
    same clipping, schedule and weight-decay groups; compared with the HSDP checkpoint."""
    import torch

    from hpc_hsdp.models.builtin import ModelConfig, build_model, init_parameters, loss_fn
    from hpc_hsdp.task.training.schedule import lr_of
    from tests.runtime_helpers import full_checkpoint, synthetic_rows

    model = build_model(ModelConfig.from_training(training), device="cpu")
    init_parameters(model, seed=training.optimizer.seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": training.optimizer.weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=training.optimizer.lr,
    )
    global_batch = training.dataset.global_batch(world_size)
    losses, norms = {}, {}
    for step in range(1, training.optimizer.steps + 1):
        x, y = synthetic_rows(training, step=step, rank=0, world_size=1, batch_size=global_batch)
        loss = loss_fn(model(x), y)
        loss.backward()
        norms[step] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), training.optimizer.clip_grad))
        for group in opt.param_groups:
            group["lr"] = lr_of(training.optimizer, step)
        opt.step()
        opt.zero_grad()
        losses[step] = float(loss)
    saved = full_checkpoint(ckpt_path)["model"]
    ours = model.state_dict()
    return {
        "losses": losses,
        "norms": norms,
        "max_param_diff": max(float((ours[k] - saved[k]).abs().max()) for k in ours),
    }


# ----------------------------------------------------------------------------- the runs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("loop") / "run"
    spec = RunSpec(shard_size=2, run_dir=str(run_dir), device="cpu", training=TRAIN, timeout_s=120)
    outcomes = launch(spec, tasks_per_node=[2, 2], fn=train_and_more, timeout_s=240)
    return {"run_dir": run_dir, "values": [o.value for o in outcomes]}


def test_metrics_carry_the_new_fields_and_the_loss_falls(reference):
    records = read_jsonl(reference["run_dir"] / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert r["lr"] == pytest.approx(
            learning_rate(r["step"], lr=1e-2, schedule="cosine", warmup_steps=2, min_lr=1e-3, total_steps=6)
        )
        assert r["grad_norm"] > 0 and r["data_wait_s"] >= 0 and r["step_time_s"] > r["data_wait_s"]
        assert r["cpu_time_s"] > 0
        assert r["tokens_seen"] == r["step"] * 16 * 16 and r["global_batch"] == 16 and r["grad_accum"] == 2
        assert r["precision"] == "fp32"
    assert [r["step"] for r in records if "eval_loss" in r] == [3, 6]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert evals[1] < evals[0]
    assert records[-1]["loss"] < records[0]["loss"] - 0.2
    assert [s for s, _ in complete_checkpoints(reference["run_dir"])] == [6]


def test_every_rank_reads_its_own_rows_and_the_steps_never_repeat_a_sample(reference):
    per_rank = [
        set(i for r in v["records"].values() for micro in r["sample_ids"] for i in micro) for v in reference["values"]
    ]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not per_rank[a] & per_rank[b]
    steps = union_of_samples(reference["values"])
    assert all(len(ids) == 16 for ids in steps.values())
    seen = [i for ids in steps.values() for i in ids]
    assert len(seen) == len(set(seen)) == 96


def test_matches_a_single_process_run_with_accumulation_clipping_and_schedule(reference):
    final = reference["run_dir"] / "checkpoints" / "step-000006"
    ref = in_child(reference_run, TRAIN, 4, final)
    records = read_jsonl(reference["run_dir"] / "metrics.jsonl")
    for r in records:
        assert r["loss"] == pytest.approx(ref["losses"][r["step"]], abs=1e-4)
        assert r["grad_norm"] == pytest.approx(ref["norms"][r["step"]], rel=1e-4)  # the global norm, across the mesh
    assert max(r["grad_norm"] for r in records) > TRAIN.optimizer.clip_grad  # clipping was in play
    assert ref["max_param_diff"] < 1e-2 * TRAIN.optimizer.lr, ref["max_param_diff"]


def test_bf16_trains_and_activation_checkpointing_changes_nothing(reference):
    value = reference["values"][0]
    with_ac, without = value["bf16"][True], value["bf16"][False]
    assert with_ac == without  # recomputation gives the same numbers
    fp32 = {s: value["records"][s]["loss"] for s in (1, 2, 3)}
    assert all(abs(with_ac[s] - fp32[s]) < 0.05 for s in (1, 2, 3)) and with_ac[1] != fp32[1]  # bf16, really


def test_eval_loss_is_the_same_on_every_mesh_shape(reference):
    for value in reference["values"]:
        by_shard = value["eval_by_shard"]
        assert by_shard[1] == pytest.approx(by_shard[2], abs=1e-6) and by_shard[1] == pytest.approx(
            by_shard[4], abs=1e-6
        )
    assert len({v["eval_by_shard"][2] for v in reference["values"]}) == 1  # every rank reports the same mean


def test_same_global_batch_on_one_node_sees_the_same_samples(reference, tmp_path):
    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", training=GLOBAL, timeout_s=120)
    outcomes = launch(spec, tasks_per_node=[2], fn=train_recording, timeout_s=180)
    assert union_of_samples([o.value for o in outcomes]) == union_of_samples(reference["values"])
    diff = in_child(
        max_param_diff,
        tmp_path / "run" / "checkpoints" / "step-000006",
        reference["run_dir"] / "checkpoints" / "step-000006",
    )
    assert diff < 1e-2 * TRAIN.optimizer.lr, (
        diff
    )  # another reduction order: equal within float tolerance, not bit for bit


def test_preempted_run_resumes_bit_identical_on_the_same_mesh_and_with_the_same_samples_on_fewer_nodes(
    reference, tmp_path
):
    from tests.runtime_helpers import compare_checkpoints

    run = tmp_path / "run"
    spec = RunSpec(shard_size=2, run_dir=str(run), device="cpu", training=TRAIN, timeout_s=120)
    first = launch(spec, tasks_per_node=[2, 2], fn=train_signalled_at_3, timeout_s=180)
    assert {(o.value["summary"]["stopped"], o.value["summary"]["steps"]) for o in first} == {(True, 3)}
    assert [s for s, _ in complete_checkpoints(run)] == [3]
    fewer = tmp_path / "fewer"
    shutil.copytree(run, fewer)

    same = launch(
        spec, tasks_per_node=[2, 2], fn=train_recording, extra_env={"SLURM_RESTART_COUNT": "1"}, timeout_s=180
    )
    assert {o.value["summary"]["start_step"] for o in same} == {3}
    diffs = in_child(
        compare_checkpoints, run / "checkpoints" / "step-000006", reference["run_dir"] / "checkpoints" / "step-000006"
    )
    assert diffs == [], f"the preempted run differs from the uninterrupted one in {diffs[:5]}"
    assert [r["loss"] for r in read_jsonl(run / "metrics.jsonl")] == [
        r["loss"] for r in read_jsonl(reference["run_dir"] / "metrics.jsonl")
    ]
    before = union_of_samples([o.value for o in first])
    after = union_of_samples([o.value for o in same])
    assert {**before, **after} == union_of_samples(reference["values"])

    # the same run directory on 1 node x 2 with the same global batch: steps 4-6 see the same samples
    spec_fewer = RunSpec(shard_size=2, run_dir=str(fewer), device="cpu", training=GLOBAL, timeout_s=120)
    resumed = launch(spec_fewer, tasks_per_node=[2], fn=train_recording, timeout_s=180)
    assert "saved on mesh [2, 2], now [1, 2]" in resumed[0].log
    assert union_of_samples([o.value for o in resumed]) == {
        s: ids for s, ids in union_of_samples(reference["values"]).items() if s > 3
    }
    diff = in_child(
        max_param_diff, fewer / "checkpoints" / "step-000006", reference["run_dir"] / "checkpoints" / "step-000006"
    )
    assert diff < 1e-2 * TRAIN.optimizer.lr, diff


def test_resuming_with_another_global_batch_is_refused(reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference["run_dir"] / "checkpoints", run / "checkpoints")
    spec = RunSpec(
        shard_size=2,
        run_dir=str(run),
        device="cpu",
        training=TRAIN.replace(steps=8, grad_accum=1),
        timeout_s=60,
    )
    outcomes = launch(spec, tasks_per_node=[2, 2], timeout_s=120, expect_failure=True)
    for o in outcomes:
        assert (
            not o.ok
            and "DataError: checkpoint step-000006 (step 6) was trained with a global batch of 16 samples, "
            "this run has 8"
            in o.value
        )
        assert "--global-batch-size 16" in o.value


def test_the_live_line_shows_the_latest_eval_loss(tmp_path):
    import json

    from hpc_hsdp.cli.jobs_cmd import step_text
    from hpc_hsdp.rundir.training.metrics import latest_eval

    records = [
        {"step": 1, "loss": 4.0, "tokens_per_s": 10.0},
        {"step": 2, "loss": 3.5, "eval_loss": 3.75},
        {"step": 3, "loss": 3.25, "tokens_per_s": 12.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 4, "eval_lo')
    assert latest_eval(tmp_path) == (2, 3.75)
    assert step_text(records[2], 10, latest_eval(tmp_path)) == "step 3/10 loss 3.2500 eval 3.7500 (step 2) 12 tok/s"
    assert step_text(records[1], 10) == "step 2/10 loss 3.5000 eval 3.7500"
    assert step_text(records[0]) == "step 1 loss 4.0000 10 tok/s"
    assert latest_eval(tmp_path / "absent") is None
