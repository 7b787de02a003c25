"""``hpc-hsdp export``: a run's sharded checkpoint as files the ecosystem loads, offline."""

from __future__ import annotations

import click

from hpc_hsdp.plan.units import terminal_safe


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--step", type=int, default=None, help="Checkpoint step to export.  [default: the newest complete one]")
@click.option(
    "-o",
    "--output",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="New directory to write (must not exist, or be empty).",
)
@click.option(
    "--model",
    default=None,
    metavar="MODULE:FUNCTION",
    help="The factory that built a MODULE:FUNCTION run's model, named again: export imports no code that the "
    "run's model.json names.",
)
def export(run_dir, step, out_dir, model) -> None:
    """Convert RUN_DIR's distributed checkpoint on this one process (no GPUs, no job).

    \b
    hf:PATH models:  DIR/config.json + DIR/model.safetensors (+ tokenizer files when the
                     run's --data has a tokenizer/): AutoModelForCausalLM.from_pretrained(DIR)
    other models:    DIR/model.safetensors + DIR/model.json (model, config, options);
                     a MODULE:FUNCTION model is built by the --model you name again
    """
    from hpc_hsdp.task.checkpointing.export import export as run_export  # noqa: PLC0415 - torch loads only when a run is exported

    result = run_export(run_dir, out_dir, step=step, factory=model)
    for path in result["skipped"]:
        click.echo(
            terminal_safe(f"hpc-hsdp: warning: not exported: {path} is a symlink or not a regular file"), err=True
        )
    click.echo(
        terminal_safe(
            f"exported step {result['step']} ({result['kind']}) to {result['out_dir']}: {', '.join(result['files'])}"
        )
    )
