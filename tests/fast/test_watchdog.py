"""The hang watchdog (issue 13): the one line from the ranks' reports (table-driven) and the
timeout rule. One rank frozen on real gloo processes: tests/processes/test_watchdog.py."""

from __future__ import annotations

import pytest

from hpc_hsdp.task.resilience.watchdog import HANG_TIMEOUT_FLOOR_S, describe_hang, hang_timeout


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


def test_only_the_main_threads_collectives_are_counted_and_uninstall_restores(monkeypatch):
    import threading

    import torch.distributed as dist

    from hpc_hsdp.task.resilience.watchdog import CollectiveCounter

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(1))
    original = dist.all_reduce
    counter = CollectiveCounter().install()
    try:
        assert dist.all_reduce is not original
        wrapped = dist.all_reduce
        wrapped()
        thread = threading.Thread(target=wrapped)
        thread.start()
        thread.join()
        assert counter.entered == 1 and counter.last_kind == "all_reduce" and len(calls) == 2
    finally:
        counter.uninstall()
    assert dist.all_reduce is original


def test_a_rank_that_read_rank_0s_verdict_says_so_in_the_store(monkeypatch):
    """Rank 0 waits (up to GATHER_S) for every other rank's ``read<rank>`` before its process,
    which holds the job's store, ends; a rank that got the verdict writes it (found by mypy:
    the write sat in the branch without a store)."""
    import threading
    from types import SimpleNamespace

    import torch.distributed as dist

    from hpc_hsdp.task.resilience import watchdog

    monkeypatch.setattr(watchdog, "ENDING", threading.Event())
    store = dist.HashStore()
    store.set("job/verdict", "hang at step 3")
    ctx = SimpleNamespace(rank=1, world_size=2, run_dir=None, layout=SimpleNamespace(node="n1"))
    exits: list[int] = []
    dog = watchdog.Watchdog(ctx, env={}, exit_fn=exits.append)
    dog._store, dog._prefix = store, "job/"
    dog._hung()
    assert exits == [watchdog.EXIT_HUNG]
    assert store.check(["job/rank1"]) and store.check(["job/read1"])
