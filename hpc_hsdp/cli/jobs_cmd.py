"""``hpc-hsdp status | logs | cancel``: a submitted job, found from its run directory or id;
and :func:`follow`, the live line of ``submit --wait``."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click

from hpc_hsdp.errors import HsdpError, SchedulerError, SpecError
from hpc_hsdp.files import copy_from, tail_offset
from hpc_hsdp.plan.units import duration, terminal_safe
from hpc_hsdp.report.data import load_run
from hpc_hsdp.rundir.checkpointing.state import complete_checkpoints
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord, job_record_path
from hpc_hsdp.rundir.lifecycle.provenance_record import commit_id, differences, read_provenance
from hpc_hsdp.rundir.lifecycle.runs import find_run_dirs
from hpc_hsdp.rundir.lifecycle.sweep_record import is_sweep_dir
from hpc_hsdp.rundir.observation.flight_recorder import hang_words
from hpc_hsdp.rundir.observation.tracker_runs import trackers_off
from hpc_hsdp.rundir.training.metrics import latest_eval
from hpc_hsdp.submit_host.handle import JobHandle, job_statuses
from hpc_hsdp.submit_host.status_sections import JobView, failure_of, run_facts, status_fields, status_lines, step_text

JOB_HELP = "JOB is the run directory of the submission, or a job id submitted from this machine."
UNKNOWN_GRACE_S = 30
"""How long a job may stay UNKNOWN (no squeue nor sacct record) before following it stops."""


def _say(text: str, **kwargs) -> None:
    """click.echo of a line that holds words from the run's files (a restart's cause, a replica
    group's event, a node name, a log's last lines): their control characters escaped, so that a
    hostile ``replicas.jsonl`` cannot recolour, move or rewrite the terminal."""
    click.echo(terminal_safe(text, lines=True), **kwargs)


def watch(handle, *, poll_s: float = 1.0) -> Iterator:
    """The job's status every ``poll_s`` seconds; the last one yielded is final (the job
    ended, or the scheduler has not known it for ``UNKNOWN_GRACE_S``)."""
    unknown_since = None
    while True:
        status = handle.status()
        if status.state == "UNKNOWN":
            unknown_since = unknown_since or time.monotonic()
        else:
            unknown_since = None
        ended = status.finished or (unknown_since is not None and time.monotonic() - unknown_since > UNKNOWN_GRACE_S)
        yield status, ended
        if ended:
            return
        time.sleep(poll_s)


def follow(handle, *, total_steps: int | None = None, poll_s: float = 1.0) -> int:
    """Show a live line until the job ends; 0 when it completed, 1 otherwise."""
    start = time.monotonic()
    tty = sys.stderr.isatty()
    last_shown = ""
    said_off: set[str] = set()
    for status, _ in watch(handle, poll_s=poll_s):
        line = f"job {handle.job_id} {status.state}"
        if status.note:
            line += f" [{status.note}]"
        if status.restarts:
            line += f" (restarts {status.restarts})"
        facts = run_facts(handle, status, total_steps=total_steps)
        for off in set(trackers_off(handle.record.run_dir)) - said_off:  # once each, on a line of its own
            _say(("\n" if tty and last_shown else "") + f"hpc-hsdp: {terminal_safe(off)}", err=True)
            said_off.add(off)
        metrics = facts["last"]
        step = step_text(
            metrics,
            total_steps or facts["total_steps"],
            None if metrics is None or "eval_loss" in metrics else latest_eval(handle.record.run_dir),
        )
        line += f" | {step}" if step else ""
        timing = facts["progress"].words() if not status.finished else ""
        line += f" | {timing}" if timing else ""
        line += f" | {facts['stragglers']}" if facts["stragglers"] else ""
        if tty:
            shown = f"[{time.monotonic() - start:5.0f}s] {line}"
            click.echo("\r" + terminal_safe(shown).ljust(len(last_shown)), nl=False, err=True)
            last_shown = shown
        elif line != last_shown:
            _say(f"[{time.monotonic() - start:5.0f}s] {line}", err=True)
            last_shown = line
    if tty:
        _say("", err=True)
    if status.state == "COMPLETED":
        metrics = Path(handle.record.run_dir) / "metrics.jsonl"
        _say(f"job {handle.job_id} completed" + (f"; metrics: {metrics}" if metrics.is_file() else ""), err=True)
        return 0
    _say(
        f"job {handle.job_id} ended {status.state}" + (f" (exit {status.exit_code})" if status.exit_code else ""),
        err=True,
    )
    failure = failure_of(handle, status)
    if failure:
        _say(failure, err=True)
    hang = hang_words(handle.record.run_dir)
    if hang:
        _say(f"hang: {hang}", err=True)
    return 1


@click.command(epilog=JOB_HELP)
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(job, as_json) -> None:
    """State of a submitted job, its restarts and its latest training step; of a sweep's
    directory (submit --sweep), one line per point."""
    if is_sweep_dir(job):
        _sweep_status(job, as_json)
        return
    view = JobView.of(JobHandle.find(job))
    if as_json:
        click.echo(json.dumps(status_fields(view)))
        return
    for line in status_lines(view):
        _say(line)


def _sweep_status(sweep_dir: str, as_json: bool) -> None:
    """``status`` of a sweep: the array, then one line per point (task order)."""
    from hpc_hsdp.submit_host.sweep_handle import SweepHandle, arrays_text, at_once_text  # noqa: PLC0415  (sweeps only)

    handle = SweepHandle.find(sweep_dir)
    results = handle.results()
    record = handle.record
    if as_json:
        data = {
            "sweep_dir": record.sweep_dir,
            "job_id": record.job_ids[0],
            "job_ids": list(record.job_ids),
            "cluster": record.cluster,
            "mode": record.mode,
            "parallelism": record.parallelism,
            "points": [r.to_dict() for r in results],
        }
        click.echo(json.dumps(data))
        return
    counts: dict[str, int] = {}
    for r in results:
        counts[r.state.split()[0]] = counts.get(r.state.split()[0], 0) + 1
    _say(
        f"sweep {record.sweep_dir}: {arrays_text(record)}, {len(results)} points{at_once_text(record)}: "
        + ", ".join(f"{n} {state}" for state, n in counts.items())
    )
    for line in handle.lines(results, ranked_by=False):
        _say(line)


class _Bytes:
    """stdout for the bytes of a log, as they are (click writes them to the binary stream)."""

    def write(self, data: bytes) -> None:
        click.echo(data, nl=False)


FOLLOW_TAIL = 10
"""Lines of each log that ``logs --follow`` shows before the new ones (``tail -f``'s)."""


@click.command(epilog=JOB_HELP)
@click.argument("job")
@click.option("--rank", type=int, default=None, help="Only this node-major rank's log (stdout then stderr).")
@click.option(
    "--follow", "-f", is_flag=True, help=f"Keep printing new lines until the job ends (from the last {FOLLOW_TAIL})."
)
@click.option(
    "--tail",
    "-n",
    "tail",
    type=click.IntRange(min=-1),
    default=None,
    metavar="N",
    help=f"Only the last N lines of each log (read from its end); -1: all. Default: all, with --follow {FOLLOW_TAIL}.",
)
def logs(job, rank, follow, tail) -> None:
    """Print a job's per-task logs (all tasks, or one rank's), streamed: any size in constant memory."""
    handle = JobHandle.find(job)
    if tail is None:
        tail = FOLLOW_TAIL if follow else -1

    def start(path: Path) -> int:
        try:
            return tail_offset(path, tail) if tail >= 0 else 0
        except (OSError, ValueError):
            return 0

    offsets = {p: start(p) for p in handle.log_paths(rank)}
    out = _Bytes()

    def print_new() -> None:
        if rank is None:  # tasks start after the batch step: pick up their logs as they appear (from their start)
            for path in handle.log_paths(None):
                offsets.setdefault(path, 0)
        for path in list(offsets):
            try:
                if path.stat().st_size <= offsets[path]:
                    continue
            except OSError:
                continue
            if len(offsets) > 2 or not follow:
                _say(f"==> {path.name} <==")
            try:
                offsets[path] = copy_from(path, offsets[path], out)
            except (OSError, ValueError):
                continue
        sys.stdout.flush()

    if not follow:
        print_new()
        return
    said = None
    for status, _ in watch(handle):
        print_new()  # after reading the status: the last pass has every line the job wrote
        if status.note != said:  # the scheduler stopped (or started again) answering: say so once
            said = status.note
            _say(f"hpc-hsdp: {said}" if said else "hpc-hsdp: the scheduler answers again", err=True)


CANCEL_WAIT_S = 120
"""How long ``cancel`` waits for the job to end (its ranks agree to stop and save on the SIGTERM)."""


@click.command(epilog=JOB_HELP)
@click.argument("job")
@click.option(
    "--no-wait",
    is_flag=True,
    help="Return once the scheduler has the cancel; by default wait (up to 2 minutes) for the ranks to save "
    "and end, and say which step was saved.",
)
def cancel(job, no_wait) -> None:
    """Cancel a submitted job (scancel, or the local emulator's equivalent): every rank gets SIGTERM,
    agrees to stop after its step, saves a checkpoint and ends, on SLURM and on the emulator alike.
    A sweep's directory cancels every point not ended (one scancel per job array); a point's own
    run directory (or its task id, 123_4) that point alone."""
    if is_sweep_dir(job):
        _cancel_sweep(job, no_wait)
        return
    handle = JobHandle.find(job)
    st = handle.status()
    if st.finished:
        _say(f"job {handle.job_id} already ended ({st.state}); nothing to cancel")
        return
    if st.controller_answered is False:
        raise SchedulerError(f"{st.note}: job {handle.job_id} not cancelled; try again")
    before = _saved_step(handle.record.run_dir)
    handle.cancel()  # once the scheduler's own record of where the job writes is this directory
    if no_wait:
        _say(f"cancelled job {handle.job_id}")
        return
    deadline = time.monotonic() + CANCEL_WAIT_S
    while not handle.status().finished and time.monotonic() < deadline:
        time.sleep(0.5)
    what = _saved_words(before, _saved_step(handle.record.run_dir))
    ended = handle.status()
    _say(f"cancelled job {handle.job_id} ({ended.state if ended.finished else 'still ending'}): {what}")


def _saved_words(before: int | None, saved: int | None, *, resumer: str = "a submit with the same --run-dir") -> str:
    """What a cancel left to resume from: the newest checkpoint before it and after it."""
    if saved is not None and saved != before:
        return f"step {saved} saved: {resumer} resumes from it"
    if saved is not None:
        return f"no new checkpoint; the newest is step {saved}"
    return "no checkpoint saved"


def _cancel_sweep(sweep_dir: str, no_wait: bool) -> None:
    from hpc_hsdp.submit_host.sweep_handle import SweepHandle  # noqa: PLC0415  (sweeps only)

    handle = SweepHandle.find(sweep_dir)
    point_dirs = {point.name: str(handle.record.point_dir(point)) for point in handle.record.points}
    before = {name: _saved_step(point_dir) for name, point_dir in point_dirs.items()}
    cancelled = handle.cancel()
    for refused in handle.refused:
        _say(f"hpc-hsdp: not cancelled: {refused}", err=True)
    if not cancelled:
        _say(f"sweep {sweep_dir}: every point already ended; nothing to cancel")
        return
    arrays = "job array" if len(handle.job_ids) == 1 else "job arrays"
    _say(f"cancelled {len(cancelled)} point(s) of {arrays} {' '.join(handle.job_ids)}: {' '.join(cancelled)}")
    if no_wait:
        return
    deadline = time.monotonic() + CANCEL_WAIT_S
    while not handle.done() and time.monotonic() < deadline:
        time.sleep(0.5)
    for line in handle.lines(handle.results(), ranked_by=False):
        _say(line)
    cancelled_ids = set(cancelled)
    for point, record in handle.job_records():  # what each cancelled point saved, as a job's cancel says
        if record is not None and record.job_id in cancelled_ids:
            saved = _saved_step(point_dirs[point.name])
            _say(f"{point.name}: {_saved_words(before[point.name], saved, resumer='the same submit --sweep')}")


def _saved_step(run_dir: str) -> int | None:
    """The newest complete checkpoint's step (None: none)."""
    try:
        found = complete_checkpoints(run_dir)
    except OSError:
        return None
    return found[-1][0] if found else None


_UNREADABLE = (OSError, ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError)
"""What a run directory's files of other types than hpc-hsdp writes can still raise in a reader."""


def _run_row(path: Path, label: str, broken: str | None, st) -> tuple[float, list[str]]:
    """(last activity, the cells) of one run directory in ``runs``' table."""
    run = load_run(path, tail_only=True)  # the newest record, from the file's end: a long run costs no more
    state = run.state
    if broken is not None:
        state = f"{state} (job.json: {broken})"
    elif st is not None:
        job_state = st.state
        if (
            job_state == "COMPLETED" and state != "not started"
        ):  # not started: no training loop ran (check, fn, --entry)
            state = job_state if state == "completed" else f"{job_state} ({state})"
        else:
            state = job_state
        if not st.current:
            age = st.last_known_age_s()
            state += " (last known" + (f", {duration(age)} ago)" if age is not None else ")")
    last = run.last or {}
    loss = f"{last['loss']:.4f}" if isinstance(last.get("loss"), (int, float)) else "-"
    step = f"{last.get('step', '-')}" + (f"/{run.total_steps}" if run.total_steps else "")
    age = "-" if run.last_activity is None else f"{duration(time.time() - run.last_activity)} ago"
    return run.last_activity or 0, [label, terminal_safe(state), step, loss, age]


@click.command()
@click.argument("directory", default=".", type=click.Path(file_okay=False))
@click.option("--depth", default=4, show_default=True, help="How deep to look for run directories.")
def runs(directory, depth) -> None:
    """List the runs under DIRECTORY: state, step, loss, last activity (newest first)."""
    root = Path(directory)
    if not root.is_dir():
        raise SpecError(f"{directory!r} is not a directory; give the directory that holds your run directories")
    found = find_run_dirs(root, depth)
    if not found:
        _say(f"no runs under {root} (a run directory holds metrics.jsonl, attempt.json or job.json)")
        return
    records, broken = {}, {}
    for path in found:
        if job_record_path(path).is_file():
            try:
                records[path] = JobRecord.load(str(path))
            except HsdpError as exc:  # a broken record is shown, not fatal
                broken[path] = type(exc).__name__
    statuses = job_statuses(list(records.values()))  # one squeue and one sacct for every SLURM job
    notes = sorted({st.note.rsplit(" (", 1)[0] for st in statuses.values() if st.note})
    provenances = {path: read_provenance(path) for path in found}  # what produced each run: where they differ
    rows = []
    for path in found:
        label = terminal_safe(str(path.relative_to(root)) if path != root else ".")
        try:
            st = statuses[records[path].run_dir] if path in records else None
            rows.append(_run_row(path, label, broken.get(path), st))
        except _UNREADABLE as exc:  # one directory that cannot be read is one row, not the end of the listing
            rows.append((0, [label, f"UNKNOWN (unreadable: {type(exc).__name__})", "-", "-", "-"]))
        rows[-1][1].append(terminal_safe(commit_id(provenances[path]) or "-"))
    rows.sort(key=lambda row: -row[0])
    differ = differences(list(provenances.values()))
    if differ:  # the cells of the runs whose code is not the most common one are marked
        codes = [row[5] for _, row in rows if row[5] != "-"]
        usual = max(set(codes), key=codes.count) if codes else None
        for _, row in rows:
            if row[5] not in ("-", usual):
                row[5] += " *"
    table = [["RUN", "STATE", "STEP", "LOSS", "LAST ACTIVITY", "CODE"]] + [row for _, row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for row in table:
        _say("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    if differ:
        _say(f"the runs differ in: {'; '.join(differ)}")
        _say("CODE: the commit (+XXXX: with uncommitted changes, XXXX names them); *: not the most common code")
    for note in notes:
        _say(f"scheduler: {note}; the states marked 'last known' are SLURM's last answer")
