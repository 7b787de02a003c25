"""Each rank's own time of a step, shared every K steps (one small all-gather).

:class:`BlockedClock` listens to every ``torch.distributed`` collective, point-to-point call
and ``Work.wait``, and to the functional collectives of tensor parallelism and their waits
(:mod:`hpc_hsdp.task.observation.collectives`), and adds the wall time this rank
spends inside them to a counter, while a step is being probed. A
rank's own time = step time - that blocked time: the waiting for slower peers and the
transfer are left out, so the slow rank is the one with the largest own time although
every rank's step time is the same.

On CPU (gloo) the collectives block the calling thread, so the wall time inside them is
the wait. On CUDA they only enqueue work; on a probed step the clock synchronizes the
device before a collective (the compute before it is this rank's own) and after it (the
collective's wait and transfer are not), which costs the overlap of communication and
compute of that one step in K.

:class:`StragglerProbe` is the loop's component: ``begin(step)`` before the step,
``end(step, step_time_s)`` after it (after ``comm_stats.take()``, so that its all-gather
is not counted in the step's traffic) returns the ``stragglers`` entry of the record
(:func:`hpc_hsdp.rundir.training.stragglers.summarize`, plus ``share_s``: what the all-gather took on this
rank) on probed steps, None otherwise. Collective:
every rank calls both at every step.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from hpc_hsdp.rundir.training.stragglers import summarize
from hpc_hsdp.task.observation.collectives import (
    COLLECTIVES,
    FUNCTIONAL,
    FUNCTIONAL_WAIT,
    POINT_TO_POINT,
    WAIT,
    Listening,
    listen,
)


class BlockedClock:
    """Wall time spent inside collectives (outermost calls only) while ``running``."""

    def __init__(self, *, device: torch.device | None = None) -> None:
        self.sync_cuda = device is not None and device.type == "cuda"
        self.device = device
        self.running = False
        self.blocked_s = 0.0
        self._began: float | None = None
        self._listening: Listening | None = None
        self._thread: int | None = None

    def install(self) -> BlockedClock:
        if self._listening is None:
            # where the host blocks: a functional collective (tensor parallelism's) returns before its
            # transfer is done and is waited for at its result's first use (FUNCTIONAL_WAIT); without
            # that wait, a TP group's ranks that wait for a slow peer count the wait as their own time
            names = (*COLLECTIVES, *POINT_TO_POINT, WAIT, *FUNCTIONAL, FUNCTIONAL_WAIT)
            self._listening = listen(self._entered, self._left, names=names)
        return self

    def close(self) -> None:
        """Stop listening to the collectives (idempotent)."""
        if self._listening is not None:
            self._listening.close()
            self._listening = None

    def start(self) -> None:
        """Count from now, in this thread only: a background checkpoint save's collectives in
        another thread overlap the step and are not this rank's wait."""
        self.blocked_s = 0.0
        self._thread = threading.get_ident()
        self.running = True

    def stop(self) -> float:
        self.running = False
        return self.blocked_s

    def _sync(self) -> None:
        if self.sync_cuda:
            torch.cuda.synchronize(self.device)

    def _entered(self, name: str, args: tuple, kwargs: dict) -> None:
        if self.running and threading.get_ident() == self._thread:
            self._sync()
            self._began = time.perf_counter()

    def _left(self, name: str, completed: bool) -> None:
        began = self._began
        if began is None or threading.get_ident() != self._thread:
            return
        self._began = None
        try:
            if completed:
                self._sync()
        finally:
            self.blocked_s += time.perf_counter() - began


class StragglerProbe:
    """Every ``every`` steps: this rank's own time, all-gathered, summarized (see the module doc)."""

    def __init__(self, *, every: int, world_size: int, device: torch.device, nodes: list[str] | None = None) -> None:
        self.every = every
        self.world_size = world_size
        self.device = device
        self.nodes = nodes
        self.clock = BlockedClock(device=device).install() if every else None
        self.gather_s = 0.0
        """Wall time of the last probe's all-gather (what sharing costs)."""

    @classmethod
    def for_context(cls, ctx, every: int) -> StragglerProbe:
        nodes = [d["node"] for d in ctx.realized] if ctx.realized else None
        return cls(every=every, world_size=ctx.world_size, device=ctx.device, nodes=nodes)

    def probing(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def begin(self, step: int) -> None:
        if self.clock is not None and self.probing(step):
            self.clock.start()

    def end(self, step: int, step_time_s: float) -> dict | None:
        if self.clock is None or not self.probing(step):
            return None
        own = max(step_time_s - self.clock.stop(), 0.0)
        began = time.perf_counter()
        mine = torch.tensor([own], dtype=torch.float64, device=self.device)
        gathered = torch.empty(self.world_size, dtype=torch.float64, device=self.device)
        dist.all_gather_single(gathered, mine)  # all_gather_into_tensor warns of its deprecation on every rank
        times = gathered.tolist()
        self.gather_s = time.perf_counter() - began
        return dict(summarize(times, self.nodes), share_s=round(self.gather_s, 6))

    def close(self) -> None:
        if self.clock is not None:
            self.clock.close()
