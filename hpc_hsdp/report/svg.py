"""The report's charts (:mod:`.charts`) as inline SVG text: line charts with restart markers,
and a ranks x steps heat map.

Pure functions of their inputs (no plotting library, no JavaScript); the HTML report
embeds their output as is. Hovering a point or a cell shows its value (SVG ``<title>``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from hpc_hsdp.plan.units import seconds
from hpc_hsdp.report.charts import Chart, Heatmap, LineChart, Series
from hpc_hsdp.rundir.training.stragglers import rank_ranges

FONT = "font-family='system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif'"


def decimate(xs: Sequence[float], ys: Sequence[float], max_points: int = 2000) -> tuple[list[float], list[float]]:
    """At most about ``max_points`` points: per bucket of consecutive points its lowest and
    highest, in order (a noisy curve keeps its envelope)."""
    if len(xs) <= max_points:
        return list(xs), list(ys)
    per = math.ceil(len(xs) / (max_points // 2))
    out_x, out_y = [], []
    for start in range(0, len(xs), per):
        idx = range(start, min(start + per, len(xs)))
        lo, hi = min(idx, key=ys.__getitem__), max(idx, key=ys.__getitem__)
        for i in sorted({lo, hi}):
            out_x.append(xs[i])
            out_y.append(ys[i])
    return out_x, out_y


def nice_ticks(lo: float, hi: float, count: int = 5, *, integer: bool = False) -> list[float]:
    """Round tick values covering [lo, hi] (1, 2, 2.5, 5 x 10^k steps; whole numbers when ``integer``)."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    if integer and step != int(step):
        step = float(max(1, math.ceil(step)))
    first = math.ceil(lo / step - 1e-9) * step
    ticks, value = [], first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def _text(
    x: float,
    y: float,
    text: str,
    *,
    size: int = 11,
    anchor: str = "start",
    color: str = "#333",
    weight: str = "normal",
    rotate: float | None = None,
) -> str:
    transform = f" transform='rotate({rotate} {x:.1f} {y:.1f})'" if rotate is not None else ""
    return (
        f"<text x='{x:.1f}' y='{y:.1f}' font-size='{size}' text-anchor='{anchor}' fill='{color}' "
        f"font-weight='{weight}' {FONT}{transform}>{escape(text)}</text>"
    )


def _title(text: str) -> str:
    """A hover text (``<title>``), escaped: it holds node names and labels from the run's files
    (``layout.json`` is the run directory's, not code: a name of ``<script>`` is text)."""
    return f"<title>{escape(str(text))}</title>"


def _empty(title: str, message: str, width: int, height: int) -> str:
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>"
        f"<rect width='{width}' height='{height}' fill='white'/>{_text(14, 22, title, size=14, weight='600')}"
        f"{_text(width / 2, height / 2, message, anchor='middle', color='#888')}</svg>"
    )


def _svg_open(width: float, height: float, title: str) -> list[str]:
    return [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        _text(14, 22, title, size=14, weight="600"),
    ]


def render(chart: Chart) -> str:
    """One chart of :func:`hpc_hsdp.report.charts.charts` as an ``<svg>`` element."""
    return heatmap(chart) if isinstance(chart, Heatmap) else line_chart(chart)


@dataclass(frozen=True, kw_only=True)
class _Frame:
    """Where a line chart's values land: the plot area in pixels and the value ranges it shows."""

    left: float
    top: float
    plot_w: float
    plot_h: float
    x_lo: float
    x_span: float
    y_lo: float
    y_span: float
    x_ticks: list[float]
    y_ticks: list[float]

    def px(self, x: float) -> float:
        return self.left + (x - self.x_lo) / self.x_span * self.plot_w

    def py(self, y: float) -> float:
        return self.top + self.plot_h - (y - self.y_lo) / self.y_span * self.plot_h


def _legend_layout(drawn: Sequence[Series], width: int) -> tuple[list[tuple[Series, float, int]], int]:
    """Legend entries flow left to right, wrapping: (series, x offset, row) each, and the last row."""
    legend, x_cursor, rows = [], 0.0, 0
    for s in drawn:
        entry_w = 30 + 6 * len(s.label)
        if x_cursor and x_cursor + entry_w > width - 80:
            x_cursor, rows = 0.0, rows + 1
        legend.append((s, x_cursor, rows))
        x_cursor += entry_w
    return legend, rows


