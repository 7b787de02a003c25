"""One wrapper per ``torch.distributed`` collective, shared by the components that watch them.

Three components watch the collectives a rank issues: the hang watchdog counts those its
main thread enters (:mod:`~hpc_hsdp.task.resilience.watchdog`), the straggler probe times the wait
inside them (:mod:`~hpc_hsdp.task.observation.straggler_probe`), ``--comm-stats`` counts their bytes per
mesh axis (:mod:`~hpc_hsdp.task.observation.comm_stats`). Each registers its callbacks here with
:func:`listen`; the function of each name they listen to is replaced by ONE wrapper, which
calls the callbacks and torch's function.

- What can be wrapped (:data:`WRAPPABLE`): the functions FSDP2, DTensor, DCP and the loop look
  up on ``torch.distributed`` at call time, the collectives (:data:`COLLECTIVES`: every rank
  of the group calls them) and the point-to-point ones (:data:`POINT_TO_POINT`); and
  :data:`WAIT`, ``Work.wait``, where a rank waits for an asynchronous one; and the functional
  collectives DTensor's redistributions call (:data:`FUNCTIONAL`, tensor parallelism's traffic)
  and :data:`FUNCTIONAL_WAIT`, where a rank waits for one of those.
  Calls torch makes through its own module (``all_gather_into_tensor`` forwarding to
  ``all_gather_single``) and ops called on ``torch.ops._c10d_functional`` directly do not pass
  through these functions and are not seen.
- A listener sees the outermost wrapped call of a thread only, in the thread that made it:
  ``entered(name, args, kwargs)`` before torch's function runs, ``left(name, completed)``
  after it returned (``completed``) or raised. A wrapped call made inside another
  (``Work.wait`` inside a synchronous collective) is part of the outer one.
- A function is replaced when its first listener arrives; torch's function is put back when
  its last listener leaves, whatever the order of arrivals and departures, but only while
  ``torch.distributed`` still holds the wrapper. When somebody replaced it on top of ours
  meanwhile (a profiler, a test's fault injection), theirs stays in place: ours, which theirs
  calls, passes calls straight through from then on, and a later listener gets a new wrapper
  on top of theirs (the outermost-call rule keeps the old one silent). When theirs is gone
  again, leaving ours on top, the next listener takes ours over, so that torch's function
  comes back after it.
- Per call: a name nobody listens to is torch's own function; a listened one adds a
  thread-local flag, set and reset, and the listeners' own work (about half a microsecond
  with one no-op listener on a 2-core CPU host).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable

import torch.distributed as dist

COLLECTIVES: tuple[str, ...] = (
    # FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "barrier",
    # the older names of the first two (torch forwards them to those inside its own module)
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    # the other collectives of tensors
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "monitored_barrier",
    # of Python objects (DCP's planning, the run's own agreements such as the restart budget)
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
)
"""The torch.distributed functions every rank of the group calls."""

POINT_TO_POINT: tuple[str, ...] = (
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "send_object_list",
    "recv_object_list",
)
"""The torch.distributed functions between two ranks (their number differs across ranks)."""

WAIT = "Work.wait"
"""Where a rank waits for an asynchronous collective (``async_op=True``) to complete."""

FUNCTIONAL: tuple[str, ...] = (
    "funcol.all_gather_single",
    "funcol.reduce_scatter_single",
    "funcol.all_reduce",
    "funcol.all_to_all_single",
)
"""The functional collectives DTensor's redistributions call (``torch.distributed._functional_collectives``,
which ``torch/distributed/tensor/placement_types.py`` looks up at call time): tensor parallelism's
traffic, and ``clip_grad_norm_``'s over DTensors. Their result is a tensor whose collective may still
be running (torch waits for it where it is first used)."""

FUNCTIONAL_WAIT = "funcol.wait_tensor"
"""Where a rank waits for a functional collective's result (``AsyncCollectiveTensor`` calls it at
the result's first use): tensor parallelism's waits for its TP group's peers."""

WRAPPABLE: tuple[str, ...] = (*COLLECTIVES, *POINT_TO_POINT, WAIT, *FUNCTIONAL, FUNCTIONAL_WAIT)

