"""``hpc-hsdp stacks`` on the local emulator's real gloo processes: a rank frozen by the fault hook
is named as the odd one out (py-spy's stacks and the kill -QUIT fallback's), and a job keeps
training across ten calls."""

from __future__ import annotations

import json
import time

import pytest
from cli_helpers import hpc

from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = tiny_job()


def steps_done(run) -> int:
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return 0
    return json.loads(lines[-1])["step"] if lines else 0


def wait_for_step(run, step: int, limit_s: float = 120) -> None:
    deadline = time.monotonic() + limit_s
    while steps_done(run) < step:
        assert time.monotonic() < deadline, hpc("logs", str(run)).stdout[-3000:]
        time.sleep(0.3)


def test_a_frozen_rank_is_the_odd_one_out_now_and_in_the_stacks_the_watchdog_took(tmp_path, local_submit):
    run = tmp_path / "run"
    sub = hpc(
        *local_submit(run, "--steps", "1000", "--hang-timeout", "40", *TINY, nodes=2),
        env={"HPC_HSDP_FAULT_FREEZE_AT": "1:3"},
    )
    assert sub.returncode == 0, sub.stderr
    try:
        wait_for_step(run, 2)
        deadline = time.monotonic() + 60
        while True:  # until rank 1 sits in the hook and the others wait for it
            shown = hpc("stacks", str(run), "--json", timeout=120)
            assert shown.returncode == 0, shown.stderr
            groups = json.loads(shown.stdout)["groups"]
            if len(groups) >= 2 and "at_step" in groups[0].get("headline", "") or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert [g["ranks"] for g in groups][0] == [1], groups
        assert "at_step in hpc_hsdp/task/resilience/injected_faults.py" in groups[0]["headline"]
        assert sorted(r for g in groups[1:] for r in g["ranks"]) == [0, 2, 3]
        assert all("torch/distributed/" in g["headline"] for g in groups[1:]), groups
        assert {s["how"] for s in json.loads(shown.stdout)["stacks"]} <= {"py-spy --native", "py-spy"}
        text = hpc("stacks", str(run), "--python-only", timeout=120)
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert lines[0].startswith("rank 1 (1 of 4): at_step in hpc_hsdp/task/resilience/injected_faults.py:"), lines
        assert lines[-1].startswith("(4 ranks in ") and lines[-1].endswith("; faulthandler)"), lines[-1]
        assert "Current thread 0x" in next((run / "logs").glob("*_1_log.err")).read_text()
        deadline = time.monotonic() + 120  # the watchdog ends the job 40 s after the last step
        while json.loads(hpc("status", str(run), "--json").stdout)["state"] == "RUNNING":
            assert time.monotonic() < deadline
            time.sleep(2)
    finally:
        hpc("cancel", str(run), "--no-wait")
    status = hpc("status", str(run))
    lines = status.stdout.splitlines()
    at = lines.index("stacks the watchdog took after step 2 (hpc-hsdp stacks: the ranks' stacks now):")
    assert lines[at + 1].startswith("  rank 1 (1 of 4): at_step in hpc_hsdp/task/resilience/injected_faults.py:"), lines
    shown = json.loads(hpc("status", str(run), "--json").stdout)["hang_stacks"]
    assert [g["ranks"] for g in shown["groups"]][0] == [1] and sum(len(g["ranks"]) for g in shown["groups"]) == 4


def test_the_job_keeps_training_across_ten_calls(tmp_path, local_submit):
    run = tmp_path / "run"
    sub = hpc(*local_submit(run, "--steps", "100000", *TINY))
    assert sub.returncode == 0, sub.stderr
    try:
        wait_for_step(run, 2)
        before = steps_done(run)
        for _ in range(10):
            shown = hpc("stacks", str(run), "--json", timeout=120)
            assert shown.returncode == 0, shown.stderr
            assert sorted(s["rank"] for s in json.loads(shown.stdout)["stacks"] if s["threads"]) == [0, 1]
        wait_for_step(run, steps_done(run) + 3)  # still training after the tenth
        assert steps_done(run) > before + 3
        status = json.loads(hpc("status", str(run), "--json").stdout)
        assert status["state"] == "RUNNING", status
    finally:
        cancelled = hpc("cancel", str(run))
    assert cancelled.returncode == 0 and "(CANCELLED)" in cancelled.stdout, cancelled.stdout + cancelled.stderr


def test_a_job_that_ended_is_a_one_line_error(tmp_path, local_submit):
    run = tmp_path / "run"
    sub = hpc(*local_submit(run, "--steps", "2", *TINY, "--wait"))
    assert sub.returncode == 0, sub.stderr
    shown = hpc("stacks", str(run))
    assert shown.returncode == 2 and shown.stderr.count("\n") == 1, shown.stderr
    assert "is not running (COMPLETED)" in shown.stderr
