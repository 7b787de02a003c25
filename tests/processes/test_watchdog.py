"""The hang watchdog (issue 13), one rank of four frozen on real gloo processes: every rank dumps its
stacks, rank 0 names the step and the rank that never reached the collective, every task exits with
EXIT_HUNG within the timeout plus the gathering time, not the process-group timeout."""

from __future__ import annotations

import re
import time

import pytest
from dist_helpers import launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.task.resilience.watchdog import EXIT_HUNG, GATHER_S

TINY = TrainingSpec.of(
    layers=1,
    width=32,
    heads=4,
    seq_len=8,
    batch_size=2,
    vocab_size=64,
    steps=40,
    seed=1,
    checkpoint_every=2,
    hang_timeout=6.0,
)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_one_frozen_rank_of_four_ends_the_job_with_stacks_and_one_line(tmp_path):
    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", training=TINY, timeout_s=120)
    started = time.monotonic()
    out = launch(
        spec, tasks_per_node=[2, 2], extra_env={"HPC_HSDP_FAULT_FREEZE_AT": "2:3"}, timeout_s=200, expect_failure=True
    )
    elapsed = time.monotonic() - started
    assert [o.value for o in out] == [f"task {i} died with exit code {EXIT_HUNG}" for i in range(4)], [
        o.value for o in out
    ]
    # bounded by the hang timeout and the gathering, far below the 120 s process-group timeout
    assert elapsed < 6 + GATHER_S + 60, elapsed
    logs = {o.procid: o.log for o in out}
    line = next(line for line in logs[0].splitlines() if "hang at step" in line)
    assert re.fullmatch(
        r"\[hpc-hsdp\] hang at step 3: no step completed within 6 s; ranks 0-1,3 wait in a collective "
        r"\(furthest: #\d+ \w+\); ranks 2 never reached it \(rank 2 at injected_faults.py:\d+ in at_step\); "
        r"not in a SLURM job: not requeued; resubmit with the same --run-dir to resume",
        line,
    ), line
    for procid, log in logs.items():
        assert f"watchdog: rank {procid}: no step completed for" in log
        assert "Thread 0x" in log or "Current thread 0x" in log  # faulthandler's stacks of every thread
    assert "in at_step" in logs[2] and "injected_faults.py" in logs[2]  # the frozen rank's stack shows where it is
    assert "distributed" in logs[0]  # the others wait inside torch.distributed
    for procid in (1, 2, 3):
        assert "hang at step 3" in next(line for line in logs[procid].splitlines() if "stacks above" in line)
    # the checkpoint of step 2 (written in the background) is whole: the restart resumes from it
    from hpc_hsdp.rundir.checkpointing.state import run_dir_state

    assert run_dir_state(tmp_path / "run").resume_step == 2
