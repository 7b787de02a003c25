"""The report's charts (:mod:`.charts`) as one PNG or SVG picture, through matplotlib (the ``report`` extra).

The line charts two abreast, then a full-width heat map per run, under a heading with a
line of words per run (:func:`hpc_hsdp.report.summary.summary_rows`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.report.charts import Heatmap, LineChart, charts
from hpc_hsdp.report.data import RunData
from hpc_hsdp.report.summary import summary_rows
from hpc_hsdp.rundir.lifecycle.provenance_record import commit_id

LINE_ROW_INCHES = 3.375
HEAT_ROW_INCHES = 2.6


def _matplotlib():
    try:
        import matplotlib  # noqa: PLC0415 - optional (the report extra) and slow: off the CLI's path

        matplotlib.use("Agg")
        matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text in an SVG: searchable, small
        import matplotlib.pyplot as plt  # noqa: PLC0415 - as above
    except ImportError:
        raise SpecError(
            "PNG and SVG reports need matplotlib: pip install 'hpc-hsdp[report]' (or matplotlib), "
            "or write HTML (-o report.html), which needs nothing"
        ) from None
    return plt


def _heading(runs: Sequence[RunData]) -> str:
    """The title and a line of words per run."""
    lines = ["hpc-hsdp report: " + ", ".join(run.label for run in runs)]
    for run in runs:
        row = summary_rows(run)
        lines.append(
            f"{run.label}: {row['state']}, step {row['step']}, loss {row['loss']}, eval {row['eval loss']} (best {row['best eval']}), "
            f"{row['tokens/s (median)']} tokens/s; restarts: {row['restarts']}; slowest: {row['slowest']}"
            + (f"; code {commit_id(run.provenance)}" if commit_id(run.provenance) else "")
        )
    return "\n".join(lines)


def _draw_lines(ax, chart: LineChart) -> None:
    """The series, the restart markers, titles, labels, tick text and the legend (or the empty message)."""
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415 - matplotlib is optional, see _matplotlib

    drawn = chart.drawn
    for s in drawn:
        ax.plot(
            s.xs,
            s.ys,
            linestyle="--" if s.dashed else "-",
            marker="o" if s.dots else None,
            markersize=3,
            color=s.color,
            label=s.label,
        )
    for m in chart.markers:
        ax.axvline(m.x, color=m.color, linestyle="--", linewidth=1)
        ax.annotate(
            m.label,
            xy=(m.x, 1),
            xycoords=("data", "axes fraction"),
            xytext=(3, -10),
            textcoords="offset points",
            fontsize=8,
            color=m.color,
        )
    ax.set_title(chart.title, loc="left", fontsize=11)
    ax.set_xlabel(chart.xlabel)
    ax.set_ylabel(chart.ylabel)
    if chart.zero_based and drawn:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if not chart.integer_x:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: chart.x_format(v)))
    if not chart.plain_y:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: chart.y_format(v)))
    if drawn:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, chart.empty_message, transform=ax.transAxes, ha="center", color="#888")


def _ratios(chart: Heatmap) -> list[list[float]]:
    """Rank x probe: own time over the probe's median (NaN where there is none)."""
    world = max(len(times) for times in chart.own_times)
    matrix = [[math.nan] * len(chart.steps) for _ in range(world)]
    for c, times in enumerate(chart.own_times):
        median = statistics.median_low(times)
        for r, t in enumerate(times):
            matrix[r][c] = t / median if median else math.nan
    return matrix


def _rank_ticks(ax, chart: Heatmap, world: int) -> None:
    """``rank r (node)`` beside each row, the slow ones red and bold, up to 32 ranks; a line between nodes."""
    slow = set(chart.slow)
    nodes = chart.nodes or []
    if world <= 32:
        ax.set_yticks(
            range(world),
            [
                f"rank {r}" + (f" ({nodes[r]})" if r < len(nodes) else "") + (" slow" if r in slow else "")
                for r in range(world)
            ],
            fontsize=8,
        )
        for r, tick in enumerate(ax.get_yticklabels()):
            if r in slow:
                tick.set_color("#c00")
                tick.set_fontweight("bold")
    for r in range(1, world):
        if r < len(nodes) and nodes[r] != nodes[r - 1]:
            ax.axhline(r - 0.5, color="#222", linewidth=1.5)


def _draw_heatmap(fig, ax, chart: Heatmap) -> None:
    from matplotlib.colors import LinearSegmentedColormap  # noqa: PLC0415 - matplotlib is optional, see _matplotlib

    ax.set_title(chart.title(with_scale=True), loc="left", fontsize=11)
    if not chart.steps:
        ax.text(0.5, 0.5, chart.empty_message, transform=ax.transAxes, ha="center", color="#888")
        ax.set_axis_off()
        return
    matrix = _ratios(chart)
    cmap = LinearSegmentedColormap.from_list("own", ["#ebf1f7", "#a50f15"])
    image = ax.imshow(matrix, aspect="auto", cmap=cmap, vmin=1.0, vmax=2.0, interpolation="nearest")
    steps = chart.steps
    ticks = list(range(len(steps))) if len(steps) <= 16 else sorted({0, len(steps) // 2, len(steps) - 1})
    ax.set_xticks(ticks, [f"step {steps[i]}" for i in ticks])
    _rank_ticks(ax, chart, len(matrix))
    for m in chart.markers:
        after = [i for i, s in enumerate(steps) if s > m.x]
        if after and after[0] > 0:  # between the last probe of the old attempt and the first of the new
            ax.axvline(after[0] - 0.5, color="#111", linestyle="--", linewidth=1.2)
    bar = fig.colorbar(image, ax=ax, fraction=0.03)
    bar.set_label(chart.scale, fontsize=8)
    if chart.verdict:
        ax.set_xlabel(chart.verdict, color="#c00" if chart.slow else "#444")


def render_figure(runs: Sequence[RunData], output: Path) -> None:
    """Draw the charts of ``runs`` into ``output`` (its suffix, .png or .svg, picks the format)."""
    plt = _matplotlib()
    drawn = charts(runs)
    line_charts = [c for c in drawn if isinstance(c, LineChart)]
    heatmaps = [c for c in drawn if isinstance(c, Heatmap)]
    line_rows = math.ceil(len(line_charts) / 2)
    fig = plt.figure(
        figsize=(13, LINE_ROW_INCHES * line_rows + HEAT_ROW_INCHES * len(heatmaps)), dpi=90, layout="constrained"
    )
    grid = fig.add_gridspec(line_rows + len(heatmaps), 2, height_ratios=[1] * line_rows + [0.9] * len(heatmaps))
    fig.suptitle(_heading(runs), fontsize=10, x=0.01, ha="left")
    for k, chart in enumerate(line_charts):
        _draw_lines(fig.add_subplot(grid[k // 2, k % 2]), chart)
    for k, heatmap in enumerate(heatmaps):
        _draw_heatmap(fig, fig.add_subplot(grid[line_rows + k, :]), heatmap)
    fig.savefig(output, format=output.suffix.lstrip(".").lower())
    plt.close(fig)
