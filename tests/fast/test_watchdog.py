"""The hang watchdog (issue 13): the one line from the ranks' reports (table-driven), the
timeout rule, and one rank of four frozen on real gloo processes: every rank dumps its stacks,
rank 0 names the step and the rank that never reached the collective, every task exits with
EXIT_HUNG within the timeout plus the gathering time, not the process-group timeout."""

from __future__ import annotations

import re
import time

import pytest
from dist_helpers import launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.runtime.watchdog import EXIT_HUNG, GATHER_S, HANG_TIMEOUT_FLOOR_S, describe_hang, hang_timeout


@pytest.mark.parametrize(
    ("reports", "world", "expected"),
    [
        (
            {
                0: {"step": 2, "collectives": 26, "kind": "all_reduce", "waiting": True},
                1: {"step": 2, "collectives": 26, "kind": "all_reduce", "waiting": True},
                2: {"step": 2, "collectives": 24, "waiting": False, "where": "data.py:12 in read"},
                3: {"step": 2, "collectives": 25, "kind": "all_gather_into_tensor", "waiting": True},
            },
            4,
            "hang at step 3: no step completed within 5 s; ranks 0-1,3 wait in a collective (furthest: #26 all_reduce); "
            "ranks 2 never reached it (rank 2 at data.py:12 in read)",
        ),
        (
            {0: {"step": 7, "collectives": 30, "waiting": True}, 1: {"step": 7, "collectives": 30, "waiting": True}},
            4,
            "hang at step 8: no step completed within 5 s; ranks 0-1 wait in a collective (furthest: #30); ranks 2-3 did "
            "not answer (dead or frozen)",
        ),
        (
            {
                0: {"step": 1, "collectives": 4, "kind": "all_reduce", "waiting": True},
                1: {"step": 1, "collectives": 4, "kind": "all_reduce", "waiting": True},
            },
            2,
            "hang at step 2: no step completed within 5 s; ranks 0-1 wait in a collective (furthest: #4 all_reduce) "
            "(every rank: a collective that never completes, a network or GPU fault)",
        ),
        (
            {0: {"step": 4, "collectives": 9, "waiting": False, "where": "loop.py:3 in f"}},
            1,
            "hang at step 5: no step completed within 5 s; ranks 0 never reached it (rank 0 at loop.py:3 in f)",
        ),
        ({}, 2, "hang: no step completed within 5 s and no rank reported"),
    ],
)
def test_the_hang_line(reports, world, expected):
    assert describe_hang(reports, world, timeout_s=5) == expected


@pytest.mark.parametrize(
    ("configured", "step_times", "expected"),
    [
        (7.5, [100.0], 7.5),
        (7.5, [], HANG_TIMEOUT_FLOOR_S),
        (0, [], HANG_TIMEOUT_FLOOR_S),
        (0, [0.1, 0.2, 0.3], HANG_TIMEOUT_FLOOR_S),
        (0, [10.0, 12.0, 50.0], 240.0),
    ],
)
def test_the_timeout_is_given_or_a_multiple_of_the_step_time_with_a_floor(configured, step_times, expected):
    assert hang_timeout(configured, step_times) == expected


def test_only_the_main_threads_collectives_are_counted_and_uninstall_restores():
    import threading

    import torch.distributed as dist

    from hpc_hsdp.runtime.watchdog import CollectiveCounter

    original = dist.all_reduce
    counter = CollectiveCounter().install()
    try:
        assert dist.all_reduce is not original
        calls = []
        wrapped = counter._wrap("all_reduce", lambda *a, **k: calls.append(1))
        wrapped()
        thread = threading.Thread(target=wrapped)
        thread.start()
        thread.join()
        assert counter.entered == 1 and counter.last_kind == "all_reduce" and len(calls) == 2
    finally:
        counter.uninstall()
    assert dist.all_reduce is original


TINY = TrainingSpec(
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
        r"\(furthest: #\d+ \w+\); ranks 2 never reached it \(rank 2 at faults.py:\d+ in at_step\); "
        r"not in a SLURM job: not requeued; resubmit with the same --run-dir to resume",
        line,
    ), line
    for procid, log in logs.items():
        assert f"watchdog: rank {procid}: no step completed for" in log
        assert "Thread 0x" in log or "Current thread 0x" in log  # faulthandler's stacks of every thread
    assert "in at_step" in logs[2] and "faults.py" in logs[2]  # the frozen rank's stack shows where it is
    assert "distributed" in logs[0]  # the others wait inside torch.distributed
    for procid in (1, 2, 3):
        assert "hang at step 3" in next(line for line in logs[procid].splitlines() if "stacks above" in line)
    # the checkpoint of step 2 (written in the background) is whole: the restart resumes from it
    from hpc_hsdp.rundir.state import run_dir_state

    assert run_dir_state(tmp_path / "run").resume_step == 2
