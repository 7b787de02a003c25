"""``<run-dir>/metrics.jsonl``: one JSON record per finished step, appended by rank 0.

The runtime appends; every reader reads through here: ``status`` and ``submit --wait``
look at the file's tail only, ``report`` reads it whole (with notes on lines it skips),
a new attempt asks for the last step written before its resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_hsdp.rundir.files import append_jsonl, atomic_write_text, read_jsonl

METRICS = "metrics.jsonl"


def metrics_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS


class MetricsLog:
    """The writer of ``metrics.jsonl`` (rank 0; ``run_dir`` None on the other ranks and without a
    run directory): records after ``start_step`` are dropped on resume (the resumed run rewrites
    them), then one line per step."""

    def __init__(self, run_dir: str | Path | None, *, start_step: int) -> None:
        self.path = metrics_path(run_dir) if run_dir is not None else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            truncate_metrics(self.path, keep_through_step=start_step)

    def write(self, record: dict) -> None:
        if self.path is not None:
            append_jsonl(self.path, record)


def truncate_metrics(path: str | os.PathLike, *, keep_through_step: int) -> int:
    """Keep only the records with ``step <= keep_through_step`` (a resumed run rewrites the
    rest) and drop a line torn by a crash, so that the next append starts a line of its own;
    returns how many records were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    records = read_jsonl(path)
    kept = [r for r in records if r.get("step", 0) <= keep_through_step]
    text = "".join(json.dumps(r) + "\n" for r in kept)
    if path.read_text(encoding="utf-8") != text:
        atomic_write_text(path, text)
    return len(records) - len(kept)


def tail_lines(path: str | Path, max_bytes: int) -> list[str] | None:
    """The whole lines in the last ``max_bytes`` of ``path`` (the first one, cut by the
    window, is dropped); None when the file cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    return lines[1:] if size > max_bytes else lines


def _step_record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def last_metrics(run_dir: str | Path) -> dict | None:
    """The newest record (step, loss, tokens_per_s, ...), from the file's last 4 KiB."""
    lines = [line for line in tail_lines(metrics_path(run_dir), 4096) or [] if line.strip()]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


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
    """The step of the file's last record that has one (None: no file, or no step yet)."""
    last = None
    try:
        with open(metrics_path(run_dir), encoding="utf-8") as fh:
            for line in fh:
                try:
                    step = json.loads(line).get("step")
                except (ValueError, AttributeError):
                    continue
                if isinstance(step, int):
                    last = step
    except OSError:
        return None
    return last


def read_metrics(run_dir: str | Path) -> tuple[list[dict], list[str]]:
    """Every step's newest record, in step order, and notes on what was skipped and why
    (a resumed attempt rewrites the steps after its checkpoint: the newest of each wins)."""
    path = metrics_path(run_dir)
    notes: list[str] = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return [], [f"no {METRICS} yet: nothing trained here (or still starting)"]
    lines = text.splitlines()
    records, bad = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _step_record(line)
        if record is None:
            bad.append(number)
        else:
            records.append(record)
    if bad and bad[-1] == len(lines) and not text.endswith("\n"):
        bad.pop()
        notes.append(
            f"{METRICS}: the last line (line {len(lines)}) is cut short (being written, or the run was killed); skipped"
        )
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        notes.insert(
            0,
            f"{METRICS}: line {shown} is not a metrics record; skipped"
            if len(bad) == 1
            else f"{METRICS}: lines {shown} are not metrics records; skipped",
        )
    if not records and not bad:
        notes.append(f"{METRICS} is empty: no step finished yet")
    by_step: dict[int, dict] = {}
    for record in records:
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)], notes