def _frame(chart: LineChart, drawn: Sequence[Series], *, width: int, height: int, legend_rows: int) -> _Frame:
    """The value ranges (padded, on round ticks, from 0 when asked) in the plot area that the legend leaves."""
    left, right, top, bottom = 64, 16, 34, 58 + 16 * legend_rows
    xs = [x for s in drawn for x in s.xs] + [m.x for m in chart.markers]
    ys = [y for s in drawn for y in s.ys]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    pad = (y_hi - y_lo) * 0.06 or abs(y_hi) * 0.1 or 1.0
    y_lo, y_hi = y_lo - pad, y_hi + pad
    if min(ys) >= 0 and (y_lo < 0 or chart.zero_based):
        y_lo = 0.0
    x_ticks, y_ticks = nice_ticks(x_lo, x_hi, integer=chart.integer_x), nice_ticks(y_lo, y_hi)
    x_lo, x_hi = min(x_lo, x_ticks[0]), max(x_hi, x_ticks[-1])
    y_lo, y_hi = min(y_lo, y_ticks[0]), max(y_hi, y_ticks[-1])
    return _Frame(
        left=left,
        top=top,
        plot_w=width - left - right,
        plot_h=height - top - bottom,
        x_lo=x_lo,
        x_span=(x_hi - x_lo) or 1.0,
        y_lo=y_lo,
        y_span=(y_hi - y_lo) or 1.0,
        x_ticks=x_ticks,
        y_ticks=y_ticks,
    )


def _axes(chart: LineChart, f: _Frame) -> list[str]:
    """Grid lines with their tick values, the plot's border and the axis labels."""
    left, top, plot_w, plot_h = f.left, f.top, f.plot_w, f.plot_h
    out = []
    for t in f.y_ticks:
        out.append(f"<line x1='{left}' x2='{left + plot_w}' y1='{f.py(t):.1f}' y2='{f.py(t):.1f}' stroke='#eee'/>")
        out.append(_text(left - 6, f.py(t) + 4, chart.y_format(t), size=10, anchor="end", color="#666"))
    for t in f.x_ticks:
        out.append(f"<line x1='{f.px(t):.1f}' x2='{f.px(t):.1f}' y1='{top}' y2='{top + plot_h}' stroke='#f3f3f3'/>")
        out.append(_text(f.px(t), top + plot_h + 15, chart.x_format(t), size=10, anchor="middle", color="#666"))
    out.append(f"<rect x='{left}' y='{top}' width='{plot_w}' height='{plot_h}' fill='none' stroke='#bbb'/>")
    out.append(_text(left + plot_w / 2, top + plot_h + 32, chart.xlabel, size=11, anchor="middle", color="#444"))
    if chart.ylabel:
        out.append(_text(14, top + plot_h / 2, chart.ylabel, size=11, anchor="middle", color="#444", rotate=-90))
    return out


def _restart_lines(chart: LineChart, f: _Frame) -> list[str]:
    out = []
    for m in chart.markers:
        x = f.px(m.x)
        out.append(
            f"<line class='restart-marker' x1='{x:.1f}' x2='{x:.1f}' y1='{f.top}' y2='{f.top + f.plot_h}' "
            f"stroke='{m.color}' stroke-width='1.2' stroke-dasharray='4 3'>{_title(m.label)}</line>"
        )
        out.append(_text(x + 3, f.top + 10, m.label, size=9, color=m.color))
    return out


def _curves(chart: LineChart, drawn: Sequence[Series], f: _Frame) -> list[str]:
    """Each series as a polyline (decimated), with a dot per point when asked or alone."""
    out = []
    for s in drawn:
        points = " ".join(f"{f.px(x):.1f},{f.py(y):.1f}" for x, y in zip(*decimate(s.xs, s.ys), strict=True))
        dash = " stroke-dasharray='6 4'" if s.dashed else ""
        if len(s.xs) > 1:
            out.append(
                f"<polyline points='{points}' fill='none' stroke='{s.color}' stroke-width='1.6'{dash}>"
                f"{_title(s.label)}</polyline>"
            )
        if s.dots or len(s.xs) == 1:
            for x, y in zip(s.xs, s.ys, strict=True):
                out.append(
                    f"<circle cx='{f.px(x):.1f}' cy='{f.py(y):.1f}' r='2.6' fill='{s.color}'>"
                    f"{_title(f'{s.label}: {chart.x_format(x)}, {chart.y_format(y)}')}</circle>"
                )
    return out


