"""``hpc-hsdp report``: one picture of one or several runs (no torch).

Reads run directories (:mod:`hpc_hsdp.report.data`) and draws train and eval loss
against steps and tokens, tokens/s, step time, peak memory, bytes on the wire, each
rank's own step time as a heat map (ranks x steps, nodes marked) and a line at every
restart with its cause. HTML (:mod:`.html`, inline SVG, needs nothing) or PNG/SVG
(:mod:`.figure`, matplotlib).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import write_atomically
from hpc_hsdp.report.data import RunData, load_run, unique_labels
from hpc_hsdp.report.figure import render_figure
from hpc_hsdp.report.html import render_html

FORMATS = (".html", ".png", ".svg")


class NothingToDraw(Exception):
    """No run has a single metrics record."""


def load_runs(paths: Sequence[str | Path], *, labels: Sequence[str | None] | None = None) -> list[RunData]:
    """The runs of ``paths``, labelled by ``labels`` where given (else by the shortest distinct path tails)."""
    resolved = [Path(p) for p in paths]
    for path in resolved:
        if not path.is_dir():
            raise SpecError(f"{str(path)!r} is not a run directory (no such directory); give the --run-dir of a run")
    derived = unique_labels(resolved)
    own = list(labels) if labels is not None else [None] * len(resolved)
    return [load_run(p, label=mine or label) for p, label, mine in zip(resolved, derived, own)]


def check_output(output: str | Path) -> Path:
    """The report file to write: SpecError for a format it cannot have or a missing directory."""
    output = Path(output)
    if output.suffix.lower() not in FORMATS:
        raise SpecError(f"-o {str(output)!r}: the report is written as .html, .png or .svg; give a file name ending so")
    if not output.parent.is_dir():
        raise SpecError(f"-o {str(output)!r}: directory {str(output.parent)!r} does not exist")
    return output


def write_report(runs: Sequence[RunData], output: str | Path) -> Path:
    """Write the report of ``runs`` to ``output`` (its suffix picks the format)."""
    output = check_output(output)
    suffix = output.suffix.lower()
    if not any(run.last for run in runs):
        raise NothingToDraw("; ".join(f"{run.label}: {run.notes[0] if run.notes else 'no metrics'}" for run in runs))
    if suffix == ".html":
        write_atomically(output, render_html(runs))
    else:
        tmp = output.with_name(f".{output.name}.tmp{suffix}")
        try:
            render_figure(runs, tmp)
            tmp.replace(output)
        finally:
            tmp.unlink(missing_ok=True)
    return output
