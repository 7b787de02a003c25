"""``hpc-hsdp run``: what srun (or torchrun) starts on every task."""

from __future__ import annotations

import click

from hpc_hsdp.cli.options import command_options, run_spec_from_options


@click.command()
@command_options("run")
def run(**options) -> None:
    """On each task: process group, DeviceMesh ("replicate", "shard"), verified groups, train.

    Start it once per GPU: `srun hpc-hsdp run --shard 4 --run-dir runs/x`, or under
    torchrun (static rendezvous). Rank 0 writes layout.json, metrics.jsonl and the
    checkpoints in the run directory; a rerun resumes from the newest checkpoint.
    `kill -QUIT <pid>` prints a rank's stacks to its log.
    """
    spec = run_spec_from_options(options)
    from hpc_hsdp.runtime.entry import end_task, exit_code, task_main  # noqa: PLC0415  (torch loads here, not on `hpc-hsdp --help`)

    try:
        task_main(spec)
    except SystemExit as stop:  # 0/75 after a signal stop (see hpc_hsdp.runtime.preemption), 2 on an HsdpError
        end_task(exit_code(stop))
    end_task(0)
