"""``<run-dir>/metrics.jsonl``: one JSON record per finished step, appended by rank 0.

The runtime appends; every reader reads through here: ``status``, ``runs`` and ``submit
--wait`` look at the file's tail only; ``report`` streams it once (:func:`scan_metrics`:
a chunk of records at a time into a sink of the caller's, memory flat in the run's length,
with notes on lines it skips); a new attempt asks for the last step written before its resume.

Lines are parsed by orjson where it is installed (the ``report`` extra; about twice as fast
as :func:`json.loads` on these records), else by :mod:`json`; a line orjson refuses (``NaN``,
which :func:`json.dumps` writes for a diverged loss) is read by :mod:`json` again.
"""

from __future__ import annotations

import gc
import json
import operator
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from operator import itemgetter
from pathlib import Path
from typing import Any, Protocol, TypeVar

from hpc_hsdp.files import open_regular, parse_json
from hpc_hsdp.rundir.files import append_jsonl
from hpc_hsdp.rundir.status_section import RunView, StatusSection

try:
    from orjson import loads as _fast_loads
except ImportError:  # the report extra is not installed: the standard library's parser

    def _fast_loads(line: bytes | bytearray | memoryview | str, /) -> Any:
        try:
            return json.loads(bytes(line) if isinstance(line, memoryview) else line)
        except RecursionError:  # as orjson refuses nesting past its limit
            raise ValueError("nested too deeply") from None


METRICS = "metrics.jsonl"
CHUNK_BYTES = 1 << 15
"""How much of the file one chunk of records holds (about 60 records of ~550 bytes): small, so that
the chunk stays in the CPU cache while the sink takes it (4 MiB chunks took twice as long)."""


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS


class MetricsLog:
    """The writer of ``metrics.jsonl`` (rank 0; ``run_dir`` None on the other ranks and without a
    run directory): records after ``start_step`` are dropped on resume (the resumed run rewrites
    them), then one line per step."""

    def __init__(self, run_dir: str | Path | None, *, start_step: int, replacing: bool = False) -> None:
        self.path = metrics_path(run_dir) if run_dir is not None else None
        self.replacing = replacing
        """Several writers, one at a time (the leading replica groups of a fault-tolerant run): nothing
        is dropped when the writer opens; a record drops the file's records from its step on first."""
        self._last: int | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not replacing:
                truncate_metrics(self.path, keep_through_step=start_step)

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        step = record.get("step")
        if self.replacing and isinstance(step, int) and (self._last is None or step <= self._last):
            truncate_metrics(self.path, keep_through_step=step - 1)  # a resumed or rejoining writer's first record
        append_jsonl(self.path, record)
        self._last = step if isinstance(step, int) else self._last


def _loads(line: bytes | str):
    """One line's JSON value (ValueError when it is none): orjson, and :mod:`json` for what
    orjson refuses (``NaN``, ``Infinity``, bytes that are not UTF-8; integers past 64 bits stay refused)."""
    try:
        return _fast_loads(line)
    except ValueError:
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        return parse_json(line, where=METRICS, finite=False)  # integers past 64 bits, deep nesting: ValueError


def _step_record(line: bytes | str) -> dict | None:
    try:
        record = _loads(line)
    except ValueError:
        return None
    return record if type(record) is dict and type(record.get("step")) is int else None


def _kept_lines(src, keep_through_step: int, dropped: list[int]) -> Iterator[bytes]:
    """The lines of ``src`` that a resume from ``keep_through_step`` keeps; ``dropped``: [records
    after that step, torn lines] (a line that is not JSON, or the last one without its newline,
    ends the valid part, as :func:`hpc_hsdp.rundir.files.read_jsonl` reads it)."""
    for line in src:
        if not line.strip():
            if line.endswith(b"\n"):
                yield line
            continue
        try:
            record = _loads(line) if line.endswith(b"\n") else None
        except ValueError:
            record = None
        if record is None:
            dropped[1] += 1
            return
        step = record.get("step", 0) if type(record) is dict else 0
        if type(step) is int and step > keep_through_step:
            dropped[0] += 1
            continue
        yield line


