"""What the report draws, once: every chart of a set of runs as a description (pure, no plotting).

:func:`charts` turns the runs into :class:`LineChart` and :class:`Heatmap` records, in
reading order: titles, axis labels, every series with its label, colour and dash, the tick
formats, restart markers and what to say when there is nothing to draw. Two renderers draw
them: :mod:`.svg` (the HTML report) and :mod:`.figure` (PNG/SVG through matplotlib). A
chart added here appears in both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypedDict

from hpc_hsdp.plan.units import byte_unit, seconds, si
from hpc_hsdp.report.data import RunData
from hpc_hsdp.rundir.lifecycle import attempts

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")


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


@dataclass(frozen=True, kw_only=True)
class LineChart:
    name: str
    """The chart's short name (``loss``, ``step-time``)."""
    title: str
    series: Sequence[Series]
    """Every run's series, those without a point too (a renderer draws the others)."""
    xlabel: str
    ylabel: str = ""
    x_format: Callable[[float], str] = si
    y_format: Callable[[float], str] = si
    """A value's text on each axis (si: ``1.23M``, seconds: ``12.5 ms``): the SVG's ticks and hover text."""
    plain_y: bool = False
    """The y values are plain numbers (a loss, a rate, bytes already in the axis's unit): matplotlib
    writes their ticks itself, with the decimals the tick spacing needs, instead of ``y_format``."""
    zero_based: bool = False
    """The y axis starts at 0 (when no value is below it)."""
    integer_x: bool = False
    """The x values are steps: whole-number ticks (in the SVG), matplotlib's own tick text."""
    markers: Sequence[Marker] = ()
    empty_message: str = "no data recorded"

    @property
    def drawn(self) -> list[Series]:
        return [s for s in self.series if len(s.xs)]


HEATMAP_TITLE = "Own step time per rank"


@dataclass(frozen=True, kw_only=True)
class Heatmap:
    """One run's ranks (rows) x probed steps (columns): each rank's own step time over the step's median."""

    name: str
    run_label: str | None
    """The run's label when the report shows several, else None."""
    steps: Sequence[int]
    own_times: Sequence[Sequence[float]]
    """``own_times[i][r]``: rank r's own time at ``steps[i]``."""
    nodes: Sequence[str] | None
    slow: Sequence[int]
    """The ranks slow in at least half of the probes."""
    markers: Sequence[Marker]
    verdict: str | None
    """The slow ranks in words (:meth:`RunData.straggler_verdict`)."""
    xlabel: str = "probed steps (each rank's own time of the step: step time minus the time it waited in collectives)"
    scale: str = "own time / median"
    empty_message: str = "no per-rank step times recorded (--straggler-every 0, or one rank)"

    def title(self, *, with_scale: bool = False) -> str:
        """``Own step time per rank`` (``, over the step's median`` where no scale beside says so)."""
        scale = ", over the step's median" if with_scale else ""
        return HEATMAP_TITLE + scale + (f" — {self.run_label}" if self.run_label else "")


Chart = LineChart | Heatmap


class StepAxis(TypedDict):
    """The x axis of the charts drawn per step (a :class:`LineChart`'s keywords)."""

    xlabel: str
    integer_x: bool
    markers: Sequence[Marker]


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


def four_digits(value: float) -> str:
    """A value already in its axis's unit (``3.5`` GiB): up to 4 significant digits."""
    return f"{value:.4g}"


def _series(
    runs: Sequence[RunData], key: str, *, label: str, dashed: bool = False, dots: bool = False, color_offset: int = 0
) -> list[Series]:
    """One series of metrics key ``key`` per run, coloured by run (by ``color_offset`` when alone)."""
    out = []
    for i, run in enumerate(runs):
        xs, ys = run.series(key)
        name = f"{run.label}: {label}" if len(runs) > 1 else label
        out.append(
            Series(label=name, xs=xs, ys=ys, color=PALETTE[(i + color_offset) % len(PALETTE)], dashed=dashed, dots=dots)
        )
    return out


def _in_unit(series: Sequence[Series]) -> tuple[list[Series], str]:
    """The byte series in the binary unit of their largest value, and its name."""
    factor, unit = byte_unit([y for s in series for y in s.ys])
    scaled = [
        Series(label=s.label, xs=s.xs, ys=[y / factor for y in s.ys], color=s.color, dashed=s.dashed, dots=s.dots)
        for s in series
    ]
    return scaled, unit


def _loss_against_tokens(runs: Sequence[RunData]) -> list[Series]:
    single = len(runs) == 1
    out = []
    for i, run in enumerate(runs):
        for key, label, dashed in (("loss", "train loss", False), ("eval_loss", "eval loss", True)):
            xs, ys = run.against_tokens(key)
            out.append(
                Series(
                    label=f"{run.label}: {label}" if not single else label,
                    xs=xs,
                    ys=ys,
                    color=PALETTE[(i + (4 if single and dashed else 0)) % len(PALETTE)],
                    dashed=dashed,
                    dots=dashed,
                )
            )
    return out