def _legend(legend: Sequence[tuple[Series, float, int]], f: _Frame) -> list[str]:
    out = []
    legend_y = f.top + f.plot_h + 48
    for s, x_offset, row in legend:
        lx, ly = f.left + x_offset, legend_y + row * 16
        dash = " stroke-dasharray='6 4'" if s.dashed else ""
        out.append(
            f"<line x1='{lx:.1f}' x2='{lx + 18:.1f}' y1='{ly - 4:.1f}' y2='{ly - 4:.1f}' stroke='{s.color}' "
            f"stroke-width='2'{dash}/>"
        )
        out.append(_text(lx + 22, ly, s.label, size=10, color="#333"))
    return out


def line_chart(chart: LineChart, *, width: int = 560, height: int = 300) -> str:
    """One chart: the series as polylines, markers as labelled vertical dashed lines."""
    drawn = chart.drawn
    if not drawn:
        return _empty(chart.title, chart.empty_message, width, height)
    legend, legend_rows = _legend_layout(drawn, width)
    f = _frame(chart, drawn, width=width, height=height, legend_rows=legend_rows)
    out = _svg_open(width, height, chart.title)
    out += _axes(chart, f)
    out += _restart_lines(chart, f)
    out += _curves(chart, drawn, f)
    out += _legend(legend, f)
    out.append("</svg>")
    return "".join(out)


