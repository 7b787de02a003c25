"""Charts as inline SVG text: line charts with restart markers, and a ranks x steps heat map.

Pure functions of their inputs (no plotting library, no JavaScript); the HTML report
embeds their output as is. Hovering a point or a cell shows its value (SVG ``<title>``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape

from hpc_hsdp.plan.units import seconds, si
from hpc_hsdp.rundir.stragglers import rank_ranges

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
FONT = "font-family='system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif'"


@dataclass(frozen=True, kw_only=True)
class Series:
    label: str
    xs: Sequence[float]
    ys: Sequence[float]
    color: str
    dashed: bool = False
    dots: bool = False


@dataclass(frozen=True, kw_only=True)
class Marker:
    """A vertical line at ``x`` (a restart), labelled ``label``."""

    x: float
    label: str
    color: str = "#555"


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


def in_unit(series: Sequence[Series], factor: float) -> list[Series]:
    return [
        Series(label=s.label, xs=s.xs, ys=[y / factor for y in s.ys], color=s.color, dashed=s.dashed, dots=s.dots)
        for s in series
    ]


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


def _empty(title: str, message: str, width: int, height: int) -> str:
    return (
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>"
        f"<rect width='{width}' height='{height}' fill='white'/>{_text(14, 22, title, size=14, weight='600')}"
        f"{_text(width / 2, height / 2, message, anchor='middle', color='#888')}</svg>"
    )


def line_chart(
    *,
    title: str,
    series: Sequence[Series],
    xlabel: str,
    ylabel: str = "",
    markers: Sequence[Marker] = (),
    width: int = 560,
    height: int = 300,
    y_format: Callable[[float], str] = si,
    x_format: Callable[[float], str] = si,
    empty_message: str = "no data recorded",
    zero_based: bool = False,
    integer_x: bool = False,
) -> str:
    """One chart: the series as polylines, markers as labelled vertical dashed lines."""
    drawn = [s for s in series if len(s.xs)]
    if not drawn:
        return _empty(title, empty_message, width, height)
    legend, x_cursor, rows = [], 0.0, 0
    for s in drawn:  # legend entries flow left to right, wrapping
        entry_w = 30 + 6 * len(s.label)
        if x_cursor and x_cursor + entry_w > width - 80:
            x_cursor, rows = 0.0, rows + 1
        legend.append((s, x_cursor, rows))
        x_cursor += entry_w
    left, right, top, bottom = 64, 16, 34, 58 + 16 * rows
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = [x for s in drawn for x in s.xs] + [m.x for m in markers]
    ys = [y for s in drawn for y in s.ys]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    pad = (y_hi - y_lo) * 0.06 or abs(y_hi) * 0.1 or 1.0
    y_lo, y_hi = y_lo - pad, y_hi + pad
    if min(ys) >= 0 and (y_lo < 0 or zero_based):
        y_lo = 0.0
    x_ticks, y_ticks = nice_ticks(x_lo, x_hi, integer=integer_x), nice_ticks(y_lo, y_hi)
    x_lo, x_hi = min(x_lo, x_ticks[0]), max(x_hi, x_ticks[-1])
    y_lo, y_hi = min(y_lo, y_ticks[0]), max(y_hi, y_ticks[-1])
    x_span, y_span = (x_hi - x_lo) or 1.0, (y_hi - y_lo) or 1.0

    def px(x: float) -> float:
        return left + (x - x_lo) / x_span * plot_w

    def py(y: float) -> float:
        return top + plot_h - (y - y_lo) / y_span * plot_h

    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        _text(14, 22, title, size=14, weight="600"),
    ]
    for t in y_ticks:
        out.append(f"<line x1='{left}' x2='{left + plot_w}' y1='{py(t):.1f}' y2='{py(t):.1f}' stroke='#eee'/>")
        out.append(_text(left - 6, py(t) + 4, y_format(t), size=10, anchor="end", color="#666"))
    for t in x_ticks:
        out.append(f"<line x1='{px(t):.1f}' x2='{px(t):.1f}' y1='{top}' y2='{top + plot_h}' stroke='#f3f3f3'/>")
        out.append(_text(px(t), top + plot_h + 15, x_format(t), size=10, anchor="middle", color="#666"))
    out.append(f"<rect x='{left}' y='{top}' width='{plot_w}' height='{plot_h}' fill='none' stroke='#bbb'/>")
    out.append(_text(left + plot_w / 2, top + plot_h + 32, xlabel, size=11, anchor="middle", color="#444"))
    if ylabel:
        out.append(_text(14, top + plot_h / 2, ylabel, size=11, anchor="middle", color="#444", rotate=-90))
    for m in markers:
        x = px(m.x)
        out.append(
            f"<line class='restart-marker' x1='{x:.1f}' x2='{x:.1f}' y1='{top}' y2='{top + plot_h}' "
            f"stroke='{m.color}' stroke-width='1.2' stroke-dasharray='4 3'><title>{escape(m.label)}</title></line>"
        )
        out.append(_text(x + 3, top + 10, m.label, size=9, color=m.color))
    for s in drawn:
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(*decimate(s.xs, s.ys)))
        dash = " stroke-dasharray='6 4'" if s.dashed else ""
        if len(s.xs) > 1:
            out.append(
                f"<polyline points='{points}' fill='none' stroke='{s.color}' stroke-width='1.6'{dash}>"
                f"<title>{escape(s.label)}</title></polyline>"
            )
        if s.dots or len(s.xs) == 1:
            for x, y in zip(s.xs, s.ys):
                out.append(
                    f"<circle cx='{px(x):.1f}' cy='{py(y):.1f}' r='2.6' fill='{s.color}'>"
                    f"<title>{escape(s.label)}: {x_format(x)}, {y_format(y)}</title></circle>"
                )
    legend_y = top + plot_h + 48
    for s, x_offset, row in legend:
        lx, ly = left + x_offset, legend_y + row * 16
        dash = " stroke-dasharray='6 4'" if s.dashed else ""
        out.append(
            f"<line x1='{lx:.1f}' x2='{lx + 18:.1f}' y1='{ly - 4:.1f}' y2='{ly - 4:.1f}' stroke='{s.color}' "
            f"stroke-width='2'{dash}/>"
        )
        out.append(_text(lx + 22, ly, s.label, size=10, color="#333"))
    out.append("</svg>")
    return "".join(out)


def ratio_color(ratio: float) -> str:
    """1x the median (or less): pale; 2x and more: dark red."""
    t = min(max((ratio - 1.0) / 1.0, 0.0), 1.0)
    low, high = (235, 241, 247), (165, 15, 21)
    r, g, b = (round(lo + (hi - lo) * t) for lo, hi in zip(low, high))
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap(
    *,
    title: str,
    steps: Sequence[int],
    own_times: Sequence[Sequence[float]],
    nodes: Sequence[str] | None,
    slow: Sequence[int] = (),
    markers: Sequence[Marker] = (),
    width: int = 1140,
    max_columns: int = 240,
) -> str:
    """Ranks (rows) x probed steps (columns): each rank's own step time over the step's median.
    ``own_times[i][r]``: rank r's own time at ``steps[i]``. Nodes are bands with their name;
    ``slow`` ranks get their label in red."""
    if not steps:
        return _empty(title, "no per-rank step times recorded (--straggler-every 0, or one rank)", width, 120)
    world = max(len(t) for t in own_times)
    columns = list(range(len(steps)))
    if len(columns) > max_columns:  # several probes per column: their largest ratio per rank
        per = math.ceil(len(columns) / max_columns)
        groups = [columns[i : i + per] for i in range(0, len(columns), per)]
    else:
        groups = [[c] for c in columns]
    ratios = []
    for group in groups:
        column = []
        for r in range(world):
            values = []
            for c in group:
                row = own_times[c]
                median = statistics.median_low(row)
                if r < len(row) and median > 0:
                    values.append((row[r] / median, row[r], steps[c]))  # the largest ratio of the column
            column.append(max(values) if values else None)
        ratios.append(column)
    row_h = 22 if world <= 16 else 14 if world <= 32 else max(2, 448 // world)
    left, right, top = 170, 130, 40
    plot_w = width - left - right
    plot_h = row_h * world
    scale_h = max(min(plot_h, 160), 60)
    height = top + max(plot_h, scale_h) + 52
    cell_w = plot_w / len(groups)
    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' viewBox='0 0 {width} {height}'>",
        f"<rect width='{width}' height='{height}' fill='white'/>",
        _text(14, 22, title, size=14, weight="600"),
    ]
    slow_set = set(slow)
    for i, column in enumerate(ratios):
        for r, value in enumerate(column):
            if value is None:
                continue
            ratio, own, step = value
            node = f" ({nodes[r]})" if nodes and r < len(nodes) else ""
            out.append(
                f"<rect x='{left + i * cell_w:.1f}' y='{top + r * row_h}' width='{cell_w + 0.3:.1f}' "
                f"height='{row_h}' fill='{ratio_color(ratio)}'><title>rank {r}{node} step {step}: "
                f"{seconds(own)}, {ratio:.2f}x</title></rect>"
            )
    # node bands: a separator line and the node's name beside its ranks
    if nodes:
        start = 0
        for r in range(1, world + 1):
            if r == world or nodes[r] != nodes[start]:
                y0, y1 = top + start * row_h, top + r * row_h
                out.append(
                    f"<line x1='{left - 84}' x2='{left + plot_w}' y1='{y1}' y2='{y1}' stroke='#333' stroke-width='1.2'/>"
                )
                out.append(
                    f"<line x1='{left - 84}' x2='{left - 84}' y1='{y0 + 2}' y2='{y1 - 2}' stroke='#333' stroke-width='2'/>"
                )
                label = f"{nodes[start]}"
                out.append(
                    _text(left - 90, (y0 + y1) / 2 + 4, label, size=11, anchor="end", color="#222", weight="600")
                )
                start = r
        out.append(
            f"<line x1='{left - 84}' x2='{left + plot_w}' y1='{top}' y2='{top}' stroke='#333' stroke-width='1.2'/>"
        )
    if row_h >= 9:
        for r in range(world):
            red = r in slow_set
            out.append(
                _text(
                    left - 6,
                    top + r * row_h + row_h / 2 + 4,
                    f"rank {r}" + (" slow" if red else ""),
                    size=10,
                    anchor="end",
                    color="#c00" if red else "#555",
                    weight="700" if red else "normal",
                )
            )
    else:  # rows too thin for a label each: the slow ranks of each node beside its band
        by_node: dict[str, list[int]] = {}
        for r in sorted(slow_set):
            by_node.setdefault(nodes[r] if nodes and r < len(nodes) else "", []).append(r)
        for ranks in by_node.values():
            middle = top + (ranks[0] + ranks[-1] + 1) / 2 * row_h + 4
            out.append(
                _text(left - 6, middle, f"r{rank_ranges(ranks)} slow", size=9, anchor="end", color="#c00", weight="700")
            )
    for m in markers:  # between the last column of the old attempt and the first of the new one
        after = [i for i, group in enumerate(groups) if steps[group[0]] > m.x]
        if after and after[0] > 0:
            x = left + after[0] * cell_w
            out.append(
                f"<line class='restart-marker' x1='{x:.1f}' x2='{x:.1f}' y1='{top - 4}' y2='{top + plot_h + 4}' "
                f"stroke='#111' stroke-width='1.5' stroke-dasharray='4 3'><title>{escape(m.label)}</title></line>"
            )
    for i in range(len(groups)) if len(groups) <= 16 else sorted({0, len(groups) // 2, len(groups) - 1}):
        out.append(
            _text(
                left + (i + 0.5) * cell_w,
                top + plot_h + 15,
                f"step {steps[groups[i][-1]]}",
                size=10,
                anchor="middle",
                color="#666",
            )
        )
    out.append(
        _text(
            left + plot_w / 2,
            top + plot_h + 32,
            "probed steps (each rank's own time of the step: step time minus the time it waited in collectives)",
            size=10,
            anchor="middle",
            color="#444",
        )
    )
    # colour scale
    lx = left + plot_w + 16
    band = scale_h / 11
    for k in range(11):
        out.append(
            f"<rect x='{lx}' y='{top + k * band:.1f}' width='14' height='{band + 0.3:.1f}' "
            f"fill='{ratio_color(2.0 - k / 10)}'/>"
        )
    out.append(_text(lx + 20, top + 9, "2x+ median", size=10, color="#444"))
    out.append(_text(lx + 20, top + scale_h - 2, "1x median", size=10, color="#444"))
    out.append("</svg>")
    return "".join(out)