def _wire_bytes(runs: Sequence[RunData]) -> list[Series]:
    single = len(runs) == 1
    out = []
    for i, run in enumerate(runs):
        for key, label, dashed in (
            ("inter_node_wire_bytes", "inter-node", False),
            ("intra_node_wire_bytes", "intra-node", True),
        ):
            xs, ys = run.comm_series(key)
            out.append(
                Series(
                    label=f"{run.label}: {label}" if not single else f"{label} bytes sent (rank 0)",
                    xs=xs,
                    ys=ys,
                    color=PALETTE[(i + (0 if dashed else 1)) % len(PALETTE)] if single else PALETTE[i % len(PALETTE)],
                    dashed=dashed,
                )
            )
    return out


def _heatmap(run: RunData, *, single: bool) -> Heatmap:
    probes = run.straggler_probes()
    return Heatmap(
        name=f"ranks-{run.label}",
        run_label=None if single else run.label,
        steps=[s for s, _ in probes],
        own_times=[e["own_time_s"] for _, e in probes],
        nodes=run.nodes,
        slow=run.slow_ranks(),
        markers=markers([run]),
        verdict=run.straggler_verdict(),
    )


EVAL_METRICS_DRAWN = 6
"""The eval-jobs chart draws at most this many metrics of each run (the first its eval jobs printed)."""


def _eval_jobs(runs: Sequence[RunData], per_step: StepAxis) -> list[LineChart]:
    """The eval jobs' metrics (``--eval-job``) per step beside the training loss; none without any."""
    if not any(run.eval_metric_names for run in runs):
        return []
    single = len(runs) == 1
    series = _series(runs, "loss", label="train loss")
    for i, run in enumerate(runs):
        for k, name in enumerate(run.eval_metric_names[:EVAL_METRICS_DRAWN]):
            xs, ys = run.eval_series(name)
            label = f"eval job: {name}" if single else f"{run.label}: eval job {name}"
            color = PALETTE[((k + 1) if single else i) % len(PALETTE)]
            series.append(Series(label=label, xs=xs, ys=ys, color=color, dashed=True, dots=True))
    return [
        LineChart(name="eval-jobs", title="Eval jobs beside the training loss", plain_y=True, series=series, **per_step)
    ]


def charts(runs: Sequence[RunData]) -> list[Chart]:
    """Every chart of the report of ``runs``, in reading order: the line charts, then a heat map per run."""
    marks = markers(runs)
    single = len(runs) == 1
    per_step: StepAxis = {"xlabel": "step", "integer_x": True, "markers": marks}
    memory, memory_unit = _in_unit(_series(runs, "peak_mem_bytes", label="peak memory (rank 0)"))
    wire, wire_unit = _in_unit(_wire_bytes(runs))
    line_charts = [
        LineChart(
            name="loss",
            title="Loss",
            plain_y=True,
            series=_series(runs, "loss", label="train loss")
            + _series(runs, "eval_loss", label="eval loss", dashed=True, dots=True, color_offset=4 if single else 0),
            **per_step,
        ),
        *_eval_jobs(runs, per_step),
        LineChart(
            name="loss-tokens",
            title="Loss against tokens",
            series=_loss_against_tokens(runs),
            xlabel="tokens seen",
            plain_y=True,
        ),
        LineChart(
            name="tokens-per-s",
            title="Throughput",
            series=_series(runs, "tokens_per_s", label="tokens/s"),
            ylabel="tokens/s",
            zero_based=True,
            **per_step,
        ),
        LineChart(
            name="step-time",
            title="Step time",
            series=_series(runs, "step_time_s", label="step time (rank 0)")
            + _series(runs, "data_wait_s", label="data wait", dashed=True, color_offset=2 if single else 0),
            y_format=seconds,
            **per_step,
        ),
        LineChart(
            name="lr",
            title="Learning rate",
            plain_y=True,
            series=_series(runs, "lr", label="lr"),
            zero_based=True,
            **per_step,
        ),
        LineChart(
            name="grad-norm",
            title="Gradient norm (before clipping)",
            plain_y=True,
            series=_series(runs, "grad_norm", label="global grad norm"),
            **per_step,
        ),
        LineChart(
            name="memory",
            title="Peak memory",
            plain_y=True,
            series=memory,
            ylabel=memory_unit,
            y_format=four_digits,
            **per_step,
        ),
        LineChart(
            name="comm",
            title="Bytes on the wire per step",
            plain_y=True,
            series=wire,
            ylabel=wire_unit,
            zero_based=True,
            y_format=four_digits,
            empty_message="no traffic recorded (run with --comm-stats)",
            **per_step,
        ),
    ]
    return line_charts + [_heatmap(run, single=single) for run in runs]
