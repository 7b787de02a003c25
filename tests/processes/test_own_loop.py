"""examples/own_loop.py: a transformers model trained by its own loop through
hpc_hsdp.TrainingRun passes the same preempt-requeue-resume test as the built-in loop."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
from dist_helpers import in_child, launch
from hf_helpers import TINY_LLAMA, make_corpus, write_config

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.task.checkpointing.checkpoint import complete_checkpoints

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)  # the ranks inherit it, as PYTHONPATH=examples would give them

pytestmark = pytest.mark.dist


def own_loop_main(ctx):
    import own_loop

    return own_loop.main(ctx)


def test_own_loop_trains_and_resumes_bit_identical_after_preemption(tmp_path):
    from tests.runtime_helpers import compare_checkpoints

    corpus = make_corpus(str(tmp_path / "data"), 320)
    model = write_config(tmp_path / "model", dict(TINY_LLAMA, vocab_size=320))
    training = TrainingSpec.of(
        model=f"hf:{model}",
        data=corpus["path"],
        seq_len=32,
        batch_size=2,
        grad_accum=2,
        steps=6,
        seed=2,
        lr=3e-3,
        lr_schedule="cosine",
        warmup_steps=2,
        checkpoint_every=2,
        keep_checkpoints=5,
    )
    whole = RunSpec(shard_size=2, run_dir=str(tmp_path / "whole"), device="cpu", training=training, timeout_s=120)
    done = launch(whole, tasks_per_node=[2, 2], fn=own_loop_main, timeout_s=300)
    assert {(o.value["steps"], o.value["stopped"]) for o in done} == {(6, False)}
    records = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert all("grad_norm" in r and r["world_size"] == 4 and r["global_batch"] == 16 for r in records)
    assert [s for s, _ in complete_checkpoints(tmp_path / "whole")] == [2, 4, 6]
    best = min(r["loss"] for r in records)
    assert {o.value["state"]["best_loss"] for o in done} == {best}

    # the warning signal on rank 3 during step 3: all ranks stop after it and save
    cut = dataclasses.replace(whole, run_dir=str(tmp_path / "cut"))
    first = launch(
        cut, tasks_per_node=[2, 2], fn=own_loop_main, extra_env={"HPC_HSDP_FAULT_SIGNAL_AT": "3:3"}, timeout_s=300
    )
    assert {(o.value["steps"], o.value["stop_reason"]) for o in first} == {(3, "USR2")}
    assert [s for s, _ in complete_checkpoints(tmp_path / "cut")] == [2, 3]
    saved = json.loads((tmp_path / "cut" / "checkpoints" / "step-000003" / "train_state.json").read_text())
    assert saved["extra"]["best_loss"] == min(r["loss"] for r in records[:3])
    shutil.copytree(tmp_path / "cut", tmp_path / "one-node")
    for run, tasks in ((tmp_path / "cut", [2, 2]), (tmp_path / "one-node", [4])):
        again = launch(
            dataclasses.replace(whole, run_dir=str(run)),
            tasks_per_node=tasks,
            fn=own_loop_main,
            extra_env={"SLURM_RESTART_COUNT": "1"},
            timeout_s=300,
        )
        assert {(o.value["start_step"], o.value["steps"]) for o in again} == {(3, 6)}
        assert {o.value["state"]["best_loss"] for o in again} == {best}
        diffs = in_child(
            compare_checkpoints, run / "checkpoints" / "step-000006", tmp_path / "whole" / "checkpoints" / "step-000006"
        )
        assert diffs == [], f"{tasks}: differs from the uninterrupted run in {diffs[:5]}"
        assert [r["loss"] for r in read_jsonl(run / "metrics.jsonl")] == [r["loss"] for r in records]
