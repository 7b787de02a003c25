"""Readers whose memory is flat in the run's length (issue 27): the report's bounded sample
of each series, its exact numbers from the stream, and `logs --tail N` / `--follow` read from
the end of the file. The figures are in benchmarks/RESULTS.md (bench_rundir.py)."""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_hsdp.cli import cli
from hpc_hsdp.files import tail_offset
from hpc_hsdp.plan.units import si
from hpc_hsdp.report import load_runs, write_report
from hpc_hsdp.report.data import MetricsDigest, load_run
from hpc_hsdp.report.sample import Downsampler, ProbeSample
from hpc_hsdp.report.summary import summary_rows
from hpc_hsdp.rundir.training.metrics import read_metrics, scan_metrics
from hpc_hsdp.rundir.training.stragglers import persistent


def test_the_downsampler_keeps_every_point_of_a_short_series_and_min_max_last_and_spikes_of_a_long_one():
    short = Downsampler()
    xs = list(range(1, 4097))
    ys = [math.sin(x / 50) for x in xs]
    for start in range(0, len(xs), 333):  # in chunks of any size
        short.extend(xs[start : start + 333], ys[start : start + 333])
    assert short.points() == (xs, ys)  # up to 4,096 points: every one

    rnd = random.Random(7)
    n = 200_001
    xs = list(range(n))
    ys = [5.0 / (1 + x / 1000) + 0.01 * rnd.random() for x in xs]
    spikes = {31_337: 9.5, 150_000: -3.0}  # a loss spike, a dip
    for x, y in spikes.items():
        ys[x] = y
    sample = Downsampler()
    for start in range(0, n, 7_919):
        sample.extend(xs[start : start + 7_919], ys[start : start + 7_919])
    sx, sy = sample.points()
    assert sample.count == n
    assert 512 <= len(sx) <= 4 * 1024  # bounded: 512 to 1,024 buckets of up to 4 points
    assert sx == sorted(set(sx)) and all(ys[x] == y for x, y in zip(sx, sy))  # real points, in order, once
    kept = dict(zip(sx, sy))
    assert kept[0] == ys[0] and kept[n - 1] == ys[-1]  # the first and the last
    assert all(kept.get(x) == y for x, y in spikes.items())  # the spikes
    assert max(sy) == max(ys) and min(sy) == min(ys)
    # every bucket keeps its min and max: the envelope over any window of 2 buckets is the true one
    width = sample.width
    for start in range(0, n - 2 * width, 37 * width):
        window = range(start - start % width, start - start % width + 2 * width)
        inside = [kept[x] for x in window if x in kept]
        assert max(inside) == max(ys[x] for x in window) and min(inside) == min(ys[x] for x in window)


def test_the_probe_sample_is_bounded_and_keeps_the_slow_probe():
    sample = ProbeSample(buckets=64)
    for step in range(1, 10_001):
        times = [0.2] * 8
        if step == 6_001:
            times[5] = 0.9  # one probe where rank 5 was 4.5x slower
        sample.add(step, {"own_time_s": times})
    probes = sample.probes()
    assert 32 <= len(probes) <= 64 and [s for s, _ in probes] == sorted(s for s, _ in probes)
    assert any(step == 6_001 and entry["own_time_s"][5] == 0.9 for step, entry in probes)


