"""Which rank or node holds the others back: the pure part (no torch).

In synchronous data parallel every rank's step lasts as long as the slowest rank's: the
fast ranks wait inside the collectives. A rank's *own* time is its step time minus the
time it spent blocked in collectives (:mod:`hpc_hsdp.task.observation.straggler_probe` measures it
and shares it every K steps). :func:`summarize` turns the per-rank own times into the
``stragglers`` entry of a metrics.jsonl record; :func:`describe` into the words that
``status`` and ``submit --wait`` print::

    "stragglers": {"own_time_s": [0.021, 0.020, 0.022, 0.310],   # index = node-major rank
                   "median_s": 0.0215, "slowest_rank": 3, "slowest_node": "tn2",
                   "slowest_s": 0.310, "spread": 14.4}               # slowest / median

The median is the lower middle value for an even number of ranks (``median_low``): when
half of the ranks are slow (one node of two), the norm is still a fast rank's time.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

SLOW_THRESHOLD = 1.2
"""A rank whose own time is at least this many times the median is named as slow."""
MIN_MEDIAN_S = 1e-3
"""The median own time is taken as at least this: when one rank holds the others back by far
more than their own work, the fast ranks' own time (step time minus time blocked in
collectives) comes out at or near zero, and a ratio against zero says nothing."""


def _norm(median: float | None) -> float:
    return max(float(median or 0.0), MIN_MEDIAN_S)


def summarize(own_time_s: Sequence[float], nodes: Sequence[str] | None = None) -> dict:
    """The ``stragglers`` entry of a record from every rank's own time (index = rank)."""
    times = [float(t) for t in own_time_s]
    if not times:
        raise ValueError("no per-rank times to summarize")
    median = statistics.median_low(times)
    slowest = max(range(len(times)), key=times.__getitem__)
    return {
        "own_time_s": [round(t, 6) for t in times],
        "median_s": round(median, 6),
        "slowest_rank": slowest,
        "slowest_node": nodes[slowest] if nodes and slowest < len(nodes) else None,
        "slowest_s": round(times[slowest], 6),
        "spread": round(times[slowest] / _norm(median), 4),
    }


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[2, 3, 5, 8, 9, 10]`` -> ``"2-3,5,8-10"``."""
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = prev = None
    for r in [*ordered, None]:
        if r is not None and prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    return ",".join(parts)


def slow_ranks(entry: dict, threshold: float = SLOW_THRESHOLD) -> list[int]:
    """Ranks whose own time is at least ``threshold`` x the median."""
    times = entry.get("own_time_s") or []
    if not times:
        return []
    median = _norm(entry.get("median_s") if entry.get("median_s") is not None else statistics.median_low(times))
    return [r for r, t in enumerate(times) if t >= threshold * median]


def describe(entry: dict | None, nodes: Sequence[str] | None = None, threshold: float = SLOW_THRESHOLD) -> str | None:
    """``"node tn2: ranks 2-3 are 1.4x slower than the median"`` (one clause per node with
    slow ranks, ``; ``-joined), or None when no rank passes ``threshold``."""
    if not entry:
        return None
    slow = slow_ranks(entry, threshold)
    if not slow:
        return None
    times = entry["own_time_s"]
    median = _norm(entry.get("median_s") if entry.get("median_s") is not None else statistics.median_low(times))
    by_node: dict[str | None, list[int]] = {}
    for r in slow:
        node = (
            nodes[r]
            if nodes and r < len(nodes)
            else (entry.get("slowest_node") if r == entry.get("slowest_rank") else None)
        )
        by_node.setdefault(node, []).append(r)
    clauses = []
    for node, ranks in sorted(by_node.items(), key=lambda item: -max(times[r] for r in item[1])):
        ratio = statistics.median_low([times[r] for r in ranks]) / median
        who = f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)} are"
        where = f"node {node}: " if node else ""
        clauses.append(f"{where}{who} {ratio:.1f}x slower than the median")
    return "; ".join(clauses)


class SlowTally:
    """Which ranks the probes name slow, counted one probe at a time (a run's probes need not
    be held): :meth:`persistent` and :meth:`persistent_ranks` say what :func:`persistent` and
    :func:`persistent_ranks` say of the same probes."""

    def __init__(self, threshold: float = SLOW_THRESHOLD) -> None:
        self.threshold = threshold
        self.probes = 0
        self.world = 0
        self.counts: dict[int, int] = {}
        self.ratios: dict[int, list[float]] = {}
        """Per rank: its ratio to the median in the probes that named it."""

    def add(self, entry: dict | None) -> None:
        if not entry or not entry.get("own_time_s"):
            return
        times = entry["own_time_s"]
        self.probes += 1
        self.world = max(self.world, len(times))
        median = _norm(entry.get("median_s") if entry.get("median_s") is not None else statistics.median_low(times))
        for r in slow_ranks(entry, self.threshold):
            self.counts[r] = self.counts.get(r, 0) + 1
            self.ratios.setdefault(r, []).append(times[r] / median)

    def persistent_ranks(self) -> list[int]:
        return sorted(r for r, n in self.counts.items() if 2 * n >= self.probes)

    def persistent(self, nodes: Sequence[str] | None = None) -> tuple[str, int, int] | None:
        named = self.persistent_ranks()
        if not named:
            return None
        typical = [statistics.median_low(self.ratios[r]) if r in named else 1.0 for r in range(self.world)]
        words = describe({"own_time_s": typical, "median_s": 1.0}, nodes, self.threshold)
        if words is None:
            return None
        return words, max(self.counts[r] for r in named), self.probes


def _tally(entries: Sequence[dict], threshold: float) -> SlowTally:
    tally = SlowTally(threshold)
    for entry in entries:
        tally.add(entry)
    return tally


def persistent(
    entries: Sequence[dict], nodes: Sequence[str] | None = None, threshold: float = SLOW_THRESHOLD
) -> tuple[str, int, int] | None:
    """The ranks named slow in at least half of ``entries`` (several probes: one noisy step
    names nobody), in words with each rank's median ratio in the probes that named it; with how many
    probes named the most persistent of them, and how many there were. None: nobody."""
    return _tally(entries, threshold).persistent(nodes)


def persistent_ranks(entries: Sequence[dict], threshold: float = SLOW_THRESHOLD) -> list[int]:
    """Ranks named slow (:func:`slow_ranks`) in at least half of ``entries``."""
    return _tally(entries, threshold).persistent_ranks()