def truncate_metrics(path: str | os.PathLike, *, keep_through_step: int) -> int:
    """Keep only the records with ``step <= keep_through_step`` (a resumed run rewrites the
    rest) and drop a line torn by a crash (and what follows it), so that the next append starts
    a line of its own; returns how many records were dropped. Streams the file twice at most
    (memory flat in its length): it is rewritten, atomically, only when something goes."""
    path = Path(path)
    try:
        src = open_regular(path)  # read twice below, closed by the with
    except FileNotFoundError:
        return 0
    with src:
        dropped = [0, 0]
        for _ in _kept_lines(src, keep_through_step, dropped):
            pass
        if not any(dropped):
            return 0
        src.seek(0)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.tmp")
        try:
            with open(tmp, "xb") as out:
                for line in _kept_lines(src, keep_through_step, [0, 0]):
                    out.write(line)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return dropped[0]


def tail_lines(path: str | Path, max_bytes: int) -> list[str] | None:
    """The whole lines in the last ``max_bytes`` of ``path`` (the first one, cut by the
    window, is dropped); None when the file cannot be read."""
    try:
        with open_regular(path) as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            lines = f.read(max_bytes).decode(errors="replace").splitlines()
    except (OSError, ValueError):
        return None
    return lines[1:] if size > max_bytes else lines


def last_record(path: str | Path, *, max_bytes: int = 1 << 22) -> dict | None:
    """The file's last step record: its last line that is one (a line being written, torn, is
    passed over), from a window at the end that grows from 4 KiB (a record of many ranks'
    straggler times is long) to ``max_bytes``; None when there is none there."""
    window = 4096
    while True:
        lines = tail_lines(path, window)
        if lines is None:
            return None
        for line in reversed(lines):
            record = _step_record(line) if line.strip() else None
            if record is not None:
                return record
        try:
            whole = os.path.getsize(path) <= window
        except OSError:
            return None
        if whole or window >= max_bytes:
            return None
        window = min(window * 16, max_bytes)


def last_metrics(run_dir: str | Path) -> dict | None:
    """The newest record (step, loss, tokens_per_s, ...), from the file's tail."""
    return last_record(metrics_path(run_dir))


def recent_metrics(run_dir: str | Path, max_bytes: int = 262_144) -> list[dict]:
    """The step records in the last ``max_bytes`` of the file (a torn line is skipped)."""
    records = (_step_record(line) for line in tail_lines(metrics_path(run_dir), max_bytes) or [])
    return [record for record in records if record is not None]


def latest_eval(run_dir: str | Path, *, tail_bytes: int = 1 << 16) -> tuple[int, float] | None:
    """(step, eval_loss) of the newest record that has one, looking at the file's tail only."""
    for line in reversed(tail_lines(metrics_path(run_dir), tail_bytes) or []):
        if '"eval_loss"' not in line:
            continue
        record = _step_record(line)
        if record is not None and isinstance(record.get("eval_loss"), (int, float)):
            return record["step"], record["eval_loss"]
    return None


def latest_compile(run_dir: str | Path, *, tail_bytes: int = 1 << 20) -> dict | None:
    """``{"step", "compile_s", "compile_cache"}`` of the newest record in which ``--compile``'s
    compiler ran (an attempt's first step, or a recompile), looking at the file's last MiB."""
    for line in reversed(tail_lines(metrics_path(run_dir), tail_bytes) or []):
        if '"compile_s"' not in line:
            continue
        record = _step_record(line)
        if record is not None and isinstance(record.get("compile_s"), (int, float)):
            cache = record.get("compile_cache")
            return {
                "step": record["step"],
                "compile_s": record["compile_s"],
                "compile_cache": cache if isinstance(cache, dict) else {},
            }
    return None