Entered = Callable[[str, tuple, dict], object]
Left = Callable[[str, bool], object]


class _Inside(threading.local):
    call = False
    """This thread is inside a wrapped call."""


_inside = _Inside()
_lock = threading.Lock()


def _home(name: str) -> tuple[object, str]:
    """Where the function of ``name`` lives: (object, attribute)."""
    if name == WAIT:
        return dist.distributed_c10d.Work, "wait"
    if name.startswith("funcol."):
        import torch.distributed._functional_collectives as funcol  # noqa: PLC0415 - loaded with DTensor anyway

        return funcol, name.removeprefix("funcol.")
    return dist, name


class _Installation:
    """One wrapper in place of one function, from the first listener to the last."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.home, self.attribute = _home(name)
        current = getattr(self.home, self.attribute)
        left_behind = getattr(current, "__hpc_hsdp_installation__", None)
        if left_behind is not None and left_behind.wrapper is current:  # back on top: torch's under it
            current = left_behind.original
        self.original = current
        self.listenings: list[Listening] = []
        self.hooks: tuple[tuple[Entered, ...], tuple[Left, ...]] | None = None
        self.wrapper = self._wrap()
        setattr(self.home, self.attribute, self.wrapper)

    def _wrap(self):
        original, name = self.original, self.name

        def wrapper(*args, **kwargs):
            hooks = self.hooks
            if hooks is None or _inside.call:
                return original(*args, **kwargs)
            entered, left = hooks
            _inside.call = True
            try:
                for listener in entered:
                    listener(name, args, kwargs)
                completed = False
                try:
                    result = original(*args, **kwargs)
                    completed = True
                    return result
                finally:
                    for leaving in left:
                        leaving(name, completed)
            finally:
                _inside.call = False

        functools.update_wrapper(wrapper, original)
        setattr(wrapper, "__hpc_hsdp_installation__", self)  # noqa: B010 - a function's own attribute, unknown to its type
        return wrapper

    def update(self) -> None:
        entered = tuple(x.entered for x in self.listenings if x.entered is not None)
        left = tuple(x.left for x in reversed(self.listenings) if x.left is not None)
        self.hooks = (entered, left) if self.listenings else None

    def remove(self) -> None:
        """Put torch's function back when ours is still in place, else pass calls through."""
        self.hooks = None
        if getattr(self.home, self.attribute) is self.wrapper:
            setattr(self.home, self.attribute, self.original)


_installed: dict[str, _Installation] = {}


class Listening:
    """A listener's registration (:func:`listen`); ``close()`` ends it (idempotent)."""

    def __init__(self, entered: Entered | None, left: Left | None, names: tuple[str, ...]) -> None:
        self.entered = entered
        self.left = left
        self.names = names

    def close(self) -> None:
        with _lock:
            for name in self.names:
                installation = _installed.get(name)
                if installation is None or self not in installation.listenings:
                    continue
                installation.listenings.remove(self)
                if installation.listenings:
                    installation.update()
                else:
                    installation.remove()
                    del _installed[name]


def listen(entered: Entered | None = None, left: Left | None = None, *, names: Iterable[str]) -> Listening:
    """Call ``entered(name, args, kwargs)`` / ``left(name, completed)`` around every outermost
    call of the functions ``names`` (of :data:`WRAPPABLE`; those this torch lacks are skipped)
    until the returned registration is closed. Listeners are entered in the order they
    registered and left in the reverse order."""
    names = tuple(dict.fromkeys(names))
    unknown = set(names) - set(WRAPPABLE)
    if unknown:
        raise ValueError(f"not collectives this layer wraps: {sorted(unknown)}")
    listening = Listening(entered, left, tuple(n for n in names if _available(n)))
    with _lock:
        for name in listening.names:
            installation = _installed.get(name)
            if installation is None:
                installation = _installed[name] = _Installation(name)
            installation.listenings.append(listening)
            installation.update()
    return listening


def _available(name: str) -> bool:
    home, attribute = _home(name)
    return getattr(home, attribute, None) is not None
