"""Preemption on real gloo processes: one rank gets the signal, all save at the same step, the
resumed run is bit-identical."""

from __future__ import annotations

import os
import signal

import pytest
from dist_helpers import in_child, launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.task.checkpointing.checkpoint import complete_checkpoints

TINY = TrainingSpec.of(
    layers=1,
    width=32,
    heads=4,
    seq_len=8,
    batch_size=2,
    vocab_size=64,
    steps=6,
    seed=5,
    checkpoint_every=0,
    keep_checkpoints=2,
)


# ----------------------------------------------------------------------------- several ranks (gloo, fork)


def train_with_signal_on_rank3(ctx):
    """fn: the payload, with SIGUSR2 delivered to rank 3 only, before step 3's all_reduce (in which
    the ranks agree on their signals)."""
    from hpc_hsdp.task.training.loop import train

    def on_step(step, record):
        if step == 2 and ctx.rank == 3:
            os.kill(os.getpid(), signal.SIGUSR2)

    result = train(ctx, on_step=on_step)
    return dict(result.summary(ctx), received=sorted(ctx.preemption.received))


@pytest.mark.dist
def test_one_rank_signalled_every_rank_saves_at_the_same_step_and_resume_is_exact(tmp_path):
    from tests.runtime_helpers import compare_checkpoints

    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", training=TINY, timeout_s=60)
    first = launch(spec, tasks_per_node=[2, 2], fn=train_with_signal_on_rank3, timeout_s=120)
    by_rank = {o.value["rank"]: o.value for o in first}
    assert {r: (v["stopped"], v["stop_reason"], v["steps"]) for r, v in by_rank.items()} == {
        r: (True, "USR2", 3) for r in range(4)
    }
    assert by_rank[3]["received"] == ["USR2"] and all(by_rank[r]["received"] == [] for r in (0, 1, 2))
    assert [s for s, _ in complete_checkpoints(spec.run_dir)] == [3]
    log0 = next(o.log for o in first if o.value["rank"] == 0)
    assert "every rank stops after step 3 and saves" in log0 and "requeue skipped: not in a SLURM job" in log0

    second = launch(spec, tasks_per_node=[2, 2], extra_env={"SLURM_RESTART_COUNT": "1"}, timeout_s=120)
    assert {(o.value["start_step"], o.value["steps"], o.value["stopped"]) for o in second} == {(3, 6, False)}
    assert "resumed from step 3 (restart 1)" in second[0].log
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]

    reference = RunSpec(shard_size=2, run_dir=str(tmp_path / "ref"), device="cpu", training=TINY, timeout_s=60)
    launch(reference, tasks_per_node=[2, 2], timeout_s=120)
    diffs = in_child(
        compare_checkpoints,
        tmp_path / "run" / "checkpoints" / "step-000006",
        tmp_path / "ref" / "checkpoints" / "step-000006",
    )
    assert diffs == [], f"the interrupted run differs from the uninterrupted one in {diffs[:5]}"
    ref_losses = [r["loss"] for r in read_jsonl(tmp_path / "ref" / "metrics.jsonl")]
    assert [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == ref_losses


# ----------------------------------------------------------------------------- the real dev SLURM cluster
