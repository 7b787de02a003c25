"""``hpc-hsdp stacks``: every rank's stack of a running job, grouped, the odd ones out first."""

from __future__ import annotations

import json
import time

import click

from hpc_hsdp.cli.jobs_cmd import JOB_HELP
from hpc_hsdp.job.handle import JobHandle
from hpc_hsdp.job.live_stacks import collect_stacks
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.rundir.stacks import FRAMES_SHOWN, group_stacks, stack_lines


@click.command(epilog=JOB_HELP)
@click.argument("job")
@click.option("--json", "as_json", is_flag=True, help="Print every rank's stack (all threads) and the groups as JSON.")
@click.option(
    "--native/--no-native",
    default=True,
    show_default=True,
    help="With py-spy: native frames (C, CUDA, NCCL) under the Python ones.",
)
@click.option(
    "--python-only",
    is_flag=True,
    help="No py-spy: the Python stacks every rank prints to its log on kill -QUIT (what is used where py-spy "
    "cannot attach).",
)
@click.option("--frames", default=FRAMES_SHOWN, show_default=True, help="Frames shown of each group's stack.")
@click.option("--timeout", "timeout_s", default=60.0, show_default=True, help="Seconds to wait for the nodes.")
def stacks(job, as_json, native, python_only, frames, timeout_s) -> None:
    """Every rank's stack of a running job, now, without stopping it: py-spy on each node (reached
    through the scheduler: srun --overlap on SLURM), or the Python stacks each rank prints on
    kill -QUIT where py-spy cannot attach. Ranks with the same stack are one group; the odd ones
    out come first."""
    started = time.monotonic()
    taken, world = collect_stacks(JobHandle.find(job), native=native, py_spy=not python_only, timeout_s=timeout_s)
    groups = group_stacks(taken, world)
    if as_json:
        click.echo(json.dumps({"world_size": world, "groups": groups, "stacks": taken}))
        return
    for line in stack_lines(groups, world, frames_shown=frames):
        click.echo(terminal_safe(line))
    how = sorted({s.get("how") for s in taken if s.get("how")})
    click.echo(f"({len(taken)} ranks in {time.monotonic() - started:.1f} s; {', '.join(how) or 'no stacks'})")
