"""``hpc-hsdp stacks``: every rank's stack of a running job, grouped, the odd ones out first;
``hpc-hsdp debug``: one rank in pdb at a step boundary, the others waiting."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time

import click

from hpc_hsdp.cli.jobs_cmd import JOB_HELP
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.rundir.observation.stacks import FRAMES_SHOWN, group_stacks, stack_lines
from hpc_hsdp.submit_host.debug_attach import attach_argv, request_debugger
from hpc_hsdp.submit_host.handle import JobHandle
from hpc_hsdp.submit_host.live_stacks import collect_stacks


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
    how = sorted({str(s["how"]) for s in taken if s.get("how")})
    click.echo(f"({len(taken)} ranks in {time.monotonic() - started:.1f} s; {', '.join(how) or 'no stacks'})")


@click.command(epilog=JOB_HELP)
@click.argument("job")
@click.option("--rank", type=int, required=True, help="The node-major rank to stop in the debugger.")
@click.option(
    "--at-step", type=int, default=None, help="Stop at the boundary after this step (default: the next boundary)."
)
@click.option(
    "--no-attach", is_flag=True, help="Print where the rank's debugger listens and the command that attaches; exit."
)
@click.option("--timeout", "timeout_s", type=float, default=None, help="Seconds to wait for the rank to stop.")
def debug(job, rank, at_step, no_attach, timeout_s) -> None:
    """Stop one rank of a running job in pdb at a step boundary, the other ranks waiting at the same
    boundary (the hang watchdog paused), and attach this terminal to it (through srun --overlap on
    SLURM). In pdb: 'c' resumes every rank, as if nothing happened; 'q' ends the job (every rank
    saves and stops)."""
    handle = JobHandle.find(job)
    session = request_debugger(
        handle, rank=rank, at_step=at_step, timeout_s=timeout_s, say=lambda line: click.echo(line, err=True)
    )
    command = handle.backend.on_node_command(handle.record, session["node"], attach_argv(session["socket"]))
    click.echo(
        terminal_safe(
            f"rank {rank} stopped after step {session['step']} on node {session['node']}; "
            f"its pdb listens on {session['socket']}"
        ),
        err=True,
    )
    if no_attach:
        click.echo(shlex.join(command))
        return
    sys.exit(subprocess.call(command))
