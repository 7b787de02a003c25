"""Hugging Face models under the one training loop, on a real corpus (standard-library
source tokenised by a BPE trained on it): 2 nodes x 2 tasks, shard 2. They train, each
rank holds 1/S; preempted and resumed (same mesh, and onto one node) they end bit-identical
to an uninterrupted run; pretrained weights give transformers' own first loss; export
loads back in transformers with the same logits."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from cli_helpers import hpc
from dist_helpers import in_child, job_envs, launch
from hf_helpers import (
    TINY_GPT2,
    TINY_LLAMA,
    exported_logits,
    first_step_reference,
    make_corpus,
    save_pretrained_tiny,
    train_hf,
    train_hf_signalled_at_3,
    write_config,
)

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.task.checkpointing.checkpoint import complete_checkpoints

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 320
# GPT-2 keeps its default dropout (0.1): the loop seeds each step's RNG by (seed, step, rank)
ARCHS = {
    "llama": dict(TINY_LLAMA, vocab_size=VOCAB),
    "gpt2": {k: v for k, v in TINY_GPT2.items() if "pdrop" not in k} | {"vocab_size": VOCAB},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("corpus") / "data"), VOCAB)


def _training(model: str, corpus: dict, **more) -> TrainingSpec:
    values = dict(
        model=model,
        data=corpus["path"],
        seq_len=32,
        batch_size=2,
        steps=6,
        seed=3,
        lr=3e-3,
        checkpoint_every=3,
        keep_checkpoints=3,
        precision="fp32",
    )
    return TrainingSpec.of(**(values | more))


@pytest.fixture(scope="module", params=sorted(ARCHS))
def uninterrupted(request, tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = write_config(root / "model", ARCHS[request.param])
    training = _training(f"hf:{model_dir}", corpus)
    spec = RunSpec(shard_size=2, run_dir=str(root / "run"), device="cpu", training=training, timeout_s=120)
    outcomes = launch(spec, tasks_per_node=[2, 2], fn=train_hf, timeout_s=300)
    return {"arch": request.param, "spec": spec, "run_dir": root / "run", "values": [o.value for o in outcomes]}


def test_trains_on_the_corpus_with_one_shard_per_rank(uninterrupted):
    values = uninterrupted["values"]
    records = read_jsonl(uninterrupted["run_dir"] / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] < records[0]["loss"] - 0.3, [r["loss"] for r in records]
    total = values[0]["total_numel"]
    assert all(abs(v["local_numel"] - total / 2) <= 0.02 * total for v in values)
    assert sum(v["local_numel"] for v in values) == 2 * total  # two replicas of one model
    model = json.loads((uninterrupted["run_dir"] / "model.json").read_text())
    assert model["adapter"]["kind"] == "hf" and model["adapter"]["config"]["model_type"] == uninterrupted["arch"]


def test_preempt_requeue_resume_is_bit_identical_also_onto_one_node(uninterrupted, tmp_path):
    from tests.runtime_helpers import compare_checkpoints

    spec = dataclasses.replace(uninterrupted["spec"], run_dir=str(tmp_path / "run"))
    first = launch(spec, tasks_per_node=[2, 2], fn=train_hf_signalled_at_3, timeout_s=300)
    assert {(o.value["summary"]["stopped"], o.value["summary"]["steps"]) for o in first} == {(True, 3)}
    shutil.copytree(tmp_path / "run", tmp_path / "one-node")
    reference = uninterrupted["run_dir"] / "checkpoints" / "step-000006"
    for run, tasks in ((tmp_path / "run", [2, 2]), (tmp_path / "one-node", [4])):
        resumed = launch(
            dataclasses.replace(spec, run_dir=str(run)),
            tasks_per_node=tasks,
            fn=train_hf,
            extra_env={"SLURM_RESTART_COUNT": "1"},
            timeout_s=300,
        )
        assert {o.value["summary"]["start_step"] for o in resumed} == {3}
        diffs = in_child(compare_checkpoints, run / "checkpoints" / "step-000006", reference)
        assert diffs == [], f"{tasks}: the resumed run differs from the uninterrupted one in {diffs[:5]}"
        assert [r["loss"] for r in read_jsonl(run / "metrics.jsonl")] == [
            r["loss"] for r in read_jsonl(uninterrupted["run_dir"] / "metrics.jsonl")
        ]


def test_export_loads_in_transformers_with_the_sharded_models_logits(uninterrupted, tmp_path):
    out = tmp_path / "exported"
    done = hpc("export", str(uninterrupted["run_dir"]), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "exported step 6 (hf)" in done.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    loaded = in_child(exported_logits, str(out))
    sharded = next(v["logits"] for v in uninterrupted["values"] if v["logits"] is not None)
    import torch

    assert torch.allclose(torch.tensor(loaded["logits"]), torch.tensor(sharded), atol=1e-5, rtol=0)
    assert loaded["decoded"] == "def f(x):\n    return x"  # the run's tokenizer, copied beside the weights
    again = hpc("export", str(uninterrupted["run_dir"]), "--step", "4", "-o", str(tmp_path / "other"))
    assert (
        again.returncode == 2
        and again.stderr.strip().splitlines() == [again.stderr.strip()]
        and "no complete checkpoint of step 4; it has steps 3, 6" in again.stderr
    )


def test_pretrained_first_step_loss_is_the_unsharded_models(corpus, tmp_path):
    model_dir = in_child(save_pretrained_tiny, str(tmp_path / "pretrained"), ARCHS["llama"])
    training = _training(f"hf:{model_dir}", corpus, steps=1, checkpoint_every=0)
    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", training=training, timeout_s=120)
    values = [o.value for o in launch(spec, tasks_per_node=[2, 2], fn=train_hf, timeout_s=300)]
    samples = sorted(i for v in values for micro in v["records"][1]["sample_ids"] for i in micro)
    assert len(samples) == 8
    expected = in_child(first_step_reference, model_dir, corpus["path"], 32, samples)
    assert abs(values[0]["records"][1]["loss"] - expected) < 1e-6, (values[0]["records"][1]["loss"], expected)


def test_bad_models_on_the_command_line_exit_2_with_one_line(corpus, tmp_path):
    small_vocab = write_config(tmp_path / "small", dict(TINY_LLAMA, vocab_size=100))
    env = {**job_envs(tasks_per_node=[1])[0], "OMP_NUM_THREADS": "1"}
    cases = {
        f"hf:{tmp_path / 'nothing-here'}": "does not exist",
        "hf:gpt2": "looks like a hub model id, and nothing is downloaded",
        f"hf:{small_vocab}": "vocabulary of 100 tokens but the data's tokenizer has",
        "no_such_pkg_abc:build": "cannot import module 'no_such_pkg_abc'",
    }
    for model, expected in cases.items():
        args = [
            "run",
            "--shard",
            "1",
            "--run-dir",
            str(tmp_path / "run"),
            "--device",
            "cpu",
            "--timeout",
            "30",
            "--model",
            model,
            "--data",
            corpus["path"],
        ]
        done = hpc(*args, env=env, timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.startswith("hpc-hsdp: error:")]
        assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], (model, done.stderr[-800:])
        assert "Traceback" not in done.stderr
    assert not complete_checkpoints(tmp_path / "run")
