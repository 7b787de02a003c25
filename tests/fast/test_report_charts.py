"""The report's one chart list (hpc_hsdp.report.charts) and its two renderers, on synthesized run directories.

The HTML report's SVGs are pinned by their SHA-256 (tests/golden/report-charts.sha256, first
written by the hand-built charts the list replaced): any change of a byte fails. After an
intended change of the pictures, look at the SVGs the failure writes, then regenerate:
HPC_HSDP_REGEN_GOLDEN=1 pytest tests/fast/test_report_charts.py
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from hpc_hsdp.report import load_runs, write_report
from hpc_hsdp.report.charts import Heatmap, LineChart, charts
from hpc_hsdp.report.html import chart_svgs

GOLDEN = Path(__file__).parents[1] / "golden" / "report-charts.sha256"
"""``<sha256>  <case>/<chart>`` a line, as sha256sum writes them."""
REGEN = os.environ.get("HPC_HSDP_REGEN_GOLDEN") == "1"


def _write_run(
    run: Path,
    *,
    steps: int,
    comm: bool = True,
    probe_every: int = 2,
    world: int = 4,
    per_node: int = 2,
    slow: int | None = 3,
    restarts: tuple[int, ...] = (),
    eval_every: int = 4,
    bare: bool = False,
    tokens_seen: bool = False,
    scale: int = 1,
) -> Path:
    """A run directory as training leaves it (rational numbers only: the same bytes on every machine)."""
    run.mkdir(parents=True)
    records = []
    for s in range(1, steps + 1):
        record = {"step": s, "loss": 5.0 - 0.01 * s + 0.02 * (s % 7)}
        if not bare:
            record.update(
                tokens_per_s=(9000.0 + 25 * (s % 11)) * scale,
                step_time_s=0.1 + 0.01 * (s % 5),
                data_wait_s=0.002 * (s % 3),
                lr=3e-4 * min(1, s / 10),
                grad_norm=1.5 / (1 + s / 20),
                peak_mem_bytes=2**28 * scale + 1000 * s,
                world_size=world,
                shard_size=2,
            )
            if tokens_seen:
                record["tokens_seen"] = 4096 * s
            if eval_every and s % eval_every == 0:
                record["eval_loss"] = record["loss"] + 0.1
            if comm:
                record["comm"] = {"inter_node_wire_bytes": 3.5e9 * scale, "intra_node_wire_bytes": 1.2e9 + s}
            if probe_every and s % probe_every == 0:
                times = [0.05 + 0.001 * ((s * 7 + r) % 5) for r in range(world)]
                if slow is not None:
                    times[slow] *= 2.5
                record["stragglers"] = {"own_time_s": times}
        records.append(record)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if not bare:
        ranks = [{"rank": r, "node": f"n{r // per_node + 1}", "slurm_procid": r} for r in range(world)]
        (run / "layout.json").write_text(json.dumps({"ranks": ranks}))
    (run / "attempt.json").write_text(json.dumps({"total_steps": steps, "ended": {"reason": "completed"}}))
    if restarts:
        (run / "restarts.jsonl").write_text(
            "".join(
                json.dumps({"restart": i + 1, "resumed_from_step": s, "previous_last_step": s + 2, "reason": "error"})
                + "\n"
                for i, s in enumerate(restarts)
            )
        )
    return run


def _cases(root: Path) -> dict[str, list[Path]]:
    """Report inputs that take every branch of the charts: one run with all records, two runs
    (one without --comm-stats, one with tokens_seen and GiB of traffic), a run with nothing but
    loss (every "no ... recorded"), a single step, and a long wide run (decimated curves,
    several probes per heat-map column, rows too thin for a label each)."""
    full = _write_run(root / "full", steps=40, restarts=(12,))
    a = _write_run(root / "a" / "run", steps=30, comm=False, restarts=(8, 20))
    b = _write_run(root / "b" / "run", steps=25, tokens_seen=True, slow=None, scale=2000)
    bare = _write_run(root / "bare", steps=5, bare=True)
    nocomm = _write_run(root / "nocomm", steps=20, comm=False, probe_every=0, world=8)
    return {
        "full": [full],
        "two": [a, b],
        "bare": [bare],
        "one-step": [_write_run(root / "one", steps=1, probe_every=1, world=2, slow=1)],
        "three": [full, nocomm, bare],
        "crowded": [
            _write_run(root / "crowded", steps=2100, probe_every=8, world=56, per_node=8, slow=37, restarts=(1000,))
        ],
    }


def _digest(svg: str) -> str:
    return hashlib.sha256(svg.encode()).hexdigest()


def test_the_html_reports_charts_are_the_pinned_bytes(tmp_path):
    got = {}
    for case, dirs in _cases(tmp_path / "runs").items():
        for name, svg in chart_svgs(load_runs(dirs)):
            got[f"{case}/{name}"] = svg
    digests = {key: _digest(svg) for key, svg in got.items()}
    if REGEN:
        GOLDEN.write_text("".join(f"{digest}  {key}\n" for key, digest in sorted(digests.items())))
    pinned = {key: digest for digest, key in (line.split("  ", 1) for line in GOLDEN.read_text().splitlines())}
    changed = sorted(key for key in pinned.keys() | digests.keys() if pinned.get(key) != digests.get(key))
    for key in changed:
        if key in got:
            (tmp_path / (key.replace("/", "--") + ".svg")).write_text(got[key])
    assert not changed, f"charts changed (now in {tmp_path}): {changed}"
    assert len(digests) == 6 * 8 + 9  # 8 line charts per case, a heat map per run


def _texts(svg: str) -> str:
    """The words of an SVG, tags gone and entities undone, to look for titles and labels in."""
    text = re.sub(r"<[^>]+>", "\n", svg)
    return text.replace("&#x27;", "'").replace("&apos;", "'").replace("&quot;", '"').replace("&amp;", "&")


def test_every_chart_of_the_list_is_in_both_renderings(tmp_path):
    pytest.importorskip("matplotlib")
    cases = _cases(tmp_path / "runs")
    for case in ("two", "bare"):
        runs = load_runs(cases[case])
        html = _texts(write_report(runs, tmp_path / f"{case}.html").read_text())
        figure = _texts(write_report(runs, tmp_path / f"{case}.svg").read_text())
        listed = charts(runs)
        assert [type(c) for c in listed] == [LineChart] * 8 + [Heatmap] * len(runs)
        for chart in listed:
            if isinstance(chart, Heatmap):
                assert chart.title() in html and chart.title(with_scale=True) in figure, chart.name
                if not chart.steps:
                    assert chart.empty_message in html and chart.empty_message in figure
                continue
            assert chart.title in html and chart.title in figure, chart.name
            if not chart.drawn:  # an empty chart is its title and what it lacks
                assert chart.empty_message in html and chart.empty_message in figure, chart.name
            for words in [chart.xlabel, chart.ylabel] + [s.label for s in chart.drawn] if chart.drawn else []:
                assert words in html and words in figure, (chart.name, words)
    bare = charts(load_runs(cases["bare"]))
    assert {c.name: c.empty_message for c in bare if isinstance(c, LineChart) and not c.drawn} == {
        "tokens-per-s": "no data recorded",
        "step-time": "no data recorded",
        "lr": "no data recorded",
        "grad-norm": "no data recorded",
        "memory": "no data recorded",
        "comm": "no traffic recorded (run with --comm-stats)",
    }
