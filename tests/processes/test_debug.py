"""``hpc-hsdp debug`` on the local emulator's real gloo processes: rank 1 stops in pdb at the boundary
after the step asked for while rank 0 waits; 'c' gives the losses of a run without the debugger,
'q' ends the job cleanly within 30 s."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from cli_helpers import hpc

from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = tiny_job(seed=3)


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def wait_until(what, limit_s: float = 120):
    deadline = time.monotonic() + limit_s
    while not what():
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_continue_gives_the_losses_of_a_run_without_the_debugger(tmp_path, local_submit):
    plain = tmp_path / "plain"
    done = hpc(*local_submit(plain, "--steps", "8", *TINY, "--wait"))
    assert done.returncode == 0, done.stderr
    run, pace = tmp_path / "run", tmp_path / "pace"
    pace.write_text("1")  # a step a second until the debugger's request is in
    sub = hpc(*local_submit(run, "--steps", "8", *TINY), env={"HPC_HSDP_FAULT_STEP_DELAY_S": f"@{pace}"})
    assert sub.returncode == 0, sub.stderr
    wait_until(lambda: (run / "layout.json").exists())
    debugged = hpc("debug", str(run), "--rank", "1", "--at-step", "4", input="p 6 * 7\nup 3\nc\n", timeout=200)
    pace.write_text("0")
    assert debugged.returncode == 0, debugged.stderr
    assert "rank 1 stopped after step 4 on node " in debugged.stderr
    assert "(Pdb rank 1) 42\n" in debugged.stdout, debugged.stdout
    assert "rank 1 of 2 stopped after step 4; the other ranks wait at the same boundary." in debugged.stdout
    wait_until(lambda: json.loads(hpc("status", str(run), "--json").stdout)["state"] != "RUNNING")
    status = json.loads(hpc("status", str(run), "--json").stdout)
    assert status["state"] == "COMPLETED", status
    assert losses(run) == losses(plain)  # exactly: the pause changed nothing
    session = json.loads((run / "debug" / "session.json").read_text())
    assert session["rank"] == 1 and session["step"] == 4 and session["state"] == "continue"
    log = "".join(p.read_text() for p in (run / "logs").glob("*_0_log.err"))
    assert "debugger of rank 1 after step 4: continue" in log


def test_quit_ends_the_job_within_30_s_with_no_rank_left(tmp_path, local_submit):
    run = tmp_path / "run"
    sub = hpc(*local_submit(run, "--steps", "100000", *TINY), env={"HPC_HSDP_FAULT_STEP_DELAY_S": "0.1"})
    assert sub.returncode == 0, sub.stderr
    wait_until(lambda: (run / "metrics.jsonl").exists())
    debugged = hpc("debug", str(run), "--rank", "0", input="q\n", timeout=200)
    quit_at = time.monotonic()
    assert debugged.returncode == 0, debugged.stderr
    wait_until(lambda: json.loads(hpc("status", str(run), "--json").stdout)["state"] != "RUNNING", limit_s=60)
    assert time.monotonic() - quit_at < 30
    status = json.loads(hpc("status", str(run), "--json").stdout)
    assert status["state"] == "COMPLETED" and str(status["exit_code"] or 0) == "0", status
    session = json.loads((run / "debug" / "session.json").read_text())
    stopped = session["step"]
    assert session["state"] == "quit" and max(losses(run)) == stopped
    assert (run / "checkpoints" / f"step-{stopped:06d}").is_dir()  # every rank saved and stopped


def test_an_own_loop_agrees_on_the_request_at_its_boundary_and_quits(tmp_path, local_submit):
    run = tmp_path / "run"
    sub = hpc(
        *local_submit(run, "--steps", "100000", "--entry", "own_loop_builtin:main", *TINY),
        env={"HPC_HSDP_FAULT_STEP_DELAY_S": "0.1", "PYTHONPATH": str(Path(__file__).parent)},
    )
    assert sub.returncode == 0, sub.stderr
    wait_until(lambda: (run / "metrics.jsonl").exists())
    debugged = hpc("debug", str(run), "--rank", "1", input="p 6 * 7\nq\n", timeout=200)
    assert debugged.returncode == 0, debugged.stderr
    assert "(Pdb rank 1) 42\n" in debugged.stdout, debugged.stdout
    wait_until(lambda: json.loads(hpc("status", str(run), "--json").stdout)["state"] != "RUNNING", limit_s=60)
    assert json.loads(hpc("status", str(run), "--json").stdout)["state"] == "COMPLETED"
    session = json.loads((run / "debug" / "session.json").read_text())
    assert session["state"] == "quit" and max(losses(run)) == session["step"]


def test_bad_requests_are_one_line_errors(tmp_path, local_submit):
    run = tmp_path / "run"
    done = hpc(*local_submit(run, "--steps", "2", *TINY, "--wait"))
    assert done.returncode == 0, done.stderr
    out = hpc("debug", str(run), "--rank", "0")
    assert out.returncode == 2 and "is not running (COMPLETED)" in out.stderr and out.stderr.count("\n") == 1
    assert not (run / "debug").exists()
