"""The report as one self-contained HTML file: a summary table and inline SVG charts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from html import escape

from hpc_hsdp.report.charts import Heatmap, LineChart, charts
from hpc_hsdp.report.data import RunData
from hpc_hsdp.report.summary import summary_rows
from hpc_hsdp.report.svg import render
from hpc_hsdp.rundir.observation.fabric_check_record import check_lines


def chart_svgs(runs: Sequence[RunData]) -> list[tuple[str, str]]:
    """(name, svg) of every chart, in reading order."""
    return [(chart.name, render(chart)) for chart in charts(runs)]


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}
.sub{color:#666;font-size:13px;margin-bottom:16px}
table{border-collapse:collapse;font-size:13px;margin-bottom:14px;background:white}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f0f0}
.note{color:#8a5300;font-size:13px;margin:2px 0}
.grid{display:flex;flex-wrap:wrap;gap:12px}
.grid svg{border:1px solid #e3e3e3;border-radius:4px}
.wide svg{border:1px solid #e3e3e3;border-radius:4px;margin-top:12px}
"""


def render_html(runs: Sequence[RunData]) -> str:
    rows = [summary_rows(run) for run in runs]
    head = "".join(f"<th>{escape(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{escape(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    notes = "".join(f"<p class='note'>{escape(run.label)}: {escape(note)}</p>" for run in runs for note in run.notes)
    notes += "".join(
        f"<h2>{escape(run.label)}: fabric check</h2><pre>{escape(chr(10).join(check_lines(run.check)))}</pre>"
        for run in runs
        if run.check is not None
    )
    notes += "".join(
        f"<h2>{escape(run.label)}: eval jobs</h2><pre>{escape(chr(10).join(e.words() for e in run.evals))}</pre>"
        for run in runs
        if run.evals
    )
    drawn = charts(runs)
    small = "".join(render(chart) for chart in drawn if isinstance(chart, LineChart))
    wide = "".join(f"<div class='wide'>{render(chart)}</div>" for chart in drawn if isinstance(chart, Heatmap))
    title = "hpc-hsdp report: " + ", ".join(run.label for run in runs)
    paths = ", ".join(str(run.path) for run in runs)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title><style>{STYLE}</style>"
        f"</head><body><h1>{escape(title)}</h1><div class='sub'>{escape(paths)} — made "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}</div><table><tr>{head}</tr>{body}</table>{notes}"
        f"<div class='grid'>{small}</div>{wide}</body></html>\n"
    )
