"""Read a run directory into what the report draws (no torch, no scheduler).

A run directory holds ``metrics.jsonl`` (one record per step, rank 0), ``layout.json``
(the node of every rank), ``attempt.json`` and ``restarts.jsonl`` (:mod:`hpc_hsdp.rundir.lifecycle.attempts`)
and, when submitted, ``job.json``. Whatever is missing or damaged is said in
``RunData.notes`` (one line each) and the rest is drawn.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.report.sample import Downsampler, ProbeSample
from hpc_hsdp.rundir.layout import nodes_by_rank
from hpc_hsdp.rundir.lifecycle import attempts
from hpc_hsdp.rundir.lifecycle.provenance_record import read_provenance
from hpc_hsdp.rundir.observation.fabric_check_record import read_check
from hpc_hsdp.rundir.observation.replica_membership import read_membership
from hpc_hsdp.rundir.training.evals import EvalEntry, read_evals
from hpc_hsdp.rundir.training.metrics import last_metrics, metrics_path, scan_metrics
from hpc_hsdp.rundir.training.stragglers import SlowTally

ACTIVE_WITHIN_S = 600
"""A run without an end record whose metrics changed this recently is taken as running."""

STEP_SERIES = ("loss", "eval_loss", "tokens_per_s", "step_time_s", "data_wait_s", "lr", "grad_norm", "peak_mem_bytes")
"""The keys of a record drawn against steps (a sample of each is kept)."""
COMM_SERIES = ("inter_node_wire_bytes", "intra_node_wire_bytes")
"""The keys of a record's ``comm`` drawn against steps."""
TOKEN_SERIES = ("loss", "eval_loss")
"""The keys drawn against the tokens seen."""
_NUMBER = (int, float)
_COLUMNS = ("step", "tokens_seen", *(key for key in STEP_SERIES if key != "eval_loss"))
"""The keys that (nearly) every record has, read as columns of a chunk at once."""
_columns_of = itemgetter(*_COLUMNS)


def _finite(value) -> bool:
    """A number to draw: int or float (not a bool), not NaN nor infinite."""
    return type(value) in _NUMBER and value - value == 0


_NUMBER_TYPES = frozenset(_NUMBER)


def _pairs(xs: Sequence, values: Sequence) -> tuple[Sequence, Sequence]:
    """The (x, value) of the drawable values: all of them when every value is a finite number
    (the common case: checked in C), else those that are."""
    if set(map(type, values)) <= _NUMBER_TYPES:
        total = sum(values)
        if total - total == 0:  # no NaN, no infinity
            return xs, values
    kept = [(x, v) for x, v in zip(xs, values) if _finite(v)]
    return [x for x, _ in kept], [v for _, v in kept]


