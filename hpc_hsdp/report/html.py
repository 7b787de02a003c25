"""The report as one self-contained HTML file: a summary table and inline SVG charts."""

from __future__ import annotations

import time
from collections.abc import Sequence
from html import escape

from hpc_hsdp.plan.units import byte_unit, seconds
from hpc_hsdp.report.data import RunData
from hpc_hsdp.report.summary import summary_rows
from hpc_hsdp.report.svg import PALETTE, Marker, Series, heatmap, in_unit, line_chart
from hpc_hsdp.rundir import attempts
from hpc_hsdp.rundir.stragglers import persistent_ranks


def restart_label(restart: dict) -> str:
    reason = attempts.SHORT.get(restart.get("reason"), restart.get("reason") or "?")
    return f"restart {restart.get('restart', '?')}: {reason}"


def markers(runs: Sequence[RunData]) -> list[Marker]:
    """A marker at the step each restart resumed from (after it, the curve is the new attempt's)."""
    out = []
    for i, run in enumerate(runs):
        prefix = f"{run.label} " if len(runs) > 1 else ""
        for restart in run.restarts:
            step = restart.get("resumed_from_step")
            if isinstance(step, (int, float)):
                out.append(
                    Marker(
                        x=step,
                        label=prefix + restart_label(restart),
                        color="#444" if len(runs) == 1 else PALETTE[i % len(PALETTE)],
                    )
                )
    return out


def _series(
    runs: Sequence[RunData], key: str, *, label: str, dashed: bool = False, dots: bool = False, color_offset: int = 0
) -> list[Series]:
    out = []
    for i, run in enumerate(runs):
        xs, ys = run.series(key)
        name = f"{run.label}: {label}" if len(runs) > 1 else label
        out.append(
            Series(label=name, xs=xs, ys=ys, color=PALETTE[(i + color_offset) % len(PALETTE)], dashed=dashed, dots=dots)
        )
    return out


def chart_svgs(runs: Sequence[RunData]) -> list[tuple[str, str]]:
    """(name, svg) of every chart, in reading order."""
    marks = markers(runs)
    single = len(runs) == 1
    loss = _series(runs, "loss", label="train loss")
    eval_loss = _series(runs, "eval_loss", label="eval loss", dashed=True, dots=True, color_offset=4 if single else 0)
    charts = [("loss", line_chart(title="Loss", series=loss + eval_loss, xlabel="step", integer_x=True, markers=marks))]
    by_tokens = []
    for i, run in enumerate(runs):
        tokens = dict(run.tokens_axis())
        for key, label, dashed in (("loss", "train loss", False), ("eval_loss", "eval loss", True)):
            xs, ys = run.series(key)
            by_tokens.append(
                Series(
                    label=f"{run.label}: {label}" if not single else label,
                    xs=[tokens[x] for x in xs],
                    ys=ys,
                    color=PALETTE[(i + (4 if single and dashed else 0)) % len(PALETTE)],
                    dashed=dashed,
                    dots=dashed,
                )
            )
    charts.append(("loss-tokens", line_chart(title="Loss against tokens", series=by_tokens, xlabel="tokens seen")))
    charts.append(
        (
            "tokens-per-s",
            line_chart(
                title="Throughput",
                series=_series(runs, "tokens_per_s", label="tokens/s"),
                xlabel="step",
                ylabel="tokens/s",
                integer_x=True,
                markers=marks,
                zero_based=True,
            ),
        )
    )
    step_time = _series(runs, "step_time_s", label="step time (rank 0)")
    wait = _series(runs, "data_wait_s", label="data wait", dashed=True, color_offset=2 if single else 0)
    charts.append(
        (
            "step-time",
            line_chart(
                title="Step time",
                series=step_time + wait,
                xlabel="step",
                integer_x=True,
                markers=marks,
                y_format=seconds,
            ),
        )
    )
    charts.append(
        (
            "lr",
            line_chart(
                title="Learning rate",
                series=_series(runs, "lr", label="lr"),
                xlabel="step",
                integer_x=True,
                markers=marks,
                zero_based=True,
            ),
        )
    )
    charts.append(
        (
            "grad-norm",
            line_chart(
                title="Gradient norm (before clipping)",
                series=_series(runs, "grad_norm", label="global grad norm"),
                xlabel="step",
                integer_x=True,
                markers=marks,
            ),
        )
    )
    memory = _series(runs, "peak_mem_bytes", label="peak memory (rank 0)")
    factor, unit = byte_unit([y for s in memory for y in s.ys])
    charts.append(
        (
            "memory",
            line_chart(
                title="Peak memory",
                series=in_unit(memory, factor),
                xlabel="step",
                ylabel=unit,
                integer_x=True,
                markers=marks,
                y_format=lambda v: f"{v:.4g}",
            ),
        )
    )
    comm = []
    for i, run in enumerate(runs):
        for key, label, dashed in (
            ("inter_node_wire_bytes", "inter-node", False),
            ("intra_node_wire_bytes", "intra-node", True),
        ):
            xs, ys = run.comm_series(key)
            comm.append(
                Series(
                    label=f"{run.label}: {label}" if not single else f"{label} bytes sent (rank 0)",
                    xs=xs,
                    ys=ys,
                    color=PALETTE[(i + (0 if dashed else 1)) % len(PALETTE)] if single else PALETTE[i % len(PALETTE)],
                    dashed=dashed,
                )
            )
    factor, unit = byte_unit([y for s in comm for y in s.ys])
    charts.append(
        (
            "comm",
            line_chart(
                title="Bytes on the wire per step",
                series=in_unit(comm, factor),
                xlabel="step",
                ylabel=unit,
                integer_x=True,
                markers=marks,
                zero_based=True,
                y_format=lambda v: f"{v:.4g}",
                empty_message="no traffic recorded (run with --comm-stats)",
            ),
        )
    )
    for run in runs:
        probes = run.straggler_probes()
        slow = persistent_ranks([entry for _, entry in probes])
        run_marks = markers([run])
        charts.append(
            (
                f"ranks-{run.label}",
                heatmap(
                    title=f"Own step time per rank{f' — {run.label}' if not single else ''}",
                    steps=[s for s, _ in probes],
                    own_times=[e["own_time_s"] for _, e in probes],
                    nodes=run.nodes,
                    slow=slow,
                    markers=run_marks,
                ),
            )
        )
    return charts


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
    charts = chart_svgs(runs)
    small = "".join(svg for name, svg in charts if not name.startswith("ranks-"))
    wide = "".join(f"<div class='wide'>{svg}</div>" for name, svg in charts if name.startswith("ranks-"))
    title = "hpc-hsdp report: " + ", ".join(run.label for run in runs)
    paths = ", ".join(str(run.path) for run in runs)
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{escape(title)}</title><style>{STYLE}</style>"
        f"</head><body><h1>{escape(title)}</h1><div class='sub'>{escape(paths)} — made "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}</div><table><tr>{head}</tr>{body}</table>{notes}"
        f"<div class='grid'>{small}</div>{wide}</body></html>\n"
    )
