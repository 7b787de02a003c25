"""``hpc-hsdp report RUN_DIR... [-o FILE]``: a picture of one or several runs."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.report import NothingToDraw, check_output, load_runs, write_report
from hpc_hsdp.rundir.lifecycle.provenance_record import code_words
from hpc_hsdp.rundir.observation.fabric_check_record import check_summary
from hpc_hsdp.rundir.training.evals import evals_summary


@click.command()
@click.argument("run_dirs", nargs=-1, required=True, metavar="RUN_DIR...")
@click.option(
    "-o",
    "--output",
    default=None,
    metavar="FILE",
    help="report.html (one self-contained file), .png or .svg (matplotlib); default: <first RUN_DIR>/report.html.",
)
def report(run_dirs, output) -> None:
    """Draw runs: train and eval loss against steps and tokens, tokens/s, step time, peak
    memory, inter- and intra-node bytes, each rank's own step time (ranks x steps, nodes
    marked: a slow rank or node stands out) and a line at every restart with its cause.
    Several runs are overlaid.

    \b
    hpc-hsdp report runs/a                      # runs/a/report.html
    hpc-hsdp report runs/a runs/b -o cmp.png
    hpc-hsdp report runs/my-sweep               # every point, ranked by its last eval loss (or loss)

    A sweep's directory (submit --sweep) stands for its points: their curves overlaid, each
    labelled with its rank by its last eval loss (else its loss), and the ranking printed.
    """
    from hpc_hsdp.rundir.lifecycle.sweep_record import is_sweep_dir  # noqa: PLC0415

    paths: list[str | Path] = []
    labels: list[str | None] = []
    rankings = []
    for given in run_dirs:
        if not is_sweep_dir(given):
            paths.append(given)
            labels.append(None)
            continue
        from hpc_hsdp.submit_host.sweep_handle import SweepHandle, ranked  # noqa: PLC0415  (sweeps only)

        handle = SweepHandle.find(given)
        order = ranked(handle.results(states=False))
        rankings.append((given, order))
        for rank, result in enumerate(order, 1):
            paths.append(result.run_dir)
            labels.append(f"#{rank} {result.name}")
    runs = load_runs(paths, labels=labels)
    target = check_output(Path(output) if output else Path(run_dirs[0]) / "report.html")
    for run in runs:
        for note in run.notes:
            click.echo(terminal_safe(f"{run.label}: {note}"), err=True)
        code = code_words(run.provenance)
        if code:
            click.echo(terminal_safe(f"{run.label}: code {code}"), err=True)
        if run.check is not None:
            click.echo(terminal_safe(f"{run.label}: check: {check_summary(run.check)}"), err=True)
        if run.evals:
            click.echo(terminal_safe(f"{run.label}: {evals_summary(run.evals)}"), err=True)
            for entry in run.evals:
                click.echo(terminal_safe(f"{run.label}:   {entry.words()}"), err=True)
    try:
        written = write_report(runs, target)
    except NothingToDraw as exc:
        click.echo(terminal_safe(f"hpc-hsdp: nothing to draw: {exc}"), err=True)
        sys.exit(1)
    for given, order in rankings:
        from hpc_hsdp.submit_host.sweep_handle import SweepHandle  # noqa: PLC0415

        by = "eval loss" if all(r.eval_loss is not None for r in order if r.score is not None) else "loss"
        click.echo(f"sweep {given}: {len(order)} points, best first by their last {by}")
        for line in SweepHandle.lines(order):
            click.echo(f"  {line}")
    click.echo(f"report: {written}")
