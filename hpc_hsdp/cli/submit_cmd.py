"""``hpc-hsdp submit``: render the job and submit that very script."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from hpc_hsdp.cli.job_options import job_options, job_spec_from_options

UNKNOWN_GRACE_S = 30


@click.command()
@job_options
@click.option("--cluster", type=click.Choice(["auto", "slurm", "local"]), default="auto", show_default=True,
              help="auto: SLURM when sbatch is found and the controller answers, else the local emulator.")
@click.option("--wait", is_flag=True, help="Follow the job (state, step, loss, tokens/s); exit 0 only if it succeeded.")
@click.option("--dry-run", is_flag=True, help="Print the script that would be submitted; submit nothing.")
def submit(cluster, wait, dry_run, **options) -> None:
    """Render the job's sbatch script and submit it: to SLURM through submitit, or to the
    local emulator (every task a process on this machine, CPU and gloo) without SLURM.

    The script is the one `hpc-hsdp render` prints for the same options; only the
    command each task runs is submitit's. Follow a job later with `hpc-hsdp status`,
    `hpc-hsdp logs`, `hpc-hsdp cancel`, giving its run directory or job id.

    \b
    hpc-hsdp submit --nodes 2 --shard 4 --wait
    hpc-hsdp submit --config job.toml --profile mycluster --steps 200
    """
    from hpc_hsdp.submit import resolve_cluster, submission_script, submit_spec

    spec = job_spec_from_options(options)
    if dry_run:
        click.echo(submission_script(spec), nl=False)
        return
    handle, _, reason = submit_spec(spec, cluster=cluster)
    click.echo(reason, err=True)
    click.echo(f"submitted job {handle.job_id} ({handle.record.cluster}, {spec.world_size} tasks on {spec.nodes} node(s))")
    click.echo(f"run directory: {spec.run.run_dir}")
    if not wait:
        click.echo(f"follow it:     hpc-hsdp status {spec.run.run_dir}   |   hpc-hsdp logs {spec.run.run_dir} --follow")
        return
    sys.exit(follow(handle, total_steps=spec.run.training.steps))


def _last_metrics(run_dir: Path) -> dict | None:
    path = run_dir / "metrics.jsonl"
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, json.JSONDecodeError):
        return None


def follow(handle, *, total_steps: int | None = None, poll_s: float = 1.0) -> int:
    """Show a live line until the job ends; 0 when it completed, 1 otherwise."""
    start = time.monotonic()
    tty = sys.stderr.isatty()
    last_shown = ""
    unknown_since = None
    while True:
        status = handle.status()
        metrics = _last_metrics(Path(handle.record.run_dir))
        line = f"[{time.monotonic() - start:5.0f}s] job {handle.job_id} {status.state}"
        if status.restarts:
            line += f" (restarts {status.restarts})"
        if metrics:
            of = f"/{total_steps}" if total_steps else ""
            line += f" | step {metrics.get('step')}{of} loss {metrics.get('loss', float('nan')):.4f}"
            if metrics.get("tokens_per_s"):
                line += f" {metrics['tokens_per_s']:.0f} tok/s"
        if tty:
            click.echo("\r" + line.ljust(len(last_shown)), nl=False, err=True)
        elif line.split("] ", 1)[1] != last_shown.split("] ", 1)[-1]:
            click.echo(line, err=True)
        last_shown = line
        if status.state == "UNKNOWN":
            unknown_since = unknown_since or time.monotonic()
            if time.monotonic() - unknown_since > UNKNOWN_GRACE_S:
                break
        else:
            unknown_since = None
        if status.finished:
            break
        time.sleep(poll_s)
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