def _long_run(run: Path, steps: int) -> list[dict]:
    """A run of ``steps`` records (written quickly: the keys the report reads), returned too."""
    rnd = random.Random(3)
    records = []
    for s in range(1, steps + 1):
        record = {
            "step": s,
            "loss": 2 + 6 / math.sqrt(s) + 0.05 * rnd.random() + (4.0 if s == 77_777 else 0.0),
            "tokens_seen": s * 4096,
            "tokens_per_s": 9000.0 + rnd.randrange(2000),
            "step_time_s": 0.1 + 0.01 * rnd.random(),
            "lr": 3e-4,
            "world_size": 4,
            "shard_size": 2,
        }
        if s % 1000 == 0:
            record["eval_loss"] = record["loss"] + 0.1 + 0.05 * rnd.random()
        if s % 25 == 0:
            times = [0.05, 0.05, 0.05, 0.05 * (2.0 if rnd.random() < 0.6 else 1.0)]
            record["stragglers"] = {"own_time_s": times}
        records.append(record)
    run.mkdir(parents=True)
    with open(run / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    (run / "attempt.json").write_text(json.dumps({"total_steps": steps, "ended": {"reason": "completed"}}))
    return records


def test_the_report_of_a_long_run_prints_the_exact_numbers_and_draws_a_bounded_sample(tmp_path):
    pytest.importorskip("matplotlib")
    records = _long_run(tmp_path / "long", 100_000)
    run = load_run(tmp_path / "long")
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    best = min(evals, key=lambda e: e[1])
    probes = [r["stragglers"] for r in records if "stragglers" in r]
    words, count, total = persistent(probes)
    assert summary_rows(run) == {  # the numbers of a plain full read
        "run": "long",
        "state": "completed",
        "step": "100000 / 100000",
        "loss": f"{records[-1]['loss']:.4f}",
        "eval loss": f"{evals[-1][1]:.4f}",
        "best eval": f"{best[1]:.4f} (step {best[0]})",
        "tokens/s (median)": si(statistics.median(r["tokens_per_s"] for r in records)),
        "world": "4 (shard 2)",
        "restarts": "none",
        "replica groups": "-",
        "slowest": f"{words} (in {count} of {total} probes)",
        "code": "-",  # no provenance.json
    }
    assert run.digest.median_tokens_per_s() == statistics.median(r["tokens_per_s"] for r in records)
    assert run.last == records[-1] and run.digest.count == 100_000
    xs, ys = run.series("loss")
    assert len(xs) <= 4096 and (77_777, records[77_776]["loss"]) in zip(xs, ys)  # the spike is drawn
    assert run.series("eval_loss") == ([s for s, _ in evals], [v for _, v in evals])  # 100 points: all
    tx, _ = run.against_tokens("loss")
    assert len(tx) == len(xs) and tx[-1] == 100_000 * 4096
    # matplotlib's Agg refused the million-point path of a varying loss; the sample is drawn
    png = write_report(load_runs([tmp_path / "long"]), tmp_path / "r.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_rewritten_run_reads_as_its_newest_attempt(tmp_path):
    """A file whose steps go back (written before a resume truncated it): the later attempt's
    records replace those from its first step on, also in a stream."""
    run = tmp_path / "run"
    run.mkdir()
    old = [{"step": s, "loss": 5.0} for s in range(1, 101)]
    new = [{"step": s, "loss": 1.0} for s in range(51, 81)]
    again = [{"step": 80, "loss": 0.5}]  # a duplicate of the last step: the newest wins
    text = "".join(json.dumps(r) + "\n" for r in old + new + again)
    (run / "metrics.jsonl").write_text(text + '{"step": 81, "lo')
    records, notes = read_metrics(run)
    assert [r["step"] for r in records] == list(range(1, 81))
    assert [r["loss"] for r in records] == [5.0] * 50 + [1.0] * 29 + [0.5]
    assert notes == [
        "metrics.jsonl: the last line (line 132) is cut short (being written, or the run was killed); skipped"
    ]
    digest, _ = scan_metrics(run, MetricsDigest)
    assert digest.last == {"step": 80, "loss": 0.5} and digest.count == 80


def _job(tmp_path: Path, *, state: str = "COMPLETED") -> Path:
    """A run directory with a job of the local emulator (its state file says ``state``)."""
    logs = tmp_path / "logs"
    logs.mkdir(parents=True)
    record = {
        "job_id": "77",
        "cluster": "local",
        "run_dir": str(tmp_path),
        "logs_dir": str(logs),
        "job_name": "x",
        "ntasks": 1,
        "launcher": "srun",
        "submitted_at": 0.0,
    }
    (tmp_path / "job.json").write_text(json.dumps(record))
    _set_state(logs, state)
    return logs


def _set_state(logs: Path, state: str) -> None:
    tmp = logs / ".77_local.json.tmp"
    tmp.write_text(json.dumps({"job_id": "77", "state": state, "exit_code": 0, "supervisor_pid": None}))
    os.replace(tmp, logs / "77_local.json")


@pytest.mark.parametrize("newline", [True, False])
def test_logs_tail_prints_the_last_lines_read_from_the_end(tmp_path, newline):
    logs = _job(tmp_path)
    lines = [f"line {i} " + "x" * (i % 50) for i in range(20_000)]  # ~800 KB: many 64 KiB blocks
    text = "\n".join(lines) + ("\n" if newline else "")
    (logs / "77_0_log.out").write_text(text)
    (logs / "77_0_log.err").write_text("")
    runner = CliRunner()
    for n in (0, 1, 5, 3_000, 19_999, 20_000, 50_000):
        got = runner.invoke(cli, ["logs", str(tmp_path), "--rank", "0", "--tail", str(n)])
        assert got.exit_code == 0, got.output
        want = "".join(text.splitlines(keepends=True)[-n:]) if n else ""
        assert got.output == (f"==> 77_0_log.out <==\n{want}" if want else ""), (n, got.output[:200])
    whole = runner.invoke(cli, ["logs", str(tmp_path), "--rank", "0"])
    assert whole.output == f"==> 77_0_log.out <==\n{text}"
    assert runner.invoke(cli, ["logs", str(tmp_path), "--tail", "-2"]).exit_code == 2


def test_tail_offset_on_edge_cases(tmp_path):
    path = tmp_path / "f"
    for text, n, block, want in [
        ("", 3, 4, ""),
        ("\n", 1, 1, "\n"),
        ("\n\n\n", 2, 1, "\n\n"),
        ("a", 1, 1, "a"),
        ("a\nb", 1, 1, "b"),
        ("a\nb\n", 1, 1, "b\n"),
        ("a\nb\n", 5, 2, "a\nb\n"),
        ("abc\ndefgh\nij\n", 2, 3, "defgh\nij\n"),
    ]:
        path.write_text(text)
        assert text[tail_offset(path, n, block=block) :] == want, (text, n, block)


def test_logs_follow_starts_from_the_tail_and_prints_what_comes(tmp_path):
    logs = _job(tmp_path, state="RUNNING")
    log = logs / "77_0_log.out"
    log.write_text("".join(f"old {i}\n" for i in range(100)))
    follow = subprocess.Popen(
        [sys.executable, "-m", "hpc_hsdp", "logs", str(tmp_path), "--rank", "0", "--follow", "--tail", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = [follow.stdout.readline() for _ in range(3)]
        assert first == ["old 97\n", "old 98\n", "old 99\n"]
        with open(log, "a") as f:
            f.write("new 1\nnew 2\n")
        assert [follow.stdout.readline() for _ in range(2)] == ["new 1\n", "new 2\n"]
        _set_state(logs, "COMPLETED")
        out, err = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert follow.returncode == 0 and out == "", (out, err)


def test_runs_reads_the_tail_of_a_long_run(tmp_path):
    records = _long_run(tmp_path / "runs" / "long", 50_000)
    started = time.perf_counter()
    got = CliRunner().invoke(cli, ["runs", str(tmp_path / "runs")])
    assert got.exit_code == 0, got.output
    row = got.output.splitlines()[1].split()
    assert row[:4] == ["long", "completed", "50000/50000", f"{records[-1]['loss']:.4f}"], got.output
    assert time.perf_counter() - started < 5
