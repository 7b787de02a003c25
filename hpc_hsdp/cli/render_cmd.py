"""``hpc-hsdp render``: the sbatch script of a job, from the Jinja2 templates."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import click

from hpc_hsdp.cli import write_atomically
from hpc_hsdp.cli.click_options import command_options
from hpc_hsdp.cli.job_options import job_spec_from_options
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.sweep import check_sweep_given
from hpc_hsdp.submit_host.render import render_sbatch


@click.command()
@command_options("render")
@click.option(
    "-o",
    "--output",
    "output_path",
    default=None,
    metavar="FILE",
    help="Write the script here (atomically, mode 0755) instead of to stdout.",
)
@click.option(
    "--mkdir/--no-mkdir",
    "make_log_dir",
    default=True,
    show_default=True,
    help="With -o: create <run-dir>/logs, which sbatch needs to exist before the job starts.",
)
def render(output_path, make_log_dir, **kwargs) -> None:
    """Write the sbatch script of a job: the text `hpc-hsdp submit` sends.

    Every option can also come from a TOML config file (--config, $HPC_HSDP_CONFIG) and
    its [profiles.NAME] tables (--profile, $HPC_HSDP_PROFILE); the command line wins over
    the file's top level, which wins over the profile.

    \b
    hpc-hsdp render --nodes 2 --shard 4 --partition gpu --time 02:00:00 -o train.sbatch
    hpc-hsdp render --nodes 4 --shard 16 --launcher torchrun
    hpc-hsdp render --config cluster.toml --profile dev --nodes 2 --shard 4
    """
    spec = job_spec_from_options(kwargs)
    check_sweep_given(spec, kwargs)
    if spec.sweep:  # the job array's script and its first point's
        from hpc_hsdp.cli.job_options import given_options, job_spec_resolver  # noqa: PLC0415
        from hpc_hsdp.submit_host.sweep_submission import dry_run_text, plan_sweep  # noqa: PLC0415  (sweeps only)

        if output_path is not None:
            raise SpecError("render --sweep prints the job arrays' scripts; submit --sweep writes every point's script")
        click.echo(
            dry_run_text(plan_sweep(given_options(kwargs), resolve=job_spec_resolver(), new_run_dir=False)), nl=False
        )
        return
    if spec.run.tp_size > 1:
        from hpc_hsdp.submit_host.preflight import check_tensor_parallel  # noqa: PLC0415  (only --tp: render stays light)

        check_tensor_parallel(spec, config_optional=True)  # an hf: config.json not here is the tasks' to check
    if spec.run.training.dataset.stage_data is not None:
        from hpc_hsdp.submit_host.preflight import check_stage_dir  # noqa: PLC0415  (only --stage-data: render stays light)

        check_stage_dir(
            spec.run.training.dataset
        )  # a DIR that is a file or not writable here; one not here is the nodes'
    text = render_sbatch(spec)
    if output_path is None:
        click.echo(text, nl=False)
        return
    made = _make_log_dir(spec.log_dir) if make_log_dir else []
    try:
        write_atomically(Path(output_path), text)
    except SpecError:
        for directory in reversed(made):  # a script not written leaves no log directory behind
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise


def _make_log_dir(log_dir: str) -> list[Path]:
    """Create ``log_dir`` and its missing parents; the directories made, outermost first."""
    missing = [path for path in (Path(log_dir), *Path(log_dir).parents) if not path.exists()][::-1]
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as exc:
        raise SpecError(
            f"cannot create the log directory {log_dir!r} ({exc.strerror}); "
            f"choose another --run-dir, or pass --no-mkdir and create it where the job runs"
        ) from None
    return missing