class MetricsDigest:
    """What the report needs of a run's records, taken as they stream past
    (:func:`hpc_hsdp.rundir.training.metrics.scan_metrics`): a bounded sample of every series it draws
    (:class:`~hpc_hsdp.report.sample.Downsampler`) and, exactly, the numbers it prints: the
    last record, the latest and the best eval loss, every tokens/s (for their median: 8 bytes
    a step), which ranks the straggler probes named slow. Memory does not grow with the
    run's length but for the tokens/s."""

    def __init__(self) -> None:
        self.count = 0
        self.last: dict | None = None
        self.latest_eval: tuple[int, float] | None = None
        self.best_eval: tuple[int, float] | None = None
        self.steps = {key: Downsampler() for key in STEP_SERIES}
        self.comm = {key: Downsampler() for key in COMM_SERIES}
        self.tokens = {key: Downsampler() for key in TOKEN_SERIES}
        self.probes = ProbeSample()
        self.slow = SlowTally()
        self._tokens_per_s = array("d")
        self._tokens_seen = 0.0
        self.replica_path: list[int] = []
        """A fault-tolerant run's live replica groups as they changed (``[2, 1, 2]``)."""

    def add(self, records: list[dict]) -> None:
        if not records:
            return
        self.count += len(records)
        self.last = records[-1]
        try:  # every record has every key (the built-in loop's): one pass, in C
            columns: dict[str, Sequence] = dict(zip(_COLUMNS, zip(*map(_columns_of, records))))
        except KeyError:
            columns = {key: [r.get(key) for r in records] for key in _COLUMNS}
        steps = columns["step"]
        for key, sampler in self.steps.items():
            if key != "eval_loss":
                sampler.extend(*_pairs(steps, columns[key]))
        with_eval = [r for r in records if "eval_loss" in r]
        self.steps["eval_loss"].extend(*_pairs([r["step"] for r in with_eval], [r["eval_loss"] for r in with_eval]))
        self._tokens_per_s.extend(_pairs(columns["tokens_per_s"], columns["tokens_per_s"])[1])
        for r in with_eval:
            value = r["eval_loss"]
            if _finite(value):
                self.latest_eval = (r["step"], value)
                if self.best_eval is None or value < self.best_eval[1]:
                    self.best_eval = (r["step"], value)
        with_comm = [r for r in records if type(r.get("comm")) is dict]
        if with_comm:
            comm_steps = [r["step"] for r in with_comm]
            for key, sampler in self.comm.items():
                sampler.extend(*_pairs(comm_steps, [r["comm"].get(key) for r in with_comm]))
        tokens = self._tokens_axis(records, columns["tokens_seen"])
        self.tokens["loss"].extend(*_pairs(tokens, columns["loss"]))
        at = [(t, r["eval_loss"]) for t, r in zip(tokens, records) if "eval_loss" in r]
        self.tokens["eval_loss"].extend(*_pairs([t for t, _ in at], [v for _, v in at]))
        for r in records:
            count = r.get("replicas")
            if type(count) is int and (not self.replica_path or self.replica_path[-1] != count):
                self.replica_path.append(count)
            if "stragglers" in r:
                entry = r["stragglers"]
                if isinstance(entry, dict) and entry.get("own_time_s"):
                    self.probes.add(r["step"], entry)
                    self.slow.add(entry)

    def _tokens_axis(self, records: list[dict], seen: Sequence) -> Sequence[float]:
        """Tokens seen after each record: its ``tokens_seen``, or the sum of tokens per step."""
        if set(map(type, seen)) <= _NUMBER_TYPES:
            self._tokens_seen = float(seen[-1])
            return seen
        out, total = [], self._tokens_seen
        for r, value in zip(records, seen):
            if type(value) in _NUMBER:
                total = float(value)
            elif type(r.get("tokens_per_s")) in _NUMBER and type(r.get("step_time_s")) in _NUMBER:
                total += r["tokens_per_s"] * r["step_time_s"]
            out.append(total)
        self._tokens_seen = total
        return out

    def median_tokens_per_s(self) -> float | None:
        """The median of every step's tokens/s, as :func:`statistics.median` gives it (exact: the
        values are all kept, 8 bytes each, and partitioned in place, with no copy)."""
        values = self._tokens_per_s
        if not values:
            return None
        import numpy  # noqa: PLC0415 - the report's alone: status, runs and the CLI's start stay without it

        view = numpy.frombuffer(values, dtype=numpy.float64)
        middle = len(view) // 2
        view.partition(middle)
        high = float(view[middle])
        return high if len(view) % 2 else (float(view[:middle].max()) + high) / 2