def compile_words(found: dict | None) -> str:
    """``32.8 s at step 1 (cache: 2 of 2 graphs loaded)``: what :func:`latest_compile` found, in words."""
    if not found:
        return ""
    cache = found.get("compile_cache") or {}
    hits, misses = cache.get("fx_graph_hits", 0), cache.get("fx_graph_misses", 0)
    text = f"{found['compile_s']:.1f} s at step {found['step']}"
    if hits + misses:
        text += f" (cache: {hits} of {hits + misses} graphs loaded)"
    return text


def last_step_written(run_dir: str | Path) -> int | None:
    """The step of the file's last record that has one (None: no file, or no step yet): from
    its tail, and where the tail holds no record, the whole file, streamed."""
    record = last_metrics(run_dir)
    if record is not None:
        return record["step"]
    last = None
    try:
        with open_regular(metrics_path(run_dir)) as fh:
            for line in fh:
                record = _step_record(line) if line.strip() else None
                if record is not None:
                    last = record["step"]
    except (OSError, ValueError):
        return None
    return last


class MetricsSink(Protocol):
    def add(self, records: list[dict]) -> None:
        """The next records, in step order (each step once: the newest attempt's)."""


S = TypeVar("S", bound=MetricsSink)


def _chunks(path: Path) -> Iterator[tuple[int, list[bytes]]]:
    """(number of the chunk's first line, its lines): the file, about ``CHUNK_BYTES`` at a time."""
    number = 1
    with open_regular(path) as f:
        while lines := f.readlines(CHUNK_BYTES):
            yield number, lines
            number += len(lines)


_DICT, _INT = {dict}, {int}
_step_of = itemgetter("step")


class _BadLines:
    """The numbers of the lines that are not records: the first five and the last, and how many."""

    def __init__(self) -> None:
        self.first: list[int] = []
        self.last: int | None = None
        self.count = 0

    def append(self, number: int) -> None:
        if len(self.first) < 5:
            self.first.append(number)
        self.last = number
        self.count += 1


def _parse(number: int, lines: list[bytes], bad: _BadLines) -> tuple[list[dict], list[int] | None]:
    """The chunk's step records and their line numbers (None: one per line from ``number`` on, the
    common case of a chunk without blank or bad lines); the numbers of bad lines go to ``bad``."""
    try:
        records = [_fast_loads(line) for line in lines]
        if set(map(type, records)) == _DICT and set(map(type, map(_step_of, records))) == _INT:
            return records, None
    except (ValueError, KeyError, TypeError):
        pass
    records, numbers = [], []
    for n, line in enumerate(lines, number):
        if not line.strip():
            continue
        record = _step_record(line)
        if record is None:
            bad.append(n)
        else:
            records.append(record)
            numbers.append(n)
    return records, numbers


def scan_metrics(run_dir: str | Path, new_sink: Callable[[], S]) -> tuple[S | None, list[str]]:
    """Stream the run's records into a sink (``new_sink()``): each step once, the newest
    attempt's, in step order, a chunk at a time; with notes on what was skipped and why. None
    (and a note) without a file.

    A resumed attempt truncates the file to its checkpoint's step first (:class:`MetricsLog`);
    in a file written otherwise (hpc-hsdp before it did, or by hand) the steps go back where an
    attempt resumed: its records replace those from its first step on, and the file is read
    a second time to skip the replaced ones (the sink of the first reading is dropped)."""
    path = metrics_path(run_dir)
    try:
        open_regular(path).close()
    except FileNotFoundError:
        return None, [f"no {METRICS} yet: nothing trained here (or still starting)"]
    except (OSError, ValueError) as exc:
        return None, [f"{METRICS} cannot be read: {exc}"]
    with _no_cycle_collection():
        return _scan(path, new_sink)


