"""``hpc-hsdp check``: a short job of its own that measures every node and link of an allocation
(:mod:`hpc_hsdp.task.fabric_check`), and the table it found."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpc_hsdp.cli.click_options import command_options
from hpc_hsdp.cli.job_options import job_spec_from_options
from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.rundir.observation.fabric_check_record import CHECK_RECORD, check_lines, read_own_check
from hpc_hsdp.submit_host.render import CHECK_ENTRY


@click.command()
@command_options("submit", leaving_out=("sweep", "sweep_mode", "array_parallelism", "check"))
def check(**options) -> None:
    """Submit a job that only measures its nodes and prints what it found: each GPU's matmul,
    host-to-device copy and free memory, the all-reduce inside each node and between pairs of
    nodes (two or three rounds of pairs, whatever the node count), over the backend training
    uses (NCCL on GPUs, gloo on CPUs). A node or link below --check-threshold of its peers'
    median is named with its figures; sockets where NCCL should use InfiniBand is a warning.
    The job's options are submit's (--nodes, --partition, --time, --env ...); the result is
    also in RUN_DIR/check.json. `submit --check` runs the same before training and leaves a
    bad node out. Exit 0: every node as fast as its peers; 1: some are not, or the job failed.

    \b
    hpc-hsdp check --nodes 16 --gpus-per-node 8 --partition gpu --time 10
    hpc-hsdp check --nodes 4 --check-threshold 0.8 --sbatch exclude=gpu-a07
    """
    from hpc_hsdp.cli.jobs_cmd import follow  # noqa: PLC0415  (the follower loads on a submission, not on --help)
    from hpc_hsdp.submit_host.submission import submit_spec  # noqa: PLC0415  (as submit)

    options = {**options, "entry": CHECK_ENTRY, "shard_size": 1, "tp_size": 1, "topology": "off", "check": False}
    spec = job_spec_from_options(options, new_run_dir=True)
    if spec.sweep:
        raise SpecError(
            "check measures one allocation, and the config file sweeps: check without it (--config, --profile), "
            "then sweep"
        )
    handle, _, said = submit_spec(spec)
    click.echo(terminal_safe(said, lines=True), err=True)  # it may quote the run directory's claim
    click.echo(
        f"submitted check job {handle.job_id} ({handle.record.cluster}, {spec.world_size} tasks on {spec.nodes} node(s))"
    )
    code = follow(handle, total_steps=None)
    record, why_not = read_own_check(spec.run.run_dir, handle.job_id)
    if record is None:
        click.echo(
            f"hpc-hsdp: check job {handle.job_id} left no result of its own ({terminal_safe(why_not or '')}); see "
            f"hpc-hsdp logs {spec.run.run_dir}",
            err=True,
        )
        sys.exit(1)
    click.echo(f"check job {handle.job_id} found ({Path(spec.run.run_dir) / CHECK_RECORD}):")
    click.echo(terminal_safe("\n".join(check_lines(record)), lines=True))
    sys.exit(0 if code == 0 and not record.get("bad_nodes") and not record.get("bad_links") else 1)
