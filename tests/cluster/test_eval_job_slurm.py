"""``--eval-job`` on the real dev SLURM cluster: one sbatch job per checkpoint of the cadence, each
step once even when the training job is requeued (``scontrol requeue``) between two of them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import hpc, status, wait_ended, wait_until

from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]

JOB = [
    "--cluster",
    "slurm",
    "--device",
    "cpu",
    "--nodes",
    "1",
    "--gpus-per-node",
    "2",
    "--shard",
    "2",
    "--no-exclusive",
]
TINY = tiny_job(width=16, heads=2)
SLOW = "HPC_HSDP_FAULT_STEP_DELAY_S"

EVAL = """
import json, os, sys
checkpoint, step = sys.argv[1], int(sys.argv[2])
assert os.path.isfile(os.path.join(checkpoint, "COMPLETE")), checkpoint
print(json.dumps({"eval_acc": step / 100, "job": os.environ["SLURM_JOB_ID"]}))
"""


def results(run: Path) -> list[dict]:
    log = run / "evals.jsonl"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_three_checkpoints_three_eval_jobs_once_each_across_a_requeue(slurm_cluster, tmp_path):
    script = tmp_path / "eval.py"
    script.write_text(EVAL)
    run = tmp_path / "run"
    command = f"{sys.executable} {script} {{checkpoint}} {{step}}"
    out = hpc(
        "submit", *JOB, "--run-dir", str(run), "--steps", "6", "--checkpoint-every", "2", "--keep-checkpoints", "3",
        "--eval-job", command, "--env", f"{SLOW}=1.5", *TINY,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    first = run / "evals" / "step-2.json"
    wait_until("the eval job of step 2", lambda: first.exists() and "submitted" in first.read_text(), 180, run)
    assert not (run / "evals" / "step-4.json").exists(), "too late: step 4 was saved before the requeue"
    assert subprocess.run(["scontrol", "requeue", job_id]).returncode == 0
    wait_until("restart 1", lambda: status(run)["restarts"] >= 1, 120, run)
    final = wait_ended(run)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 1, final
    done = wait_until("3 eval results", lambda: (lambda r: r if len(r) >= 3 else None)(results(run)), 180, run)
    time.sleep(2)
    done = results(run)
    assert sorted(r["step"] for r in done) == [2, 4, 6], done  # once each; not the step saved on the requeue
    assert all(r["state"] == "done" and r["exit_code"] == 0 for r in done), done
    assert all(r["metrics"]["job"] == r["job_id"] and r["job_id"] != job_id for r in done)
    assert len({r["job_id"] for r in done}) == 3
    assert sorted(
        p.name for p in (run / "evals").glob("step-*.json") if ".result" not in p.name and ".metrics" not in p.name
    ) == [
        "step-2.json",
        "step-4.json",
        "step-6.json",
    ]
    shown = hpc("status", str(run)).stdout
    assert "3 eval jobs: 3 done" in shown and "step 4: done" in shown, shown