@contextmanager
def _no_cycle_collection():
    """The cyclic garbage collector off while records stream past: records parsed from JSON
    hold no cycles, and with the collector on, every few hundred of them cost a collection
    (about a third of the time of a long file's reading)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _scan(path: Path, new_sink: Callable[[], S]) -> tuple[S, list[str]]:
    sink = new_sink()
    bad = _BadLines()
    starts: list[tuple[int, int]] = []  # (line, step) where the steps went back: an attempt's first record
    previous, lines_read, ends_in_newline, count = None, 0, True, 0
    for number, lines in _chunks(path):
        records, numbers = _parse(number, lines, bad)
        lines_read = number + len(lines) - 1
        ends_in_newline = lines[-1].endswith(b"\n")
        count += len(records)
        steps = [r["step"] for r in records]
        if previous is not None and steps and steps[0] <= previous or not all(map(operator.lt, steps, steps[1:])):
            before = [previous] + steps[:-1] if previous is not None else [None] + steps[:-1]
            for i, (step, prior) in enumerate(zip(steps, before)):
                if prior is not None and step <= prior:
                    starts.append((numbers[i] if numbers is not None else number + i, step))
        if steps:
            previous = steps[-1]
        if not starts:
            sink.add(records)
    if starts:
        sink = new_sink()
        _add_newest(path, sink, starts)
    return sink, _notes(bad, lines_read, ends_in_newline, count)


def _add_newest(path: Path, sink: MetricsSink, starts: list[tuple[int, int]]) -> None:
    """The second reading of a file whose steps go back at ``starts``: a record is kept when no
    later attempt starts at or before its step."""
    # per attempt (from the line where it starts): the lowest first step of the later ones
    limits: list[tuple[int, int | None]] = []
    lowest: int | None = None
    for first_line, step in reversed(starts):
        limits.append((first_line, lowest))
        lowest = step if lowest is None else min(lowest, step)
    limits.append((1, lowest))
    limits.reverse()  # [(first line of attempt k, the limit of its steps)], in file order
    attempt = 0
    for number, lines in _chunks(path):
        kept = []
        for n, line in enumerate(lines, number):
            while attempt + 1 < len(limits) and n >= limits[attempt + 1][0]:
                attempt += 1
            record = _step_record(line) if line.strip() else None
            limit = limits[attempt][1]
            if record is not None and (limit is None or record["step"] < limit):
                kept.append(record)
        sink.add(kept)


def _notes(bad: _BadLines, lines_read: int, ends_in_newline: bool, count: int) -> list[str]:
    notes = []
    first, total = bad.first, bad.count
    if total and bad.last == lines_read and not ends_in_newline:
        total -= 1
        if first and first[-1] == lines_read:
            first = first[:-1]
        notes.append(
            f"{METRICS}: the last line (line {lines_read}) is cut short (being written, or the run was killed); skipped"
        )
    if total:
        shown = ", ".join(map(str, first)) + (", ..." if total > len(first) else "")
        notes.insert(
            0,
            f"{METRICS}: line {shown} is not a metrics record; skipped"
            if total == 1
            else f"{METRICS}: lines {shown} are not metrics records; skipped",
        )
    if not count and not total:
        notes.append(f"{METRICS} is empty: no step finished yet")
    return notes


class _Records(list):
    def add(self, records: list[dict]) -> None:
        self.extend(records)


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[str]]:
    """Every step's record, in step order, and notes on what was skipped and why: the whole
    file in memory (a short run; ``report`` streams it through :func:`scan_metrics`)."""
    records, notes = scan_metrics(run_dir, _Records)
    return list(records or []), notes


COMPILE_SECTION: StatusSection[RunView, dict | None] = StatusSection(
    name="compile",
    read=lambda view: latest_compile(view.run_dir),
    lines=lambda found: [f"compile: {compile_words(found)} (apart from the step times)"] if found else [],
    fields=lambda found: {"compile": found},
)
