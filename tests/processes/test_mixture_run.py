"""A mixture on real multi-process gloo: 2 nodes x 2 tasks train on ``web=...:0.7,code=...:0.3``
(two datasets written by prepare-data); a run stopped by a signal after step 3 and requeued
sees exactly the samples of an uninterrupted one, step by step; the metrics hold every
source's loss, tokens and held-out loss; the small source wraps and its epochs are recorded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import hpc
from dist_helpers import launch

from hpc_hsdp.data.prepare import PrepareSpec, prepare
from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.plan.mixture import parse_mixture, rows_of_step
from hpc_hsdp.rundir.files import read_jsonl
from tests.job_helpers import tiny_job
from tests.loop_helpers import train_recording, train_signalled_at_3, union_of_samples

pytestmark = pytest.mark.dist

STDLIB = Path(os.__file__).parent
SEQ = 32
GLOBAL = 8  # 4 ranks x 1 sample x 2 micro-batches


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixture")
    web = sorted(str(p) for p in STDLIB.glob("*.py"))[:12]
    (root / "code-text").mkdir()
    for i in range(12):  # a small source: it runs out within the run and wraps
        (root / "code-text" / f"{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}  # {'#' * (i % 5)}\n")
    out = {}
    for name, inputs in (("web", tuple(web)), ("code", (str(root / "code-text"),))):
        prepare(PrepareSpec(inputs=inputs, output=str(root / name), val_fraction=0.3, workers=1))
        out[name] = root / name
    return out


def training_on(sources) -> TrainingSpec:
    return TrainingSpec.of(
        data=f"web={sources['web']}:0.7,code={sources['code']}:0.3",
        layers=1,
        width=32,
        heads=2,
        seq_len=SEQ,
        batch_size=1,
        grad_accum=2,
        steps=8,
        seed=5,
        lr=3e-3,
        eval_every=4,
        eval_batches=1,
    )


def test_a_stopped_and_requeued_mixture_sees_the_samples_of_an_uninterrupted_one(sources, tmp_path):
    training = training_on(sources)
    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "whole"), device="cpu", training=training, timeout_s=120)
    whole = launch(spec, tasks_per_node=[2, 2], fn=train_recording, timeout_s=300)
    reference = union_of_samples([o.value for o in whole])
    assert sorted(reference) == list(range(1, 9)) and all(len(ids) == GLOBAL for ids in reference.values())

    run = tmp_path / "stopped"
    spec = RunSpec(shard_size=2, run_dir=str(run), device="cpu", training=training, timeout_s=120)
    first = launch(spec, tasks_per_node=[2, 2], fn=train_signalled_at_3, timeout_s=300)
    assert {(o.value["summary"]["stop_reason"], o.value["summary"]["steps"]) for o in first} == {("USR2", 3)}
    state = json.loads((run / "checkpoints" / "step-000003" / "train_state.json").read_text())
    mixture = parse_mixture(training.dataset.data)
    assert (
        state["data"]["sources"]["web"]["samples_consumed"] + state["data"]["sources"]["code"]["samples_consumed"]
        == 3 * GLOBAL
    )
    requeued = launch(
        spec, tasks_per_node=[2, 2], fn=train_recording, extra_env={"SLURM_RESTART_COUNT": "1"}, timeout_s=300
    )
    assert "resumed from step 3 (restart 1)" in requeued[0].log
    assert sorted(union_of_samples([o.value for o in requeued])) == list(range(4, 9))
    resumed = {**union_of_samples([o.value for o in first]), **union_of_samples([o.value for o in requeued])}
    assert resumed == reference  # step by step, the very sample ids (per source: offset + sample)

    # the metrics: per-source loss, tokens and epochs on every step; eval per source on steps 4 and 8
    records = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    for record in records:
        rows = rows_of_step(mixture, record["step"], GLOBAL)
        assert (record["tokens/web"], record["tokens/code"]) == (rows[0] * SEQ, rows[1] * SEQ)
        present = [(n, count) for n, count in zip(("web", "code"), rows) if count]
        assert all(f"loss/{n}" in record for n, _ in present)
        weighted = sum(record[f"loss/{n}"] * count for n, count in present) / GLOBAL
        assert weighted == pytest.approx(record["loss"], rel=1e-4)  # the sources' losses make up the loss
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    for r in evals:
        assert {"eval_loss/web", "eval_loss/code"} <= r.keys()
        assert r["eval_loss"] == pytest.approx(0.7 * r["eval_loss/web"] + 0.3 * r["eval_loss/code"])
    assert read_jsonl(run / "metrics.jsonl")[-1]["eval_loss/code"] == records[-1]["eval_loss/code"]
    final = json.loads((tmp_path / "whole" / "checkpoints" / "step-000008" / "train_state.json").read_text())
    code = final["data"]["sources"]["code"]
    assert code["epoch"] >= 1 and code["epoch"] == code["samples_consumed"] // code["num_samples"]
    assert records[-1]["epoch/code"] == code["epoch"]  # the small source wrapped, and says so

    # the existing reader draws the run: the per-source keys are beside the known ones, not in their way
    from hpc_hsdp.cli import main

    with pytest.raises(SystemExit) as done:
        main(["report", str(tmp_path / "whole")])
    assert done.value.code in (0, None) and (tmp_path / "whole" / "report.html").stat().st_size > 0


@pytest.mark.timeout(240)
def test_submit_says_when_each_source_is_used_once_and_the_job_trains_on_the_mixture(sources, tmp_path):
    run = tmp_path / "run"
    mixture = f"web={sources['web']}:0.7,code={sources['code']}:0.3"
    out = hpc(
        *("submit", "--cluster", "local", "--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--device", "cpu"),
        *("--steps", "3", "--wait", "--run-dir", str(run), "--data", mixture),
        *tiny_job(heads=2, seq_len=32, vocab_size=None),
        timeout=200,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "data mixture: web (70% of each batch, " in out.stderr and "code (30% of each batch, " in out.stderr
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["tokens/web"] + r["tokens/code"] == 4 * SEQ and "loss/web" in r for r in records)
