"""End to end on a real corpus: the Python standard library's own source, tokenised by
``hpc-hsdp prepare-data`` with a byte-level BPE trained in the test (module-scoped).

2 nodes x 2 tasks train with bf16, accumulation, clipping and a cosine schedule with
warm-up; the eval loss falls. A run stopped by a signal and resumed on the same mesh ends
bit-identical to the uninterrupted one; resumed on 1 node x 2 with the same global batch
it trains on exactly the same samples. Bad data exits 2 with one line before any step.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_helpers import hpc
from dist_helpers import in_child, job_envs, launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.task.checkpointing.checkpoint import complete_checkpoints
from tests.loop_helpers import max_param_diff, train_recording, train_signalled_at_3, union_of_samples

pytestmark = pytest.mark.dist

STDLIB = Path(os.__file__).parent
VOCAB = 512


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """60 standard-library modules (about 1.5 MB of Python), a 512-id BPE, 10 % held out."""
    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    files = sorted(str(p) for p in STDLIB.glob("*.py"))[:60]
    done = hpc(
        "prepare-data",
        *files,
        "-o",
        str(out),
        "--train-tokenizer",
        str(VOCAB),
        "--val-fraction",
        "0.1",
        "--workers",
        "1",
        env={"OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    manifest = json.loads((out / "dataset.json").read_text())
    assert manifest["vocab_size"] == VOCAB and manifest["splits"]["val"]
    return out


def training_on(corpus: Path) -> TrainingSpec:
    # 4 ranks x 2 samples x 2 micro-batches: a global batch of 16 samples of 64 tokens
    return TrainingSpec.of(
        data=str(corpus),
        layers=2,
        width=64,
        heads=4,
        seq_len=64,
        batch_size=2,
        grad_accum=2,
        steps=8,
        seed=2,
        lr=3e-3,
        weight_decay=0.01,
        lr_schedule="cosine",
        warmup_steps=2,
        min_lr=3e-4,
        clip_grad=1.0,
        precision="bf16",
        eval_every=4,
        eval_batches=2,
        keep_checkpoints=3,
    )


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("real") / "run"
    spec = RunSpec(shard_size=2, run_dir=str(run_dir), device="cpu", training=training_on(corpus), timeout_s=120)
    outcomes = launch(spec, tasks_per_node=[2, 2], fn=train_recording, timeout_s=300)
    return {"run_dir": run_dir, "values": [o.value for o in outcomes]}


def test_bf16_accumulation_clipping_cosine_on_two_nodes_and_the_eval_loss_falls(corpus, uninterrupted):
    records = read_jsonl(uninterrupted["run_dir"] / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    assert {(r["precision"], r["grad_accum"], r["global_batch"], r["world_size"]) for r in records} == {
        ("bf16", 2, 16, 4)
    }
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [s for s, _ in evals] == [4, 8] and evals[1][1] < evals[0][1] < records[0]["loss"]
    assert records[-1]["lr"] == pytest.approx(3e-4) and records[0]["lr"] == pytest.approx(1.5e-3)
    assert records[0]["loss"] == pytest.approx(float(__import__("math").log(VOCAB)), abs=0.3)  # starts at chance
    assert all(r["tokens_seen"] == r["step"] * 16 * 64 for r in records)
    sample_ids = union_of_samples(uninterrupted["values"])
    assert all(len(ids) == len(set(ids)) == 16 for ids in sample_ids.values())
    state = json.loads((uninterrupted["run_dir"] / "checkpoints" / "step-000008" / "train_state.json").read_text())
    assert state["data"]["samples_consumed"] == 8 * 16 and state["data"]["global_batch"] == 16
    assert state["data"]["seed"] == 2 and state["data"]["source"] == str(corpus)


def test_preempt_requeue_resume_sees_the_same_samples_and_ends_with_the_same_checkpoint(
    corpus, uninterrupted, tmp_path
):
    from tests.runtime_helpers import compare_checkpoints

    training = training_on(corpus)
    run = tmp_path / "run"
    spec = RunSpec(shard_size=2, run_dir=str(run), device="cpu", training=training, timeout_s=120)
    first = launch(spec, tasks_per_node=[2, 2], fn=train_signalled_at_3, timeout_s=300)
    assert {(o.value["summary"]["stop_reason"], o.value["summary"]["steps"]) for o in first} == {("USR2", 3)}
    other_shape = tmp_path / "other"
    shutil.copytree(run, other_shape)

    requeued = launch(
        spec, tasks_per_node=[2, 2], fn=train_recording, extra_env={"SLURM_RESTART_COUNT": "1"}, timeout_s=300
    )
    assert "resumed from step 3 (restart 1)" in requeued[0].log
    reference = union_of_samples(uninterrupted["values"])
    assert {**union_of_samples([o.value for o in first]), **union_of_samples([o.value for o in requeued])} == reference
    diffs = in_child(
        compare_checkpoints,
        run / "checkpoints" / "step-000008",
        uninterrupted["run_dir"] / "checkpoints" / "step-000008",
    )
    assert diffs == [], f"the requeued run differs from the uninterrupted one in {diffs[:5]}"
    assert (
        read_jsonl(run / "metrics.jsonl")[-1]["eval_loss"]
        == read_jsonl(uninterrupted["run_dir"] / "metrics.jsonl")[-1]["eval_loss"]
    )

    # the same run directory on 1 node x 2, the same global batch: exactly the same samples
    fewer = training.replace(batch_size=4, global_batch_size=16)
    spec = RunSpec(shard_size=2, run_dir=str(other_shape), device="cpu", training=fewer, timeout_s=120)
    resumed = launch(spec, tasks_per_node=[2], fn=train_recording, timeout_s=300)
    assert "saved on mesh [2, 2], now [1, 2]" in resumed[0].log
    assert union_of_samples([o.value for o in resumed]) == {s: ids for s, ids in reference.items() if s > 3}
    assert [s for s, _ in complete_checkpoints(other_shape)][-1] == 8
    # bf16 compute on other micro-batch shapes: equal within bf16 tolerance, not bit for bit
    diff = in_child(
        max_param_diff,
        other_shape / "checkpoints" / "step-000008",
        uninterrupted["run_dir"] / "checkpoints" / "step-000008",
    )
    assert diff < 3 * training.optimizer.lr, diff
    final = read_jsonl(other_shape / "metrics.jsonl")[-1]["eval_loss"]
    assert final == pytest.approx(read_jsonl(uninterrupted["run_dir"] / "metrics.jsonl")[-1]["eval_loss"], abs=0.02)


def _run_one_task(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**job_envs(tasks_per_node=[1])[0], "OMP_NUM_THREADS": "1"}
    return hpc("run", "--shard", "1", "--run-dir", str(run_dir), "--device", "cpu", "--timeout", "60", *args, env=env)


def test_fewer_samples_than_one_global_batch_exits_2_before_any_step(corpus, tmp_path):
    done = _run_one_task(tmp_path, "--data", str(corpus), "--seq-len", "64", "--global-batch-size", "1000000")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hpc-hsdp: error: token data") and "fewer than one global batch of 1000000" in last
    assert "Traceback" not in done.stderr and not (tmp_path / "metrics.jsonl").exists()


def test_eval_without_held_out_data_exits_2(corpus, tmp_path):
    one_file = next(corpus.glob("train/*.bin"))
    done = _run_one_task(tmp_path, "--data", str(one_file), "--eval-every", "2")
    assert done.returncode == 2, done.stderr
    assert "no held-out split" in done.stderr.strip().splitlines()[-1] and "Traceback" not in done.stderr


def test_resuming_with_another_global_batch_exits_2(corpus, uninterrupted, tmp_path):
    shutil.copytree(uninterrupted["run_dir"] / "checkpoints", tmp_path / "checkpoints")
    done = _run_one_task(
        tmp_path, "--data", str(corpus), "--seq-len", "64", "--steps", "10", "--global-batch-size", "8"
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hpc-hsdp: error: checkpoint step-000008 (step 8) was trained with a global batch of 16")
    assert "--global-batch-size 16" in last and "Traceback" not in done.stderr


def train_with_a_small_vocabulary(ctx):
    from hpc_hsdp.models.builtin import BuiltinAdapter, ModelConfig
    from hpc_hsdp.task.training.loop import train

    training = ctx.spec.training
    adapter = BuiltinAdapter(ModelConfig(vocab_size=100, seq_len=training.dataset.seq_len, width=32, heads=4, layers=1))
    train(ctx, training, adapter=adapter)


def test_token_ids_beyond_the_models_vocabulary_are_refused_before_step_1(corpus, tmp_path):
    training = TrainingSpec.of(data=str(corpus), layers=1, width=32, heads=4, seq_len=64, batch_size=2, steps=2)
    spec = RunSpec(shard_size=1, run_dir=str(tmp_path), device="cpu", training=training, timeout_s=60)
    outcomes = launch(spec, tasks_per_node=[1], fn=train_with_a_small_vocabulary, expect_failure=True, timeout_s=120)
    assert outcomes[0].value.startswith("DataError: token data ")
    assert f"holds token id {VOCAB - 1} but the model's vocabulary has 100 ids" in outcomes[0].value
    assert not (tmp_path / "metrics.jsonl").exists()
