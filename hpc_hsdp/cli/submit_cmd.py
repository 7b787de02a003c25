"""``hpc-hsdp submit``: render the job and submit that very script."""

from __future__ import annotations

import shlex
import sys

import click

from hpc_hsdp.cli.click_options import command_options
from hpc_hsdp.cli.job_options import given_options, job_spec_from_options, job_spec_resolver
from hpc_hsdp.job.sweep import check_sweep_given
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.submit_host.submission import submission_script, submit_spec


@click.command()
@command_options("submit")
@click.option("--wait", is_flag=True, help="Follow the job (state, step, loss, tokens/s); exit 0 only if it succeeded.")
@click.option("--dry-run", is_flag=True, help="Print the script that would be submitted; submit nothing.")
def submit(wait, dry_run, **options) -> None:
    """Render the job's sbatch script and submit it: to SLURM through submitit, or to the
    local emulator (every task a process on this machine, CPU and gloo) without SLURM.

    The script is the one `hpc-hsdp render` prints for the same options; only the
    command each task runs is submitit's. Follow a job later with `hpc-hsdp status`,
    `hpc-hsdp logs`, `hpc-hsdp cancel`, giving its run directory or job id.

    Before anything is submitted, the files and modules the tasks will open are checked
    here (--data holds one global batch, --val-data exists, --model and --entry can be
    found, the run directory's checkpoint continues with this --seed, global batch and
    data): a job that would fail on them waits in no queue. --precision fp8 is refused here
    when the job's GPUs are known to lack Float8 (this machine's for the emulator; the
    partition's GRES types or node features on SLURM).

    \b
    hpc-hsdp submit --nodes 2 --shard 4 --wait
    hpc-hsdp submit --config job.toml --profile mycluster --steps 200
    hpc-hsdp submit --nodes 2 --shard 4 --sweep lr=3e-4,1e-3 --sweep seed=0,1 --array-parallelism 2

    With --sweep, one job array: each point a whole job with its own run directory
    (<run-dir>/lr=3e-4,seed=0), requeued and resumed alone; status, runs, report and
    cancel take the sweep's directory (docs/sweeps.md). Points that differ in their
    #SBATCH header (--sweep nodes=1,2, --time, --partition ...) are one job array per
    distinct header; --array-parallelism K then bounds each array (SLURM's %K).
    """
    from hpc_hsdp.cli.jobs_cmd import follow  # noqa: PLC0415  (the follower loads on a submission, not on --help)

    spec = job_spec_from_options(options, new_run_dir=True)
    check_sweep_given(spec, options)
    if spec.sweep:
        _submit_sweep(options, wait=wait, dry_run=dry_run)
        return
    if dry_run:
        click.echo(submission_script(spec), nl=False)
        return
    handle, _, said = submit_spec(spec)  # from which step it resumes, and why this cluster
    click.echo(terminal_safe(said, lines=True), err=True)  # it may quote the run directory's claim
    click.echo(
        f"submitted job {handle.job_id} ({handle.record.cluster}, {spec.world_size} tasks on {spec.nodes} node(s)"
        + (f"; at least {spec.min_nodes}: SLURM grants {spec.nodes_text}" if spec.flexible else "")
        + ")"
    )
    click.echo(f"run directory: {spec.run.run_dir}")
    if not wait:
        run_dir = shlex.quote(spec.run.run_dir)
        click.echo(f"follow it:     hpc-hsdp status {run_dir}   |   hpc-hsdp logs {run_dir} --follow")
        return
    try:
        code = follow(handle, total_steps=spec.run.training.optimizer.steps)
    except KeyboardInterrupt:
        run_dir = shlex.quote(spec.run.run_dir)
        click.echo(
            f"\nhpc-hsdp: stopped following; job {handle.job_id} goes on. Follow it again with "
            f"hpc-hsdp status {run_dir}; stop it with hpc-hsdp cancel {run_dir}",
            err=True,
        )
        code = 130
    sys.exit(code)


def _submit_sweep(options, *, wait, dry_run) -> None:
    """``submit --sweep``: its job arrays, or with ``--dry-run`` its points and scripts."""
    from hpc_hsdp.submit_host.sweep_handle import arrays_text, at_once_text  # noqa: PLC0415  (sweeps only)
    from hpc_hsdp.submit_host.sweep_submission import dry_run_text, plan_sweep, submit_sweep  # noqa: PLC0415  (sweeps only)

    plan = plan_sweep(given_options(options), resolve=job_spec_resolver())
    if dry_run:
        click.echo(dry_run_text(plan), nl=False)
        return
    record, said = submit_sweep(plan)
    click.echo(terminal_safe(said, lines=True), err=True)  # it may quote the run directory's claim
    click.echo(f"submitted {arrays_text(record)}: {len(record.points)} points{at_once_text(record)}")
    for point in record.points:
        click.echo(f"  {record.task_id(point)}  {point.name}")
    sweep_dir = shlex.quote(record.sweep_dir)
    click.echo(f"sweep directory: {record.sweep_dir}")
    click.echo(f"follow it:     hpc-hsdp status {sweep_dir}   |   hpc-hsdp report {sweep_dir}")
    if wait:
        from hpc_hsdp.submit_host.sweep_handle import SweepHandle  # noqa: PLC0415

        handle = SweepHandle(record)
        try:
            results = handle.wait()
        except KeyboardInterrupt:
            click.echo(f"\nhpc-hsdp: stopped following; the sweep goes on (hpc-hsdp status {sweep_dir})", err=True)
            sys.exit(130)
        for line in handle.lines(results):
            click.echo(line)
        sys.exit(0 if all(r.state == "COMPLETED" for r in results) else 1)
