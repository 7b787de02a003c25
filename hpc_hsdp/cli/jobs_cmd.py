"""``hpc-hsdp status | logs | cancel``: a submitted job, found from its run directory or id;
and :func:`follow`, the live line of ``submit --wait``."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import click

JOB_HELP = "JOB is the run directory of the submission, or a job id submitted from this machine."
UNKNOWN_GRACE_S = 30
"""How long a job may stay UNKNOWN (no squeue nor sacct record) before following it stops."""


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


def step_text(metrics: dict | None, total_steps: int | None = None, last_eval: tuple[int, float] | None = None) -> str:
    """``step 12/20 loss 5.5022 eval 5.61 (step 10) 5769 tok/s`` from a metrics.jsonl record
    ('' without one); ``last_eval``: the latest (step, eval loss) when the record has none."""
    if not metrics or metrics.get("step") is None:
        return ""
    text = f"step {metrics['step']}" + (f"/{total_steps}" if total_steps else "")
    if isinstance(metrics.get("loss"), (int, float)):
        text += f" loss {metrics['loss']:.4f}"
    if isinstance(metrics.get("eval_loss"), (int, float)):
        text += f" eval {metrics['eval_loss']:.4f}"
    elif last_eval is not None and last_eval[0] <= metrics["step"]:
        text += f" eval {last_eval[1]:.4f} (step {last_eval[0]})"
    if isinstance(metrics.get("tokens_per_s"), (int, float)):
        text += f" {metrics['tokens_per_s']:.0f} tok/s"
    return text


def latest_eval(run_dir: str | Path, *, tail_bytes: int = 1 << 16) -> tuple[int, float] | None:
    """(step, eval_loss) of the newest record of ``<run_dir>/metrics.jsonl`` that has one,
    looking at the file's tail only."""
    try:
        with open(Path(run_dir) / "metrics.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if '"eval_loss"' not in line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record.get("eval_loss"), (int, float)) and isinstance(record.get("step"), int):
            return record["step"], record["eval_loss"]
    return None


def follow(handle, *, total_steps: int | None = None, poll_s: float = 1.0) -> int:
    """Show a live line until the job ends; 0 when it completed, 1 otherwise."""
    start = time.monotonic()
    tty = sys.stderr.isatty()
    last_shown = ""
    for status, _ in watch(handle, poll_s=poll_s):
        line = f"job {handle.job_id} {status.state}"
        if status.restarts:
            line += f" (restarts {status.restarts})"
        metrics = handle.last_metrics()
        step = step_text(metrics, total_steps, None if metrics is None or "eval_loss" in metrics
                         else latest_eval(handle.record.run_dir))  # fmt: skip
        line += f" | {step}" if step else ""
        if tty:
            shown = f"[{time.monotonic() - start:5.0f}s] {line}"
            click.echo("\r" + shown.ljust(len(last_shown)), nl=False, err=True)
            last_shown = shown
        elif line != last_shown:
            click.echo(f"[{time.monotonic() - start:5.0f}s] {line}", err=True)
            last_shown = line
    if tty:
        click.echo("", err=True)
    if status.state == "COMPLETED":
        click.echo(f"job {handle.job_id} completed; metrics: {Path(handle.record.run_dir) / 'metrics.jsonl'}", err=True)
        return 0
    click.echo(f"job {handle.job_id} ended {status.state}" + (f" (exit {status.exit_code})" if status.exit_code else ""),
               err=True)  # fmt: skip
    summary = handle.failure_summary()
    if summary:
        click.echo(summary, err=True)
    return 1


@click.command(epilog=JOB_HELP)
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(job, as_json) -> None:
    """State of a submitted job, its restarts and its latest training step."""
    from hpc_hsdp.scheduler import JobHandle

    handle = JobHandle.find(job)
    st = handle.status()
    metrics = handle.last_metrics()
    from hpc_hsdp.run_state import restarts

    causes = [r for r in restarts(handle.record.run_dir) if r.get("job_id") in ("", handle.job_id)]
    data = {"job_id": handle.job_id, "cluster": handle.record.cluster, "state": st.state, "exit_code": st.exit_code,
            "restarts": st.restarts, "reason": st.reason, "run_dir": handle.record.run_dir,
            "last_step": metrics, "restart_causes": causes}  # fmt: skip
    if as_json:
        click.echo(json.dumps(data))
        return
    click.echo(f"job {handle.job_id} ({handle.record.cluster}): {st.state}"
               + (f", exit {st.exit_code}" if st.exit_code else "") + (f", reason {st.reason}" if st.reason else "")
               + f", restarts {st.restarts}")  # fmt: skip
    for record in causes:
        click.echo(f"restart {record['restart']} ({record['kind']}): {record['cause']}")
    step = step_text(metrics, last_eval=None if metrics is None or "eval_loss" in metrics
                     else latest_eval(handle.record.run_dir))  # fmt: skip
    if step:
        click.echo(f"last {step}")
    click.echo(f"run directory: {handle.record.run_dir}")


@click.command(epilog=JOB_HELP)
@click.argument("job")
@click.option("--rank", type=int, default=None, help="Only this node-major rank's log (stdout then stderr).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
def logs(job, rank, follow) -> None:
    """Print a job's per-task logs (all tasks, or one rank's)."""
    from hpc_hsdp.scheduler import JobHandle

    handle = JobHandle.find(job)
    offsets = {p: 0 for p in handle.log_paths(rank)}

    def print_new() -> None:
        if rank is None:  # tasks start after the batch step: pick up their logs as they appear
            for path in handle.log_paths(None):
                offsets.setdefault(path, 0)
        for path in list(offsets):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(offsets[path])
                chunk = f.read()
                offsets[path] = f.tell()
            if chunk:
                if len(offsets) > 2 or not follow:
                    click.echo(f"==> {path.name} <==")
                click.echo(chunk.decode(errors="replace"), nl=False)
        sys.stdout.flush()

    if not follow:
        print_new()
        return
    for _ in watch(handle):
        print_new()  # after reading the status: the last pass has every line the job wrote


@click.command(epilog=JOB_HELP)
@click.argument("job")
def cancel(job) -> None:
    """Cancel a submitted job (scancel, or the local emulator's equivalent)."""
    from hpc_hsdp.scheduler import JobHandle

    handle = JobHandle.find(job)
    st = handle.status()
    if st.finished:
        click.echo(f"job {handle.job_id} already ended ({st.state}); nothing to cancel")
        return
    handle.cancel()
    click.echo(f"cancelled job {handle.job_id}")
