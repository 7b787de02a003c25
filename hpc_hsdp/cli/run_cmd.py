"""``hpc-hsdp run``: what srun (or torchrun) starts on every task."""

from __future__ import annotations

import click

from hpc_hsdp.cli.options import training_from_kwargs, training_options
from hpc_hsdp.job.spec import DEVICES, RunSpec


@click.command()
@click.option(
    "--shard", "shard_size", type=int, default=1, show_default=True, help="Shard-group size S (inner mesh axis)."
)
@click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Run directory: layout.json, metrics.jsonl, checkpoints/.",
)
@click.option(
    "--device",
    type=click.Choice(DEVICES),
    default="auto",
    show_default=True,
    help="auto: this task's GPU when CUDA is usable, else CPU.",
)
@click.option(
    "--entry",
    default=None,
    help="module:function called with the run context on every rank "
    "instead of the built-in payload, e.g. mypkg.train:main.",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=int,
    default=300,
    show_default=True,
    help="Process-group timeout for collectives, in seconds.",
)
@click.option(
    "--comm-stats",
    is_flag=True,
    help="Record each step's collectives (bytes per mesh axis, intra-/inter-node) in metrics.jsonl as 'comm'.",
)
@training_options
def run(shard_size, run_dir, device, entry, timeout_s, comm_stats, **kwargs) -> None:
    """On each task: process group, DeviceMesh ("replicate", "shard"), verified groups, train.

    Start it once per GPU: `srun hpc-hsdp run --shard 4 --run-dir runs/x`, or under
    torchrun (static rendezvous). Rank 0 writes layout.json, metrics.jsonl and the
    checkpoints in the run directory; a rerun resumes from the newest checkpoint.
    `kill -QUIT <pid>` prints a rank's stacks to its log.
    """
    training = training_from_kwargs(kwargs)
    spec = RunSpec(
        shard_size=shard_size,
        run_dir=run_dir,
        device=device,
        entry=entry,
        training=training,
        timeout_s=timeout_s,
        comm_stats=comm_stats,
    )
    from hpc_hsdp.runtime.entry import end_task, exit_code, task_main  # torch loads here, not on `hpc-hsdp --help`

    try:
        task_main(spec)
    except SystemExit as stop:  # 0/75 after a signal stop (see hpc_hsdp.runtime.preemption), 2 on an HsdpError
        end_task(exit_code(stop))
    end_task(0)
