"""The one layer over the torch.distributed collectives (task/observation/collectives.py): every name is
wrapped, listeners come and go in any order and leave torch's functions as they were, a patch
on top of ours stays, a listener sees the outermost call with its arguments."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from hpc_hsdp.task.observation.collectives import COLLECTIVES, POINT_TO_POINT, WAIT, WRAPPABLE, listen


def _function(name: str):
    if name == WAIT:
        return dist.distributed_c10d.Work.wait
    if name.startswith("funcol."):
        return getattr(funcol, name.removeprefix("funcol."))
    return getattr(dist, name)


def _torchs_functions() -> dict[str, object]:
    return {name: _function(name) for name in WRAPPABLE}


def test_the_names_are_this_torchs_functions_and_each_is_wrapped_once_while_listened():
    assert set(COLLECTIVES).isdisjoint(POINT_TO_POINT) and len(set(WRAPPABLE)) == len(WRAPPABLE)
    before = _torchs_functions()
    assert all(callable(f) for f in before.values())
    first, second = listen(names=WRAPPABLE), listen(names=WRAPPABLE)
    try:
        for name, original in before.items():
            assert _function(name) is not original and _function(name).__wrapped__ is original, name
    finally:
        first.close()
        second.close()
    assert _torchs_functions() == before


def _orders():
    """Every order of adding and removing three listeners, each added before it is removed."""
    events = [("add", i) for i in range(3)] + [("remove", i) for i in range(3)]
    for order in itertools.permutations(events):
        if all(order.index(("add", i)) < order.index(("remove", i)) for i in range(3)):
            yield order


def test_listeners_added_and_removed_in_any_order_leave_torchs_functions_as_they_were(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *args, **kwargs: calls.append(args))
    names = [("all_reduce", "barrier"), WRAPPABLE, ("all_reduce", WAIT)]
    before = _torchs_functions()
    orders = list(_orders())
    assert len(orders) == 90
    seen: list[int] = []
    for order in orders:
        active: dict[int, object] = {}
        for action, i in order:
            if action == "add":
                active[i] = listen(lambda name, args, kwargs, i=i: seen.append(i), names=names[i])
            else:
                active.pop(i).close()
            for name in WRAPPABLE:
                listened = any(name in names[j] for j in active)
                assert (_function(name) is not before[name]) == listened, (order, name)
            seen.clear()
            dist.all_reduce("x")
            assert seen == sorted(active, key=list(active).index), order
        assert _torchs_functions() == before, order
    assert len(calls) == 90 * 6


def test_a_patch_on_top_of_ours_is_left_in_place_and_ours_passes_calls_through(monkeypatch):
    torch_calls, seen = [], []
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: torch_calls.append(args))
    torchs = dist.barrier
    listening = listen(lambda name, args, kwargs: seen.append(name), names=("barrier",))
    ours = dist.barrier

    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    dist.barrier = theirs
    dist.barrier()
    assert seen == ["barrier"]
    listening.close()
    assert dist.barrier is theirs
    dist.barrier()
    assert seen == ["barrier"] and len(torch_calls) == 2

    again = listen(lambda name, args, kwargs: seen.append(name), names=("barrier",))
    dist.barrier()
    assert seen == ["barrier", "barrier"] and len(torch_calls) == 3, "one call, one notice"
    again.close()
    assert dist.barrier is theirs
    dist.barrier = ours
    again = listen(lambda name, args, kwargs: seen.append(name), names=("barrier",))
    dist.barrier()
    assert seen == ["barrier"] * 3 and len(torch_calls) == 4
    again.close()
    assert dist.barrier is torchs, "theirs gone, ours left on top: the next listener takes it over"


def test_a_listener_sees_the_outermost_call_its_arguments_and_its_end():
    seen = []
    listening = listen(
        lambda name, args, kwargs: seen.append(("entered", name, args, kwargs)),
        lambda name, completed: seen.append(("left", name, completed)),
        names=WRAPPABLE,
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        tensor = torch.ones(2)
        dist.all_reduce(tensor, group=None)  # waits on its Work inside: one call
        assert seen == [("entered", "all_reduce", (tensor,), {"group": None}), ("left", "all_reduce", True)]
        seen.clear()
        work = dist.all_reduce(tensor, async_op=True)
        work.wait()
        assert [entry[:2] for entry in seen] == [
            ("entered", "all_reduce"),
            ("left", "all_reduce"),
            ("entered", WAIT),
            ("left", WAIT),
        ]
        assert seen[2][2] == (work,)
        seen.clear()
        with pytest.raises(RuntimeError, match="invalid root rank"):
            dist.broadcast(tensor, src=5)
        dist.barrier()
        assert [entry[1:] for entry in seen if entry[0] == "left"] == [("broadcast", False), ("barrier", True)]
    finally:
        dist.destroy_process_group()
        listening.close()


def test_a_name_the_layer_does_not_wrap_is_refused():
    with pytest.raises(ValueError, match="new_group"):
        listen(names=("all_reduce", "new_group"))
