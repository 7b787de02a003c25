"""Seeing a run: stragglers named, restarts with their cause, TensorBoard event files equal
to metrics.jsonl, the report and `runs`, speed and ETA against SLURM's time limit.

The pure parts are table-tested here; the whole path runs on real gloo processes (2 x 2,
fork) with a slowed rank and a failed first attempt; the time limit on the dev SLURM cluster.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import assert_cli_imports_no_torch

from hpc_hsdp.job.scheduler import parse_slurm_duration
from hpc_hsdp.plan.units import duration
from hpc_hsdp.rundir import attempts
from hpc_hsdp.rundir.progress import progress_of, requeues_needed
from hpc_hsdp.rundir.scalars import record_scalars
from hpc_hsdp.rundir.stragglers import describe, persistent, persistent_ranks, rank_ranges, summarize

ROOT = Path(__file__).resolve().parents[2]
NODES = ["n1", "n1", "n2", "n2"]


def hpc(*args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k == "SLURM_CONF" or not k.startswith(("SLURM", "MASTER_"))}
    return subprocess.run(
        [sys.executable, "-m", "hpc_hsdp", *args], capture_output=True, text=True, timeout=timeout, env=base
    )


# ----------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("times", "nodes", "expected"),
    [
        ([0.02, 0.02, 0.021, 0.30], NODES, "node n2: rank 3 is 15.0x slower than the median"),
        ([0.02, 0.021, 0.05, 0.06], NODES, "node n2: ranks 2-3 are 2.4x slower than the median"),
        ([0.02, 0.021, 0.022, 0.023], NODES, None),
        (
            [0.06, 0.02, 0.02, 0.05],
            NODES,
            "node n1: rank 0 is 3.0x slower than the median; node n2: rank 3 is 2.5x slower than the median",
        ),
        ([0.02] * 6 + [0.04, 0.04], ["a"] * 4 + ["b"] * 4, "node b: ranks 6-7 are 2.0x slower than the median"),
        ([0.02, 0.03], None, "rank 1 is 1.5x slower than the median"),
        # the others only waited for rank 3: their own time is nothing, the median is taken as 1 ms
        ([0.0, 0.0, 0.0, 0.15], NODES, "node n2: rank 3 is 150.0x slower than the median"),
    ],
)
def test_stragglers_in_words(times, nodes, expected):
    entry = summarize(times, nodes)
    assert entry["slowest_rank"] == max(range(len(times)), key=times.__getitem__)
    assert describe(entry, nodes) == expected


@pytest.mark.parametrize(
    ("ranks", "text"), [([3], "3"), ([2, 3], "2-3"), ([8, 9, 10, 11, 13, 0], "0,8-11,13"), ([], "")]
)
def test_rank_ranges(ranks, text):
    assert rank_ranges(ranks) == text


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1:58", 118),
        ("12:00:00", 43200),
        ("1-02:03:04", 93784),
        ("2-00", 172800),
        ("0-01:30", 5400),
        ("5", 300),
        ("UNLIMITED", None),
        ("NOT_SET", None),
        ("INVALID", None),
        ("", None),
        ("1:2:3:4", None),
    ],
)
def test_parse_slurm_duration(text, seconds):
    assert parse_slurm_duration(text) == seconds


@pytest.mark.parametrize(
    ("remaining", "left", "limit", "requeues"),
    [(50, 60, 120, 0), (60, 60, 120, 0), (61, 60, 120, 1), (300, 60, 120, 2), (300, 60, None, None)],
)
def test_requeues_needed(remaining, left, limit, requeues):
    assert requeues_needed(remaining_s=remaining, time_left_s=left, time_limit_s=limit) == requeues


def test_progress_measures_speed_in_the_current_attempt_only():
    # steps 1-10 one a second, a 500 s requeue pause, then 11-20 two a second
    records = [{"step": s, "wall_time": 1000.0 + s} for s in range(1, 11)]
    records += [{"step": s, "wall_time": 1510.0 + (s - 10) / 2} for s in range(11, 21)]
    progress = progress_of(records, total_steps=200, attempt_start_step=10, time_left_s=30, time_limit_s=60)
    assert progress.steps_per_s == pytest.approx(2.0)
    assert progress.eta_s == pytest.approx(90.0) and progress.requeues == 1
    assert progress.words() == (
        "2 steps/s, last step in 1m30s; 30s left in the allocation: needs 1 requeue (limit 1m00s per run)"
    )
    fits = progress_of(records, total_steps=30, attempt_start_step=10, time_left_s=600, time_limit_s=600)
    assert fits.words() == "2 steps/s, last step in 5s; 10m00s left in the allocation: finishes before the time limit"
    assert progress_of(records[:1], total_steps=30).words() == ""
    assert [duration(s) for s in (9.4, 75, 3725, 90000)] == ["9s", "1m15s", "1h02m", "1d01h"]


def test_restart_causes_from_what_the_previous_attempt_left(tmp_path):
    run = tmp_path / "run"
    assert attempts.begin_attempt(run, restart=0, job_id="7", start_step=0, total_steps=50, now=1.0) is None
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 8)))
    assert attempts.end_attempt(run, reason=attempts.stop_reason_code("USR2"), step=7, now=2.0)
    assert not attempts.end_attempt(run, reason="error", step=7)  # the first cause stays
    first = attempts.begin_attempt(run, restart=1, job_id="7", start_step=7, total_steps=50, now=3.0)
    # a watchdog of another component records a hang; the rank-0 error it provokes does not replace it
    assert attempts.end_attempt(run, reason="hang", step=9, detail="no step for 600 s")
    assert not attempts.end_attempt(run, reason="error", step=9)
    second = attempts.begin_attempt(run, restart=2, job_id="7", start_step=8, total_steps=50, now=4.0)
    third = attempts.begin_attempt(run, restart=3, job_id="7", start_step=8, total_steps=50, now=5.0)  # no end: killed
    attempts.end_attempt(run, reason="completed", step=50)
    fourth = attempts.begin_attempt(run, restart=0, job_id="8", start_step=50, total_steps=80, now=6.0)
    lines = attempts.read_restarts(run)
    assert lines == [first, second, third, fourth]
    assert [(r["restart"], r["resumed_from_step"], r["reason"]) for r in lines] == [
        (1, 7, "warning_signal"),
        (2, 8, "hang"),
        (3, 8, "killed"),
        (0, 50, "resubmitted"),
    ]
    assert first["previous_last_step"] == 7 and second["detail"] == "no step for 600 s"
    assert attempts.read_attempt(run)["total_steps"] == 80 and attempts.read_attempt(run)["ended"] is None


def test_record_scalars_cover_the_loop_fields_comm_and_stragglers():
    record = {
        "step": 3,
        "loss": 2.5,
        "eval_loss": 2.7,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 1000.0,
        "tokens_seen": 3072,
        "step_time_s": 0.2,
        "data_wait_s": 0.01,
        "peak_mem_bytes": 2**30,
        "wall_time": 5.0,
        "comm": {
            "shard": {
                "group_size": 2,
                "inter_node": False,
                "all_gather": {"wire_bytes": 10},
                "reduce_scatter": {"wire_bytes": 5},
            },
            "intra_node_wire_bytes": 15,
            "inter_node_wire_bytes": 0,
        },
        "stragglers": summarize([0.1, 0.1, 0.1, 0.4], NODES),
        "flag": True,
    }
    assert record_scalars(record) == {
        "loss/train": 2.5,
        "loss/eval": 2.7,
        "optim/lr": 1e-3,
        "optim/grad_norm": 0.5,
        "throughput/tokens_per_s": 1000.0,
        "throughput/tokens_seen": 3072.0,
        "time/step_s": 0.2,
        "time/data_wait_s": 0.01,
        "memory/peak_bytes": 2.0**30,
        "comm/intra_node_wire_bytes": 15.0,
        "comm/inter_node_wire_bytes": 0.0,
        "comm/shard_wire_bytes": 15.0,
        "stragglers/slowest_over_median": 4.0,
        "stragglers/slowest_rank": 3.0,
        "stragglers/median_own_time_s": 0.1,
    }


# ----------------------------------------------------------------------------- the report on odd run directories


def _records(steps, *, loss0=5.0):
    return [
        {
            "step": s,
            "loss": loss0 - 0.1 * s,
            "tokens_per_s": 900.0 + s,
            "step_time_s": 0.1,
            "peak_mem_bytes": 2**28,
            "world_size": 4,
            "shard_size": 2,
            "wall_time": time.time() - 100 + s,
        }
        for s in steps
    ]


def test_report_on_a_directory_without_metrics_says_so_and_writes_nothing(tmp_path):
    (tmp_path / "run").mkdir()
    out = hpc("report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 1 and not (tmp_path / "r.html").exists()
    assert (
        out.stderr.splitlines()[-1]
        == "hpc-hsdp: nothing to draw: run: no metrics.jsonl yet: nothing trained here (or still starting)"
    )


@pytest.mark.parametrize(
    "args", [["/no/such/run"], ["{run}", "-o", "{tmp}/r.pdf"], ["{run}", "-o", "/no/such/dir/r.html"]]
)
def test_report_bad_input_is_one_line_and_exit_2(tmp_path, args):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(range(1, 4))))
    out = hpc("report", *[a.format(run=run, tmp=tmp_path) for a in args])
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and out.stderr.startswith("hpc-hsdp: error: ")
    assert list(tmp_path.glob("r.*")) == []


def test_report_draws_what_exists_around_a_corrupt_line_and_a_run_in_progress(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps(r) for r in _records(range(1, 6))]
    lines.insert(2, "{not json")
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 6, "loss"')  # a torn last line, being written
    attempts.begin_attempt(run, restart=0, job_id=None, start_step=0, total_steps=20)
    out = hpc("report", str(run), "-o", str(tmp_path / "r.html"))
    assert out.returncode == 0, out.stderr
    notes = out.stderr.splitlines()
    assert notes[:2] == [
        "run: metrics.jsonl: line 3 is not a metrics record; skipped",
        "run: metrics.jsonl: the last line (line 7) is cut short (being written, or the run was killed); skipped",
    ], notes
    assert len(notes) == 3 and re.fullmatch(r"run: in progress: step 5 of 20, last written \d+ s ago", notes[2]), notes
    html = (tmp_path / "r.html").read_text()
    assert html.count("<svg") >= 7 and "5 / 20" in html and "running" in html
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "<script" not in html
    runs = hpc("runs", str(tmp_path))
    assert runs.returncode == 0 and runs.stdout.splitlines()[1].split()[:4] == ["run", "running", "5/20", "4.5000"]


# ----------------------------------------------------------------------------- TensorBoard without the package


def _trackers_without_tensorboard(run_dir):
    sys.modules["tensorboard"] = None  # import tensorboard -> ImportError, as when it is not installed
    from hpc_hsdp.runtime.trackers import Trackers, TrackerStart

    start = TrackerStart(run_dir=Path(run_dir), start_step=0, last_logged=None, total_steps=2, config={})
    trackers = Trackers(("tensorboard",), start)
    for step in (1, 2):
        trackers.log({"step": step, "loss": 1.0})
    trackers.close("completed")
    return trackers.opened


def test_without_tensorboard_the_run_goes_on_and_says_it_once(tmp_path, capfd):
    from dist_helpers import in_child

    assert in_child(_trackers_without_tensorboard, tmp_path) == []
    err = capfd.readouterr().err
    assert err.count("warning: tracker tensorboard is off for this attempt") == 1 and "hpc-hsdp[tb]" in err
    assert not (tmp_path / "tb").exists()


# ----------------------------------------------------------------------------- a real 2 x 2 run


def _scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_slow_rank_and_restart_are_recorded_drawn_and_match_tensorboard(tmp_path):
    from dist_helpers import launch

    from hpc_hsdp.job.spec import RunSpec, TrainingSpec

    # 7 probes (steps 2-14): an odd count, so a rank another process took the CPU from in
    # as many probes as not is no tie with "slow in half of them"
    training = TrainingSpec(
        layers=1,
        width=32,
        heads=4,
        seq_len=8,
        batch_size=2,
        vocab_size=64,
        steps=14,
        seed=5,
        checkpoint_every=4,
        straggler_every=2,
        eval_every=4,
        eval_batches=2,
    )
    spec = RunSpec(
        shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", training=training, timeout_s=30, comm_stats=True
    )
    slow = {"HPC_HSDP_FAULT_SLOW_RANK": "3:0.15"}
    # attempt 1: rank 1 raises at the start of step 7 (steps 1-6 logged, checkpoints at 4)
    first = launch(
        spec,
        tasks_per_node=[2, 2],
        extra_env={**slow, "HPC_HSDP_FAULT_RAISE_AT": "1:7"},
        expect_failure=True,
        timeout_s=240,
    )
    assert not any(o.ok for o in first)
    run = tmp_path / "run"
    assert attempts.read_attempt(run)["ended"]["reason"] == "error"
    launch(spec, tasks_per_node=[2, 2], extra_env={**slow, "SLURM_RESTART_COUNT": "1"}, timeout_s=240)

    restarts = attempts.read_restarts(run)
    assert [(r["restart"], r["resumed_from_step"], r["previous_last_step"], r["reason"]) for r in restarts] == [
        (1, 4, 6, "error")
    ]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 15))
    probes = [r for r in records if "stragglers" in r]
    assert [r["step"] for r in probes] == [2, 4, 6, 8, 10, 12, 14]
    entries = [r["stragglers"] for r in probes]
    # the slow rank's own time holds the sleep, although every rank's step time does; on a loaded
    # 2-core machine another rank may be descheduled in one probe, not in most
    # (within 10%: the clocks around the collectives start and stop a little apart from the step's)
    assert all(e["own_time_s"][3] >= 0.9 * 0.15 for e in entries), entries
    # every rank's steps take the sleep: from one step's end to the next (rank 0's own window may
    # start after part of it, since rank 3 sleeps while rank 0 writes the metrics of the step before;
    # the end is when rank 0 wrote its record: within 10%, as above, in all probes but one of a loaded machine)
    by_step = {r["step"]: r["wall_time"] for r in records}
    assert sum(by_step[r["step"]] - by_step[r["step"] - 1] >= 0.9 * 0.15 for r in probes) >= 5, by_step
    assert sum((e["slowest_rank"], e["slowest_node"]) == (3, "n2") and e["spread"] > 2 for e in entries) >= 5, entries
    words, count, total = persistent(entries, NODES)
    assert words.startswith("node n2: rank 3 is ") and count >= 5 and total == 7, (words, entries)

    # TensorBoard's own reader gives metrics.jsonl's numbers, each step once, in order, across the resume
    scalars = _scalars(run / "tb")
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 2
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in records:
        for tag, value in record_scalars(r).items():
            expected.setdefault(tag, []).append((r["step"], value))
    assert set(scalars) == set(expected) and {
        "loss/train",
        "loss/eval",
        "optim/lr",
        "optim/grad_norm",
        "time/step_s",
        "time/data_wait_s",
        "comm/inter_node_wire_bytes",
        "stragglers/slowest_rank",
    } <= set(scalars)
    assert [s for s, _ in scalars["loss/eval"]] == [4, 8, 12, 14]  # and the last step
    for tag, points in expected.items():
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert all(math.isclose(g, e, rel_tol=1e-6, abs_tol=1e-30) for (_, g), (_, e) in zip(got, points)), tag

    # the report names the slow rank and draws the restart and the curves
    html_out = hpc("report", str(run), "-o", str(tmp_path / "report.html"))
    assert html_out.returncode == 0, html_out.stderr
    html = (tmp_path / "report.html").read_text()
    assert "class='restart-marker'" in html and "restart 1: error" in html
    assert "rank 3 slow" in html and f"{words} (in {count} of 7 probes)" in html
    assert (
        html.count("<polyline") >= 9
    )  # loss, eval loss, loss/tokens, tokens/s, step time, lr, grad norm, memory, bytes
    for suffix in ("png", "svg"):
        out = hpc("report", str(run), "-o", str(tmp_path / f"report.{suffix}"))
        assert out.returncode == 0, out.stderr
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 30_000
    svg = (tmp_path / "report.svg").read_text()
    assert "rank 3 (n2) slow" in svg and "restart 1: error" in svg and "node n2: rank 3 is" in svg

    listed = hpc("runs", str(tmp_path))
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[:4] == [
        "run",
        "completed",
        "14/14",
        f"{records[-1]['loss']:.4f}",
    ]


# ----------------------------------------------------------------------------- the live line and status


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_submit_wait_and_status_name_the_slow_node_without_torch(tmp_path):
    run = tmp_path / "run"
    submit = [
        "submit",
        "--cluster",
        "local",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--steps",
        "16",
        "--straggler-every",
        "2",
        "--width",
        "32",
        "--layers",
        "1",
        "--seq-len",
        "8",
        "--batch-size",
        "2",
        "--vocab-size",
        "64",
        "--run-dir",
        str(run),
        "--env",
        "HPC_HSDP_FAULT_SLOW_RANK=2:0.2,3:0.2",
        "--wait",
    ]
    out = hpc(*submit)
    assert out.returncode == 0, out.stdout + out.stderr
    live = [line for line in out.stderr.splitlines() if "RUNNING | step" in line]
    assert any("steps/s" in line and "last step in" in line for line in live), out.stderr
    assert any("node n2: ranks 2-3 are" in line and "slower than the median" in line for line in live), out.stderr
    status = hpc("status", str(run))
    assert "slow: node n2: ranks 2-3 are" in status.stdout and "last step 16/16" in status.stdout, status.stdout
    data = json.loads(hpc("status", str(run), "--json").stdout)
    assert data["stragglers"].startswith("node n2: ranks 2-3 are") and data["total_steps"] == 16
    args = [
        ["status", str(run)],
        ["runs", str(tmp_path)],
        ["report", str(run), "-o", str(tmp_path / "r.html")],
        ["report", str(run), "-o", str(tmp_path / "r.png")],
    ]
    assert_cli_imports_no_torch(*args)


# ----------------------------------------------------------------------------- the real dev SLURM cluster


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_status_compares_the_eta_with_slurms_time_left(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    out = hpc(
        "submit",
        "--cluster",
        "slurm",
        "--device",
        "cpu",
        "--width",
        "32",
        "--layers",
        "1",
        "--seq-len",
        "8",
        "--batch-size",
        "2",
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--steps",
        "400",
        "--time",
        "3",
        "--signal",
        "USR2@20",
        "--run-dir",
        str(run),
        "--env",
        "HPC_HSDP_FAULT_STEP_DELAY_S=0.5",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    deadline = time.monotonic() + 330  # the shared dev cluster may hold it PENDING behind other jobs
    while True:
        data = json.loads(hpc("status", str(run), "--json").stdout)
        if data["progress"]["time_left_s"] is not None and data["progress"]["eta_s"] is not None:
            break
        assert time.monotonic() < deadline, data
        time.sleep(1)
    shown = hpc("status", str(run)).stdout
    subprocess.run(["scancel", job_id])
    assert re.search(
        r"^time: [0-9.]+ steps/s, last step in \S+; \S+ left in the allocation: needs \d+ requeues? "
        r"\(limit 3m00s per run\)$",
        shown,
        re.MULTILINE,
    ), shown
    progress = data["progress"]
    assert 0 < progress["time_left_s"] <= 180 and progress["time_limit_s"] == 180
    # 400 steps of >= 0.5 s cannot fit in 3 minutes: at least one more run
    assert progress["eta_s"] > 150 and progress["requeues"] >= 1, progress


def test_only_ranks_slow_in_half_of_the_probes_are_named():
    fast = [0.020, 0.021, 0.020, 0.021]
    noisy = [0.020, 0.030, 0.020, 0.021]  # rank 1 once 1.5x: noise
    slow3 = [0.020, 0.021, 0.020, 0.200]
    entries = [summarize(t, NODES) for t in (slow3, noisy, slow3, fast)]
    assert describe(entries[1], NODES) == "node n1: rank 1 is 1.5x slower than the median"
    assert persistent(entries, NODES) == ("node n2: rank 3 is 10.0x slower than the median", 2, 4)
    assert persistent_ranks(entries) == [3]
    assert persistent([summarize(t, NODES) for t in (fast, noisy, fast)], NODES) is None


def test_the_blocked_clock_counts_only_the_thread_that_started_it():
    """A background checkpoint save's collectives (another thread) overlap the step; counting
    them would take the wait of that thread off this rank's own time."""
    import threading
    import time as clock_time

    from hpc_hsdp.runtime.stragglers import BlockedClock

    clock = BlockedClock()
    collective = clock._wrap(lambda: clock_time.sleep(0.05))
    clock.start()
    worker = threading.Thread(target=collective)
    worker.start()
    worker.join()
    assert clock.blocked_s == 0.0
    collective()
    assert clock.stop() >= 0.05