def ratio_color(ratio: float) -> str:
    """1x the median (or less): pale; 2x and more: dark red."""
    t = min(max((ratio - 1.0) / 1.0, 0.0), 1.0)
    low, high = (235, 241, 247), (165, 15, 21)
    r, g, b = (round(lo + (hi - lo) * t) for lo, hi in zip(low, high, strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def _column_groups(count: int, max_columns: int) -> list[list[int]]:
    """The probes of each column: one each, or several per column past ``max_columns``."""
    columns = list(range(count))
    if len(columns) > max_columns:
        per = math.ceil(len(columns) / max_columns)
        return [columns[i : i + per] for i in range(0, len(columns), per)]
    return [[c] for c in columns]


def _column_ratios(chart: Heatmap, groups: Sequence[Sequence[int]], world: int) -> list[list[tuple | None]]:
    """Per column and rank: (own time over the probe's median, own time, step) of the column's largest ratio."""
    ratios = []
    for group in groups:
        column = []
        for r in range(world):
            values = []
            for c in group:
                row = chart.own_times[c]
                median = statistics.median_low(row)
                if r < len(row) and median > 0:
                    values.append((row[r] / median, row[r], chart.steps[c]))
            column.append(max(values) if values else None)
        ratios.append(column)
    return ratios


@dataclass(frozen=True, kw_only=True)
class _Grid:
    left: int
    top: int
    plot_w: int
    plot_h: int
    row_h: int
    cell_w: float
    scale_h: int
    world: int


def _cells(chart: Heatmap, ratios: Sequence[Sequence[tuple | None]], g: _Grid) -> list[str]:
    nodes = chart.nodes
    out = []
    for i, column in enumerate(ratios):
        for r, value in enumerate(column):
            if value is None:
                continue
            ratio, own, step = value
            node = f" ({nodes[r]})" if nodes and r < len(nodes) else ""
            out.append(
                f"<rect x='{g.left + i * g.cell_w:.1f}' y='{g.top + r * g.row_h}' width='{g.cell_w + 0.3:.1f}' "
                f"height='{g.row_h}' fill='{ratio_color(ratio)}'>"
                f"{_title(f'rank {r}{node} step {step}: {seconds(own)}, {ratio:.2f}x')}</rect>"
            )
    return out


def _node_bands(nodes: Sequence[str], g: _Grid) -> list[str]:
    """A separator line and the node's name beside its ranks."""
    left, top, row_h = g.left, g.top, g.row_h
    out = []
    start = 0
    for r in range(1, g.world + 1):
        if r == g.world or nodes[r] != nodes[start]:
            y0, y1 = top + start * row_h, top + r * row_h
            out.append(
                f"<line x1='{left - 84}' x2='{left + g.plot_w}' y1='{y1}' y2='{y1}' stroke='#333' stroke-width='1.2'/>"
            )
            out.append(
                f"<line x1='{left - 84}' x2='{left - 84}' y1='{y0 + 2}' y2='{y1 - 2}' stroke='#333' stroke-width='2'/>"
            )
            label = f"{nodes[start]}"
            out.append(_text(left - 90, (y0 + y1) / 2 + 4, label, size=11, anchor="end", color="#222", weight="600"))
            start = r
    out.append(
        f"<line x1='{left - 84}' x2='{left + g.plot_w}' y1='{top}' y2='{top}' stroke='#333' stroke-width='1.2'/>"
    )
    return out


def _rank_labels(chart: Heatmap, g: _Grid) -> list[str]:
    """``rank r`` beside each row (the slow ones in red), or where rows are too thin the slow ranks per node."""
    slow_set = set(chart.slow)
    nodes = chart.nodes
    out = []
    if g.row_h >= 9:
        for r in range(g.world):
            red = r in slow_set
            out.append(
                _text(
                    g.left - 6,
                    g.top + r * g.row_h + g.row_h / 2 + 4,
                    f"rank {r}" + (" slow" if red else ""),
                    size=10,
                    anchor="end",
                    color="#c00" if red else "#555",
                    weight="700" if red else "normal",
                )
            )
        return out
    by_node: dict[str, list[int]] = {}
    for r in sorted(slow_set):
        by_node.setdefault(nodes[r] if nodes and r < len(nodes) else "", []).append(r)
    for ranks in by_node.values():
        middle = g.top + (ranks[0] + ranks[-1] + 1) / 2 * g.row_h + 4
        out.append(
            _text(g.left - 6, middle, f"r{rank_ranges(ranks)} slow", size=9, anchor="end", color="#c00", weight="700")
        )
    return out


def _columns_axis(chart: Heatmap, groups: Sequence[Sequence[int]], g: _Grid) -> list[str]:
    """Restart lines between columns, step labels under some columns, the axis caption."""
    out = []
    for m in chart.markers:  # between the last column of the old attempt and the first of the new one
        after = [i for i, group in enumerate(groups) if chart.steps[group[0]] > m.x]
        if after and after[0] > 0:
            x = g.left + after[0] * g.cell_w
            out.append(
                f"<line class='restart-marker' x1='{x:.1f}' x2='{x:.1f}' y1='{g.top - 4}' y2='{g.top + g.plot_h + 4}' "
                f"stroke='#111' stroke-width='1.5' stroke-dasharray='4 3'>{_title(m.label)}</line>"
            )
    for i in range(len(groups)) if len(groups) <= 16 else sorted({0, len(groups) // 2, len(groups) - 1}):
        out.append(
            _text(
                g.left + (i + 0.5) * g.cell_w,
                g.top + g.plot_h + 15,
                f"step {chart.steps[groups[i][-1]]}",
                size=10,
                anchor="middle",
                color="#666",
            )
        )
    out.append(
        _text(g.left + g.plot_w / 2, g.top + g.plot_h + 32, chart.xlabel, size=10, anchor="middle", color="#444")
    )
    return out


def _colour_scale(g: _Grid) -> list[str]:
    lx = g.left + g.plot_w + 16
    band = g.scale_h / 11
    out = []
    for k in range(11):
        out.append(
            f"<rect x='{lx}' y='{g.top + k * band:.1f}' width='14' height='{band + 0.3:.1f}' "
            f"fill='{ratio_color(2.0 - k / 10)}'/>"
        )
    out.append(_text(lx + 20, g.top + 9, "2x+ median", size=10, color="#444"))
    out.append(_text(lx + 20, g.top + g.scale_h - 2, "1x median", size=10, color="#444"))
    return out


def heatmap(chart: Heatmap, *, width: int = 1140, max_columns: int = 240) -> str:
    """Ranks (rows) x probed steps (columns): each rank's own step time over the step's median.
    Past ``max_columns`` probes a column holds several (each rank's largest ratio of them). Nodes
    are bands with their name; slow ranks get their label in red."""
    title = chart.title()
    if not chart.steps:
        return _empty(title, chart.empty_message, width, 120)
    world = max(len(t) for t in chart.own_times)
    groups = _column_groups(len(chart.steps), max_columns)
    ratios = _column_ratios(chart, groups, world)
    row_h = 22 if world <= 16 else 14 if world <= 32 else max(2, 448 // world)
    left, right, top = 170, 130, 40
    plot_w = width - left - right
    plot_h = row_h * world
    scale_h = max(min(plot_h, 160), 60)
    height = top + max(plot_h, scale_h) + 52
    g = _Grid(
        left=left,
        top=top,
        plot_w=plot_w,
        plot_h=plot_h,
        row_h=row_h,
        cell_w=plot_w / len(groups),
        scale_h=scale_h,
        world=world,
    )
    out = _svg_open(width, height, title)
    out += _cells(chart, ratios, g)
    if chart.nodes:
        out += _node_bands(chart.nodes, g)
    out += _rank_labels(chart, g)
    out += _columns_axis(chart, groups, g)
    out += _colour_scale(g)
    out.append("</svg>")
    return "".join(out)
