"""Seeing a run: stragglers named, restarts with their cause, TensorBoard event files equal
to metrics.jsonl, the report and `runs`, speed and ETA against SLURM's time limit.

The pure parts are table-tested here; the whole path on real gloo processes is in
tests/processes/test_observe.py, the time limit on the dev SLURM cluster in tests/cluster/test_observe.py.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import hpc

from hpc_hsdp.plan.units import duration
from hpc_hsdp.rundir.lifecycle import attempts
from hpc_hsdp.rundir.training.pace import progress_of, requeues_needed
from hpc_hsdp.rundir.training.scalars import record_scalars
from hpc_hsdp.rundir.training.stragglers import describe, persistent, persistent_ranks, rank_ranges, summarize
from hpc_hsdp.scheduler.backends.slurm import parse_slurm_duration
from tests.observe_helpers import NODES

ROOT = Path(__file__).resolve().parents[2]


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
        "2 steps/s, all steps done in 1m30s; 30s left in the allocation: needs 1 requeue (limit 1m00s per run)"
    )
    fits = progress_of(records, total_steps=30, attempt_start_step=10, time_left_s=600, time_limit_s=600)
    assert (
        fits.words() == "2 steps/s, all steps done in 5s; 10m00s left in the allocation: finishes before the time limit"
    )
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
    from hpc_hsdp.task.observation.trackers import Trackers, TrackerStart

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


# ----------------------------------------------------------------------------- the real dev SLURM cluster


def test_only_ranks_slow_in_half_of_the_probes_are_named():
    fast = [0.020, 0.021, 0.020, 0.021]
    noisy = [0.020, 0.030, 0.020, 0.021]  # rank 1 once 1.5x: noise
    slow3 = [0.020, 0.021, 0.020, 0.200]
    entries = [summarize(t, NODES) for t in (slow3, noisy, slow3, fast)]
    assert describe(entries[1], NODES) == "node n1: rank 1 is 1.5x slower than the median"
    assert persistent(entries, NODES) == ("node n2: rank 3 is 10.0x slower than the median", 2, 4)
    assert persistent_ranks(entries) == [3]
    assert persistent([summarize(t, NODES) for t in (fast, noisy, fast)], NODES) is None


def test_the_blocked_clock_counts_only_the_thread_that_started_it(monkeypatch):
    """A background checkpoint save's collectives (another thread) overlap the step; counting
    them would take the wait of that thread off this rank's own time."""
    import threading
    import time as clock_time

    import torch.distributed as dist

    from hpc_hsdp.task.observation.straggler_probe import BlockedClock

    monkeypatch.setattr(dist, "barrier", lambda: clock_time.sleep(0.05))
    clock = BlockedClock().install()
    try:
        collective = dist.barrier
        clock.start()
        worker = threading.Thread(target=collective)
        worker.start()
        worker.join()
        assert clock.blocked_s == 0.0
        collective()
        assert clock.stop() >= 0.05
    finally:
        clock.close()


def test_runs_shows_a_completed_job_that_ran_no_training_loop_as_completed(tmp_path):
    from types import SimpleNamespace  # noqa: PLC0415

    from hpc_hsdp.cli.jobs_cmd import _run_row  # noqa: PLC0415

    done = SimpleNamespace(state="COMPLETED", current=True)
    check = tmp_path / "check"  # a check's (or a Python function's) run: job.json and check.json, no training records
    check.mkdir()
    (check / "check.json").write_text("{}")
    assert _run_row(check, "check", None, done)[1][1] == "COMPLETED"
    trained = tmp_path / "trained"
    trained.mkdir()
    attempts.begin_attempt(trained, restart=0, job_id="1", start_step=0, total_steps=20)
    assert _run_row(trained, "trained", None, done)[1][1] == "COMPLETED (running)"  # the loop's own view stays
    assert _run_row(check, "check", None, SimpleNamespace(state="FAILED", current=True))[1][1] == "FAILED"


def test_after_a_resume_with_new_steps_the_eta_is_not_the_previous_jobs(tmp_path):
    from types import SimpleNamespace  # noqa: PLC0415

    from hpc_hsdp.cli.jobs_cmd import run_facts  # noqa: PLC0415

    records = [{"step": step, "wall_time": 1000.0 + step, "loss": 1.0} for step in range(1, 21)]
    attempts.begin_attempt(tmp_path, restart=0, job_id="1", start_step=0, total_steps=20, now=1000.0)

    def handle(submitted_at):
        record = SimpleNamespace(run_dir=str(tmp_path), submitted_at=submitted_at)
        return SimpleNamespace(record=record, recent_metrics=lambda: records, time_limits=lambda: None)

    same_job = run_facts(handle(999.0))["progress"]  # the attempt is this job's own: its pace and total
    assert same_job.total_steps == 20 and same_job.eta_s == 0
    resumed = run_facts(handle(2000.0), total_steps=40)  # submitted again with --steps 40, not started yet
    assert (
        resumed["total_steps"] == 40 and resumed["progress"].eta_s is None and resumed["progress"].steps_per_s is None
    )
