"""Bounded samples of a run's series, kept while its records stream past (pure, no plotting).

A run of a million steps has a million points per series: too many to hold as Python
objects for a dozen series, and more than a renderer should draw (matplotlib's Agg refuses
a path that long). :class:`Downsampler` keeps every point up to ``exact`` (a short run is
drawn point for point), then at most ``buckets`` buckets of consecutive points, and of each
the first, the lowest, the highest and the last point: the curve keeps its shape, its
envelope and every spike, in memory that does not grow with the run. When the buckets are
full, neighbouring ones are merged pairwise and each new bucket is twice as wide.
:class:`ProbeSample` does the same for the straggler probes of the heat map, keeping of
each bucket the probe with the slowest rank.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

EXACT = 4096
"""Up to this many points a series is kept whole (a short run is drawn point for point)."""
BUCKETS = 1024
"""Past :data:`EXACT` points, a series is kept as 512 to 1,024 buckets of up to 4 points each."""
PROBE_BUCKETS = 1024
"""Straggler probes kept for the heat map (the HTML report shows at most 240 columns of them)."""


def _reduce(xs: Sequence[float], ys: Sequence[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The first, lowest, highest and last of a bucket's points, in order (each once)."""
    n = len(ys)
    if n <= 4:
        return tuple(xs), tuple(ys)
    lo, hi = ys.index(min(ys)), ys.index(max(ys))
    if lo > hi:
        lo, hi = hi, lo
    keep = [0]
    if lo > 0:
        keep.append(lo)
    if hi > lo:
        keep.append(hi)
    if n - 1 > hi:
        keep.append(n - 1)
    return tuple([xs[i] for i in keep]), tuple([ys[i] for i in keep])


class Downsampler:
    """One series, x ascending: every point up to ``exact``; past it at most ``buckets`` buckets
    of consecutive points, each reduced to its first, lowest, highest and last point."""

    def __init__(self, buckets: int = BUCKETS, exact: int = EXACT) -> None:
        if buckets < 2 or buckets % 2 or exact < buckets // 2 or exact % (buckets // 2):
            raise ValueError(f"buckets {buckets}, exact {exact}: buckets even, exact a multiple of buckets / 2")
        self.buckets = buckets
        self.exact = exact
        self.width = 0
        """Points per bucket (0: every point is kept as it is)."""
        self.count = 0
        """Points seen."""
        self._closed: list[tuple[tuple[float, ...], tuple[float, ...]]] = []
        self._xs: list[float] = []
        """The points not in a bucket yet: all of them until ``exact``, then the open bucket's."""
        self._ys: list[float] = []

    def add(self, x: float, y: float) -> None:
        self.extend((x,), (y,))

    def extend(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        """The next points (x ascending, after those seen)."""
        self.count += len(xs)
        if not self.width:
            self._xs.extend(xs)
            self._ys.extend(ys)
            if len(self._xs) <= self.exact:
                return
            self.width = 2 * self.exact // self.buckets  # the points kept so far fill half the buckets
            xs, ys = self._xs, self._ys
            self._xs, self._ys = [], []
        start, end, width = 0, len(xs), self.width
        while start < end:
            if not self._xs and start + width <= end:  # a whole bucket of the new points
                self._closed.append(_reduce(xs[start : start + width], ys[start : start + width]))
                start += width
            else:
                take = width - len(self._xs)
                self._xs.extend(xs[start : start + take])
                self._ys.extend(ys[start : start + take])
                start += take
                if len(self._xs) < width:
                    break
                self._closed.append(_reduce(self._xs, self._ys))
                self._xs, self._ys = [], []
            if len(self._closed) == self.buckets:
                self._merge()
                width = self.width

    def _merge(self) -> None:
        closed = self._closed
        self._closed = [_reduce(a[0] + b[0], a[1] + b[1]) for a, b in zip(closed[0::2], closed[1::2])]
        self.width *= 2

    def points(self) -> tuple[list[float], list[float]]:
        """The sample: (xs, ys), x ascending; every point while no more than ``exact`` came."""
        if not self.width:
            return list(self._xs), list(self._ys)
        xs: list[float] = []
        ys: list[float] = []
        for bx, by in [*self._closed, _reduce(self._xs, self._ys)]:
            xs.extend(bx)
            ys.extend(by)
        return xs, ys


def spike(own_time_s: Sequence[float]) -> float:
    """How much slower the probe's slowest rank was than its median (1.0: nobody)."""
    median = statistics.median_low(own_time_s)
    return max(own_time_s) / median if median > 0 else float("inf")


class ProbeSample:
    """At most ``buckets`` of the straggler probes (step, ``stragglers`` entry), in step order:
    all of them up to ``buckets``; past it, of each pair of neighbouring buckets the probe whose
    slowest rank was the slowest against the median (a slow rank is not sampled away)."""

    def __init__(self, buckets: int = PROBE_BUCKETS) -> None:
        if buckets < 2 or buckets % 2:
            raise ValueError(f"buckets must be an even number >= 2, not {buckets}")
        self.buckets = buckets
        self.width = 1
        self.count = 0
        self._closed: list[tuple[float, int, dict]] = []
        self._open: tuple[float, int, dict] | None = None
        self._in_open = 0

    def add(self, step: int, entry: dict) -> None:
        probe = (spike(entry["own_time_s"]), step, entry)
        self.count += 1
        self._open = probe if self._open is None or probe[0] > self._open[0] else self._open
        self._in_open += 1
        if self._in_open == self.width:
            self._closed.append(self._open)
            self._open, self._in_open = None, 0
            if len(self._closed) == self.buckets:
                pairs = zip(self._closed[0::2], self._closed[1::2])
                self._closed = [b if b[0] > a[0] else a for a, b in pairs]
                self.width *= 2

    def probes(self) -> list[tuple[int, dict]]:
        kept = self._closed + ([self._open] if self._open is not None else [])
        return [(step, entry) for _, step, entry in kept]
