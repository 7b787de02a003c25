"""Read a run directory into what the report draws (no torch, no scheduler).

A run directory holds ``metrics.jsonl`` (one record per step, rank 0), ``layout.json``
(the node of every rank), ``attempt.json`` and ``restarts.jsonl`` (:mod:`hpc_hsdp.rundir.attempts`)
and, when submitted, ``job.json``. Whatever is missing or damaged is said in
``RunData.notes`` (one line each) and the rest is drawn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.rundir import attempts
from hpc_hsdp.rundir.layout import nodes_by_rank
from hpc_hsdp.rundir.metrics import metrics_path, read_metrics
from hpc_hsdp.rundir.replicas import read_membership
from hpc_hsdp.rundir.stragglers import persistent

ACTIVE_WITHIN_S = 600
"""A run without an end record whose metrics changed this recently is taken as running."""


@dataclass(frozen=True, kw_only=True)
class RunData:
    path: Path
    label: str
    records: list[dict]
    nodes: list[str] | None
    """Node of each node-major rank (layout.json), None without it."""
    restarts: list[dict]
    membership: list[dict] = field(default_factory=list)
    """``replicas.jsonl``: a fault-tolerant run's membership changes."""
    attempt: dict | None
    notes: list[str] = field(default_factory=list)
    last_activity: float | None = None
    """Unix time of the newest write to metrics.jsonl / attempt.json."""

    @property
    def last(self) -> dict | None:
        return self.records[-1] if self.records else None

    @property
    def total_steps(self) -> int | None:
        return (self.attempt or {}).get("total_steps")

    @property
    def state(self) -> str:
        """``completed``, ``running``, ``stopped: <reason>``, ``ended: <reason>`` or ``no end recorded``."""
        ended = (self.attempt or {}).get("ended")
        if ended:
            reason = ended.get("reason")
            if reason == "completed":
                return "completed"
            return f"stopped: {attempts.SHORT.get(reason, reason)}"
        if self.attempt is None and not self.records:
            return "not started"
        if self.last_activity is not None and time.time() - self.last_activity < ACTIVE_WITHIN_S:
            return "running"
        return "no end recorded (killed?)"

    def series(self, key: str) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for r in self.records:
            value = r.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                xs.append(r["step"])
                ys.append(float(value))
        return xs, ys

    def tokens_axis(self) -> list[tuple[int, float]]:
        """(step, tokens seen after it): the record's ``tokens_seen`` or the sum of tokens per step."""
        out, total = [], 0.0
        for r in self.records:
            if isinstance(r.get("tokens_seen"), (int, float)):
                total = float(r["tokens_seen"])
            elif isinstance(r.get("tokens_per_s"), (int, float)) and isinstance(r.get("step_time_s"), (int, float)):
                total += r["tokens_per_s"] * r["step_time_s"]
            out.append((r["step"], total))
        return out

    def comm_series(self, key: str) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for r in self.records:
            comm = r.get("comm")
            if isinstance(comm, dict) and isinstance(comm.get(key), (int, float)):
                xs.append(r["step"])
                ys.append(float(comm[key]))
        return xs, ys

    def straggler_probes(self) -> list[tuple[int, dict]]:
        return [
            (r["step"], r["stragglers"])
            for r in self.records
            if isinstance(r.get("stragglers"), dict) and r["stragglers"].get("own_time_s")
        ]

    def straggler_verdict(self) -> str | None:
        """The ranks named slow in at least half of the probes, in words, with how often."""
        probes = self.straggler_probes()
        if not probes:
            return None
        found = persistent([entry for _, entry in probes], self.nodes)
        if found is None:
            return f"no rank was persistently 1.2x slower than the median ({len(probes)} probes)"
        words, count, total = found
        return f"{words} (in {count} of {total} probes)"


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def load_run(path: str | Path, *, label: str | None = None) -> RunData:
    """Read one run directory; :class:`SpecError` when it is not a directory."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise SpecError(f"{str(path)!r} is not a run directory (no such directory); give the --run-dir of a run")
    records, notes = read_metrics(run_dir)
    attempt = attempts.read_attempt(run_dir)
    times = [t for t in (_mtime(metrics_path(run_dir)), _mtime(run_dir / attempts.ATTEMPT)) if t]
    run = RunData(
        path=run_dir,
        label=label or run_dir.name,
        records=records,
        nodes=nodes_by_rank(run_dir),
        restarts=attempts.read_restarts(run_dir),
        membership=read_membership(run_dir),
        attempt=attempt,
        notes=notes,
        last_activity=max(times) if times else None,
    )
    if run.state == "running" and records:
        total = run.total_steps
        notes.append(
            f"in progress: step {records[-1]['step']}{f' of {total}' if total else ''}, "
            f"last written {time.time() - run.last_activity:.0f} s ago"
        )
    return run


def unique_labels(paths: list[Path]) -> list[str]:
    """The shortest path suffixes that tell the runs apart (``a/run``, ``b/run``)."""
    parts = [p.resolve().parts for p in paths]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]