@dataclass(frozen=True, kw_only=True)
class RunData:
    path: Path
    label: str
    last: dict | None
    """The newest step record (None: no step finished)."""
    digest: MetricsDigest | None
    """The streamed records (None: read from the file's tail only, as ``runs`` reads them)."""
    nodes: list[str] | None
    """Node of each node-major rank (layout.json), None without it."""
    restarts: list[dict]
    membership: list[dict] = field(default_factory=list)
    """``replicas.jsonl``: a fault-tolerant run's membership changes."""
    attempt: dict | None
    notes: list[str] = field(default_factory=list)
    last_activity: float | None = None
    """Unix time of the newest write to metrics.jsonl / attempt.json."""
    provenance: dict | None = None
    """``provenance.json``: the code (commit, uncommitted changes) and packages that produced the run."""
    check: dict | None = None
    """``check.json``: the fabric check's figures per node and link (``--check``, ``hpc-hsdp check``)."""
    evals: list[EvalEntry] = field(default_factory=list)
    """``evals/``: the eval job of each checkpoint (``--eval-job``), oldest first."""

    def eval_series(self, name: str) -> tuple[list[float], list[float]]:
        """(steps, values) of eval-job metric ``name`` over the finished eval jobs."""
        points = [(e.step, e.metrics[name]) for e in self.evals if e.state == "done" and name in e.metrics]
        return [float(s) for s, _ in points], [v for _, v in points]

    @property
    def eval_metric_names(self) -> list[str]:
        """The eval jobs' metric names, in the order first seen."""
        names: dict[str, None] = {}
        for entry in self.evals:
            if entry.state == "done":
                names.update(dict.fromkeys(entry.metrics))
        return list(names)

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
        if self.attempt is None and self.last is None:
            return "not started"
        if self.last_activity is not None and time.time() - self.last_activity < ACTIVE_WITHIN_S:
            return "running"
        return "no end recorded (killed?)"

    def _digest(self) -> MetricsDigest:
        if self.digest is None:
            raise ValueError(f"{self.label}: read from the tail only (load_run(..., tail_only=False) streams it)")
        return self.digest

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of a record key, sampled (:data:`STEP_SERIES`)."""
        return self._digest().steps[key].points()

    def comm_series(self, key: str) -> tuple[list[float], list[float]]:
        return self._digest().comm[key].points()

    def against_tokens(self, key: str) -> tuple[list[float], list[float]]:
        """(tokens seen, values) of ``loss`` or ``eval_loss``, sampled."""
        return self._digest().tokens[key].points()

    def straggler_probes(self) -> list[tuple[int, dict]]:
        """The probes of the heat map: all, or a bounded sample that keeps the slow ones."""
        return self._digest().probes.probes()

    def straggler_verdict(self) -> str | None:
        """The ranks named slow in at least half of the probes (all of them), in words, with how often."""
        tally = self._digest().slow
        if not tally.probes:
            return None
        found = tally.persistent(self.nodes)
        if found is None:
            return f"no rank was persistently 1.2x slower than the median ({tally.probes} probes)"
        words, count, total = found
        return f"{words} (in {count} of {total} probes)"

    def slow_ranks(self) -> list[int]:
        """The ranks slow in at least half of all the probes."""
        return self._digest().slow.persistent_ranks()


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def load_run(path: str | Path, *, label: str | None = None, tail_only: bool = False) -> RunData:
    """Read one run directory; :class:`SpecError` when it is not a directory. Its metrics are
    streamed once into a :class:`MetricsDigest`; ``tail_only``: only the newest record is read,
    from the file's end (what ``runs`` shows)."""
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise SpecError(f"{str(path)!r} is not a run directory (no such directory); give the --run-dir of a run")
    notes: list[str]
    if tail_only:
        last, notes, digest = last_metrics(run_dir), [], None
    else:
        digest, notes = scan_metrics(run_dir, MetricsDigest)
        last = digest.last if digest is not None else None
    attempt = attempts.read_attempt(run_dir)
    times = [t for t in (_mtime(metrics_path(run_dir)), _mtime(run_dir / attempts.ATTEMPT)) if t]
    run = RunData(
        path=run_dir,
        label=label or run_dir.name,
        last=last,
        digest=digest,
        nodes=nodes_by_rank(run_dir),
        restarts=attempts.read_restarts(run_dir),
        membership=read_membership(run_dir),
        attempt=attempt,
        notes=notes,
        last_activity=max(times) if times else None,
        provenance=None if tail_only else read_provenance(run_dir),
        check=None if tail_only else read_check(run_dir),
        evals=[] if tail_only else read_evals(run_dir),
    )
    if run.state == "running" and last is not None and run.last_activity is not None:  # running: active lately
        total = run.total_steps
        notes.append(
            f"in progress: step {last['step']}{f' of {total}' if total else ''}, "
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
