"""``hpc-hsdp status | logs | cancel``: a submitted job, found from its run directory or id."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

JOB_HELP = "JOB is the run directory of the submission, or a job id submitted from this machine."


@click.command(epilog=JOB_HELP)
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status(job, as_json) -> None:
    """State of a submitted job, its restarts and its latest training step."""
    from hpc_hsdp.cli.submit_cmd import _last_metrics
    from hpc_hsdp.submit import JobHandle

    handle = JobHandle.find(job)
    st = handle.status()
    metrics = _last_metrics(Path(handle.record.run_dir))
    data = {"job_id": handle.job_id, "cluster": handle.record.cluster, "state": st.state, "exit_code": st.exit_code,
            "restarts": st.restarts, "reason": st.reason, "run_dir": handle.record.run_dir,
            "last_step": metrics}  # fmt: skip
    if as_json:
        click.echo(json.dumps(data))
        return
    click.echo(f"job {handle.job_id} ({handle.record.cluster}): {st.state}"
               + (f", exit {st.exit_code}" if st.exit_code else "") + (f", reason {st.reason}" if st.reason else "")
               + f", restarts {st.restarts}")  # fmt: skip
    if metrics:
        click.echo(f"last step {metrics.get('step')}: loss {metrics.get('loss')}, {metrics.get('tokens_per_s')} tok/s")
    click.echo(f"run directory: {handle.record.run_dir}")


@click.command(epilog=JOB_HELP)
@click.argument("job")
@click.option("--rank", type=int, default=None, help="Only this node-major rank's log (stdout then stderr).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
def logs(job, rank, follow) -> None:
    """Print a job's per-task logs (all tasks, or one rank's)."""
    from hpc_hsdp.submit import JobHandle

    handle = JobHandle.find(job)
    paths = handle.log_paths(rank)
    offsets = {p: 0 for p in paths}
    while True:
        for path in list(offsets):
            if not path.exists():
                continue
            with open(path, "rb") as f:
                f.seek(offsets[path])
                chunk = f.read()
                offsets[path] = f.tell()
            if chunk:
                text = chunk.decode(errors="replace")
                if len(offsets) > 2 or not follow:
                    click.echo(f"==> {path.name} <==")
                click.echo(text, nl=False)
        if not follow or handle.status().finished:
            break
        if rank is None:
            for p in handle.log_paths(None):
                offsets.setdefault(p, 0)
        sys.stdout.flush()
        time.sleep(1)


@click.command(epilog=JOB_HELP)
@click.argument("job")
def cancel(job) -> None:
    """Cancel a submitted job (scancel, or the local emulator's equivalent)."""
    from hpc_hsdp.submit import JobHandle

    handle = JobHandle.find(job)
    handle.cancel()
    click.echo(f"cancelled job {handle.job_id}")
