"""``--eval-job`` on the local emulator: one detached eval process per checkpoint, results collected
into the run directory, shown by status and report; a failing eval is recorded and training completes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import hpc

from hpc_hsdp.rundir.training.evals import read_evals
from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = tiny_job(width=16, heads=2)

EVAL = """
import json, os, sys
checkpoint, step, run_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
assert os.path.isfile(os.path.join(checkpoint, "COMPLETE")), checkpoint
assert "SLURM_JOB_ID" not in os.environ and "RANK" not in os.environ
print("evaluating", checkpoint)
print(json.dumps({"eval_acc": step / 100, "seen_step": step}))
print("done")
"""


def wait_results(run: Path, count: int, timeout_s: float = 60) -> list[dict]:
    deadline = time.time() + timeout_s
    lines: list[dict] = []
    while time.time() < deadline:
        log = run / "evals.jsonl"
        lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.5)
    raise AssertionError(f"{len(lines)} eval results after {timeout_s} s: {lines}")


def test_three_checkpoints_three_eval_runs_collected_and_shown(tmp_path, local_submit):
    script = tmp_path / "my eval.py"
    script.write_text(EVAL)
    run = tmp_path / "run $(x)"
    command = f"{sys.executable} {script.as_posix()!r} {{checkpoint}} {{step}} {{run_dir}}"
    out = hpc(
        *local_submit(
            run,
            "--steps",
            "6",
            "--checkpoint-every",
            "2",
            "--keep-checkpoints",
            "3",
            "--eval-job",
            command,
            "--wait",
            *TINY,
        )
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = wait_results(run, 3)
    assert sorted(line["step"] for line in lines) == [2, 4, 6]
    assert all(line["exit_code"] == 0 and line["state"] == "done" for line in lines)
    assert {line["step"]: line["metrics"] for line in lines} == {
        s: {"eval_acc": s / 100, "seen_step": s} for s in (2, 4, 6)
    }
    assert all(line["job_id"].startswith("local-") for line in lines)
    assert "evaluating" in (run / "evals" / "step-4.out").read_text()
    time.sleep(1)
    assert len(wait_results(run, 3)) == 3  # each step once
    status = hpc("status", str(run))
    assert "3 eval jobs: 3 done" in status.stdout + status.stderr, status.stdout + status.stderr
    assert "step 6: done" in status.stdout + status.stderr
    as_json = json.loads(hpc("status", str(run), "--json").stdout)
    assert [e["state"] for e in as_json["evals"]] == ["done"] * 3
    report = hpc("report", str(run), "--output", str(tmp_path / "r.html"))
    assert report.returncode == 0, report.stderr
    assert "step 4: done" in report.stderr and "eval_acc=0.04" in report.stderr
    assert "Eval jobs beside the training loss" in (tmp_path / "r.html").read_text()


def test_a_failing_eval_is_recorded_and_training_completes(tmp_path, local_submit):
    run = tmp_path / "run"
    out = hpc(*local_submit(run, "--steps", "3", "--eval-job", "echo broken {step}; exit 3", "--wait", *TINY))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (line,) = wait_results(run, 1)
    assert line["step"] == 3 and line["exit_code"] == 3 and line["state"] == "failed"
    (entry,) = read_evals(run)
    assert entry.state == "failed" and "exited with 3" in entry.words()
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    status = hpc("status", str(run))
    assert "step 3: failed" in status.stdout + status.stderr
    assert "broken 3" in (run / "evals" / "step-3.out").read_text()


def test_the_wrapper_writes_a_result_file_and_imports_no_torch(tmp_path):
    run = tmp_path / "run"
    command = (
        "echo '{\"printed\": 1}'; printf '{\"written\": 2}' > "
        + str(run / "evals" / "step-5.metrics.json")
        + "; python3 -c 'import sys; assert \"torch\" not in sys.modules'"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    code = (
        "import sys, runpy; sys.argv = ['eval_job', *sys.argv[1:]];"
        "from hpc_hsdp.batch_shell.eval_job import main; rc = main();"
        "assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(run), "5", "--", command], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((run / "evals" / "step-5.result.json").read_text())
    assert result["state"] == "done" and result["metrics"] == {"written": 2}
    # run again (its record deleted by hand): the result file of before is not this run's
    again = subprocess.run([sys.executable, "-c", code, str(run), "5", "--", "echo '{\"printed\": 3}'"], env=env)
    assert again.returncode == 0
    assert json.loads((run / "evals" / "step-5.result.json").read_text())["metrics"] == {"printed": 3}
    bad = subprocess.run(
        [sys.executable, "-m", "hpc_hsdp.batch_shell.eval_job", str(run), "x"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_a_resubmitted_run_catches_up_on_the_checkpoints_without_an_eval_job(tmp_path, local_submit):
    run = tmp_path / "run"
    first = hpc(
        *local_submit(run, "--steps", "4", "--checkpoint-every", "2", "--keep-checkpoints", "4", "--wait", *TINY)
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert not (run / "evals").exists()
    command = "echo '{\"s\": '{step}'}'"
    again = hpc(
        *local_submit(
            run,
            "--steps",
            "6",
            "--checkpoint-every",
            "2",
            "--keep-checkpoints",
            "4",
            "--eval-job",
            command,
            "--wait",
            *TINY,
        )
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    lines = wait_results(run, 3)
    assert sorted((line["step"], line["metrics"]["s"]) for line in lines) == [(2, 2), (4, 4), (6, 6)]
