"""The report as one PNG or SVG picture, through matplotlib (the ``report`` extra)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.units import byte_unit, seconds, si
from hpc_hsdp.report.data import RunData
from hpc_hsdp.report.html import markers
from hpc_hsdp.report.summary import summary_rows
from hpc_hsdp.report.svg import PALETTE
from hpc_hsdp.rundir.stragglers import persistent_ranks


def _matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text in an SVG: searchable, small
        import matplotlib.pyplot as plt
        from matplotlib.colors import LinearSegmentedColormap
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise SpecError(
            "PNG and SVG reports need matplotlib: pip install 'hpc-hsdp[report]' (or matplotlib), "
            "or write HTML (-o report.html), which needs nothing"
        ) from None
    return plt, LinearSegmentedColormap, FuncFormatter


def render_figure(runs: Sequence[RunData], output: Path) -> None:
    plt, LinearSegmentedColormap, FuncFormatter = _matplotlib()
    single = len(runs) == 1
    heat_rows = len(runs)
    fig = plt.figure(figsize=(13, 13.5 + 2.6 * heat_rows), dpi=90, layout="constrained")
    grid = fig.add_gridspec(4 + heat_rows, 2, height_ratios=[1, 1, 1, 1] + [0.9] * heat_rows)
    title = "hpc-hsdp report: " + ", ".join(run.label for run in runs)
    lines = []
    for run in runs:
        row = summary_rows(run)
        lines.append(
            f"{run.label}: {row['state']}, step {row['step']}, loss {row['loss']}, eval {row['eval loss']}, "
            f"{row['tokens/s (median)']} tokens/s; restarts: {row['restarts']}; slowest: {row['slowest']}"
        )
    fig.suptitle(title + "\n" + "\n".join(lines), fontsize=10, x=0.01, ha="left")
    marks = markers(runs)

    def mark(ax) -> None:
        for m in marks:
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

    def lines_of(ax, key, label, *, dashed=False, dots=False, offset=0, factor=1.0):
        drawn = False
        for i, run in enumerate(runs):
            xs, ys = run.series(key)
            if xs:
                ax.plot(
                    xs,
                    [y / factor for y in ys],
                    linestyle="--" if dashed else "-",
                    marker="o" if dots else None,
                    markersize=3,
                    color=PALETTE[(i + offset) % len(PALETTE)],
                    label=label if single else f"{run.label}: {label}",
                )
                drawn = True
        return drawn

    def finish(ax, title, xlabel, formatter=None, empty="no data recorded", drawn=True, ylabel="", zero=False):
        ax.set_title(title, loc="left", fontsize=11)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if zero and drawn:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if formatter is not None:
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: formatter(v)))
        if drawn:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", color="#888")

    ax = fig.add_subplot(grid[0, 0])
    drawn = lines_of(ax, "loss", "train loss") | lines_of(
        ax, "eval_loss", "eval loss", dashed=True, dots=True, offset=4 if single else 0
    )
    mark(ax)
    finish(ax, "Loss", "step", drawn=drawn)

    ax = fig.add_subplot(grid[0, 1])
    drawn = False
    for i, run in enumerate(runs):
        tokens = dict(run.tokens_axis())
        for key, label, dashed in (("loss", "train loss", False), ("eval_loss", "eval loss", True)):
            xs, ys = run.series(key)
            if xs:
                ax.plot(
                    [tokens[x] for x in xs],
                    ys,
                    linestyle="--" if dashed else "-",
                    marker="o" if dashed else None,
                    markersize=3,
                    color=PALETTE[(i + (4 if single and dashed else 0)) % len(PALETTE)],
                    label=label if single else f"{run.label}: {label}",
                )
                drawn = True
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: si(v)))
    finish(ax, "Loss against tokens", "tokens seen", drawn=drawn)

    ax = fig.add_subplot(grid[1, 0])
    drawn = lines_of(ax, "tokens_per_s", "tokens/s")
    mark(ax)
    finish(ax, "Throughput", "step", si, drawn=drawn, ylabel="tokens/s", zero=True)

    ax = fig.add_subplot(grid[1, 1])
    drawn = lines_of(ax, "step_time_s", "step time (rank 0)") | lines_of(
        ax, "data_wait_s", "data wait", dashed=True, offset=2 if single else 0
    )
    mark(ax)
    finish(ax, "Step time", "step", seconds, drawn=drawn)

    ax = fig.add_subplot(grid[2, 0])
    drawn = lines_of(ax, "lr", "lr")
    mark(ax)
    finish(ax, "Learning rate", "step", drawn=drawn, zero=True)

    ax = fig.add_subplot(grid[2, 1])
    drawn = lines_of(ax, "grad_norm", "global grad norm")
    mark(ax)
    finish(ax, "Gradient norm (before clipping)", "step", drawn=drawn)

    ax = fig.add_subplot(grid[3, 0])
    factor, unit = byte_unit([y for run in runs for y in run.series("peak_mem_bytes")[1]])
    drawn = lines_of(ax, "peak_mem_bytes", "peak memory (rank 0)", factor=factor)
    mark(ax)
    finish(ax, "Peak memory", "step", drawn=drawn, ylabel=unit)

    ax = fig.add_subplot(grid[3, 1])
    drawn = False
    keys = ("inter_node_wire_bytes", "intra_node_wire_bytes")
    factor, unit = byte_unit([y for run in runs for key in keys for y in run.comm_series(key)[1]])
    for i, run in enumerate(runs):
        for key, label, dashed in (
            ("inter_node_wire_bytes", "inter-node", False),
            ("intra_node_wire_bytes", "intra-node", True),
        ):
            xs, ys = run.comm_series(key)
            if xs:
                color = PALETTE[(0 if dashed else 1) % len(PALETTE)] if single else PALETTE[i % len(PALETTE)]
                ax.plot(
                    xs,
                    [y / factor for y in ys],
                    linestyle="--" if dashed else "-",
                    color=color,
                    label=f"{label} bytes sent (rank 0)" if single else f"{run.label}: {label}",
                )
                drawn = True
    mark(ax)
    finish(
        ax,
        "Bytes on the wire per step",
        "step",
        empty="no traffic recorded (run with --comm-stats)",
        drawn=drawn,
        ylabel=unit,
        zero=True,
    )

    cmap = LinearSegmentedColormap.from_list("own", ["#ebf1f7", "#a50f15"])
    for k, run in enumerate(runs):
        ax = fig.add_subplot(grid[4 + k, :])
        probes = run.straggler_probes()
        label = "" if single else f" — {run.label}"
        ax.set_title(f"Own step time per rank, over the step's median{label}", loc="left", fontsize=11)
        if not probes:
            ax.text(
                0.5,
                0.5,
                "no per-rank step times recorded (--straggler-every 0, or one rank)",
                transform=ax.transAxes,
                ha="center",
                color="#888",
            )
            ax.set_axis_off()
            continue
        world = max(len(e["own_time_s"]) for _, e in probes)
        matrix = [[float("nan")] * len(probes) for _ in range(world)]
        for c, (_, entry) in enumerate(probes):
            times = entry["own_time_s"]
            median = statistics.median_low(times)
            for r, t in enumerate(times):
                matrix[r][c] = t / median if median else float("nan")
        image = ax.imshow(matrix, aspect="auto", cmap=cmap, vmin=1.0, vmax=2.0, interpolation="nearest")
        steps = [s for s, _ in probes]
        ticks = list(range(len(steps))) if len(steps) <= 16 else sorted({0, len(steps) // 2, len(steps) - 1})
        ax.set_xticks(ticks, [f"step {steps[i]}" for i in ticks])
        slow = persistent_ranks([entry for _, entry in probes])
        nodes = run.nodes or []
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
        for m in markers([run]):
            after = [i for i, s in enumerate(steps) if s > m.x]
            if after and after[0] > 0:  # between the last probe of the old attempt and the first of the new
                ax.axvline(after[0] - 0.5, color="#111", linestyle="--", linewidth=1.2)
        bar = fig.colorbar(image, ax=ax, fraction=0.03)
        bar.set_label("own time / median", fontsize=8)
        verdict = run.straggler_verdict()
        if verdict:
            ax.set_xlabel(verdict, color="#c00" if slow else "#444")
    fig.savefig(output, format=output.suffix.lstrip(".").lower())
    plt.close(fig)
