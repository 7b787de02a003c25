"""Both faces of the one engine meet every fault the same way: the built-in loop (``train``)
and an own loop written here on ``hpc_hsdp.TrainingRun`` (started as ``--entry
tests.processes.test_engine_faults:own_loop``), each on real gloo processes of two one-task nodes:

- a rank frozen at the start of a step, with ``--hang-timeout``: every rank writes its stacks,
  rank 0 names the frozen rank in one line, all end with EXIT_HUNG within the same bound;
- the warning signal on one rank: every rank stops after that step and saves; the restart
  resumes and ends bit-identical to the uninterrupted run;
- a damaged newest checkpoint: the restart falls back to the one before and redoes the steps
  exactly;
- a node dying (one rank SIGKILLed, its slurmd unreachable through a stand-in ``scontrol``):
  the survivor requeues the job without that node and records why.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
from dist_helpers import in_child, launch

import hpc_hsdp
from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.checkpointing.state import complete_checkpoints, run_dir_state
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.rundir.lifecycle import attempts
from hpc_hsdp.task.resilience.watchdog import EXIT_HUNG, GATHER_S
from tests.runtime_helpers import compare_checkpoints

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


NODES = [1, 1]  # two nodes of one task: rank 1 is alone on n2
TINY = TrainingSpec.of(
    layers=1,
    width=32,
    heads=4,
    seq_len=8,
    batch_size=2,
    vocab_size=64,
    steps=6,
    seed=5,
    checkpoint_every=2,
    keep_checkpoints=5,
)
HANG_TIMEOUT_S = 6.0


def own_loop(ctx):
    """The smallest own loop: what the module docstring of ``hpc_hsdp.task.training.own_loop`` shows."""
    run = hpc_hsdp.TrainingRun(ctx)
    for step in run.steps():
        for batch in step.batches:
            loss = run.loss(batch.inputs, batch.targets)
            (loss / len(step.batches)).backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.log(step, loss=loss)
    return run.finish()


ENTRIES = {"builtin": None, "own": f"{__name__}:own_loop"}


@pytest.fixture(scope="module", params=sorted(ENTRIES))
def loop(request) -> str:
    return request.param


def spec_for(loop: str, run_dir: Path, **training) -> RunSpec:
    return RunSpec(
        shard_size=1,
        run_dir=str(run_dir),
        device="cpu",
        training=TINY.replace(**training),
        timeout_s=60,
        entry=ENTRIES[loop],
    )


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def rank0_log(outcomes) -> str:
    return next(o.log for o in outcomes if o.procid == 0)


@pytest.fixture(scope="module")
def reference(loop, tmp_path_factory) -> Path:
    """The uninterrupted run of each loop: 6 steps, checkpoints at 2, 4 (in the background) and 6."""
    run = tmp_path_factory.mktemp(f"reference-{loop}") / "run"
    done = launch(spec_for(loop, run), tasks_per_node=NODES, timeout_s=180)
    assert {(o.value["start_step"], o.value["steps"], o.value["stopped"]) for o in done} == {(0, 6, False)}
    assert [s for s, _ in complete_checkpoints(run)] == [2, 4, 6]
    assert "(writing in the background)" in rank0_log(done)
    return run


def test_a_frozen_rank_ends_the_job_with_every_ranks_stacks(loop, tmp_path):
    spec = spec_for(loop, tmp_path / "run", steps=40, hang_timeout=HANG_TIMEOUT_S)
    started = time.monotonic()
    out = launch(
        spec, tasks_per_node=NODES, extra_env={"HPC_HSDP_FAULT_FREEZE_AT": "1:3"}, timeout_s=200, expect_failure=True
    )
    elapsed = time.monotonic() - started
    assert [o.value for o in out] == [f"task {i} died with exit code {EXIT_HUNG}" for i in range(2)]
    assert elapsed < HANG_TIMEOUT_S + GATHER_S + 60, elapsed  # far below the 60 s process-group timeout + start
    logs = {o.procid: o.log for o in out}
    line = next(line for line in logs[0].splitlines() if "hang at step" in line)
    assert re.fullmatch(
        r"\[hpc-hsdp\] hang at step 3: no step completed within 6 s; ranks 0 wait in a collective "
        r"\(furthest: #\d+ \w+\); ranks 1 never reached it \(rank 1 at injected_faults.py:\d+ in at_step\); "
        r"not in a SLURM job: not requeued; resubmit with the same --run-dir to resume",
        line,
    ), line
    for procid, log in logs.items():
        assert f"watchdog: rank {procid}: no step completed for" in log
        assert "Thread 0x" in log or "Current thread 0x" in log  # faulthandler's stacks of every thread
    assert "hang at step 3" in next(line for line in logs[1].splitlines() if "stacks above" in line)
    assert run_dir_state(tmp_path / "run").resume_step == 2  # the background save of step 2 is whole


def test_a_stop_signal_saves_everywhere_and_the_restart_is_bit_identical(loop, reference, tmp_path):
    run = tmp_path / "run"
    first = launch(
        spec_for(loop, run), tasks_per_node=NODES, extra_env={"HPC_HSDP_FAULT_SIGNAL_AT": "1:3"}, timeout_s=180
    )
    assert {(o.value["steps"], o.value["stopped"], o.value["stop_reason"]) for o in first} == {(3, True, "USR2")}
    assert "USR2: every rank stops after step 3 and saves" in rank0_log(first)
    assert [s for s, _ in complete_checkpoints(run)] == [2, 3]
    again = launch(spec_for(loop, run), tasks_per_node=NODES, extra_env={"SLURM_RESTART_COUNT": "1"}, timeout_s=180)
    assert {(o.value["start_step"], o.value["steps"]) for o in again} == {(3, 6)}
    assert "resumed from step 3 (restart 1)" in rank0_log(again)
    assert losses(run) == losses(reference)
    final = "checkpoints/step-000006"
    assert in_child(compare_checkpoints, run / final, reference / final) == []


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(loop, reference, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shard = run / "checkpoints" / "step-000006" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])
    again = launch(spec_for(loop, run), tasks_per_node=NODES, timeout_s=180)
    log = rank0_log(again)
    assert f"warning: checkpoint {shard.parent} is damaged (__1_0.distcp has" in log, log
    assert "resumed from step 4" in log
    assert {(o.value["start_step"], o.value["steps"]) for o in again} == {(4, 6)}
    assert losses(run) == losses(reference)  # steps 5 and 6 redone exactly


def test_a_dead_node_is_left_behind_by_the_requeue(loop, fake_scontrol, tmp_path):
    run = tmp_path / "run"
    env = {"HPC_HSDP_FAULT_KILL_AT": "1:5", "SLURM_CLUSTER_NAME": "dev"}  # rank 1 dies with its node n2
    out = launch(
        spec_for(loop, run, max_restarts=2), tasks_per_node=NODES, extra_env=env, timeout_s=180, expect_failure=True
    )
    assert out[1].value == "task 1 died with exit code -9"
    assert not out[0].ok
    line = next(line for line in out[0].log.splitlines() if "slurmd unreachable" in line)
    assert re.fullmatch(
        r"\[hpc-hsdp\] node n2 died \(slurmd unreachable\) with ranks 1-1; the step failed: \w+: .*; "
        r"requeued job 4242 without n2 \(failure restart 1 of at most 2\)",
        line,
    ), line
    assert fake_scontrol.read_text().splitlines() == [
        "requeuehold 4242",
        "update JobId=4242 ExcNodeList=n2",
        "release 4242",
    ]
    ended = attempts.read_attempt(run)["ended"]  # the next attempt's restarts.jsonl line carries it
    assert ended["reason"] == "node_failure" and ended["detail"].startswith("node n2 died"), ended
    # step 2's background save was committed before step 4's began; step 4's may have died with rank 1
    assert run_dir_state(run).resume_step in (2, 4)
