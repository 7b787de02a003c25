"""One writer per run directory (issue 27) on the real dev cluster: two submissions raced into one
run directory give one job and one refusal naming it."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.cluster_helpers import hpc
from tests.run_dir_claims_helpers import (
    TINY,
    _status,
    one_run_one_refusal,
    race,
    wait_state,
    wait_steps,
)

# ----------------------------------------------------------------------------- the dev cluster


@pytest.mark.slurm
@pytest.mark.timeout(400)
def test_two_racing_submits_on_the_dev_cluster_give_one_run_and_one_refusal(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    job = [
        "submit",
        "--cluster",
        "slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--shard",
        "1",
        "--device",
        "cpu",
        "--run-dir",
        str(run),
        "--steps",
        "100000",
        *TINY[:-2],  # the job's python: this one's environment (the emulator's tasks inherit it anyway)
    ]
    job_id, _ = one_run_one_refusal(race(tmp_path, *job), run)
    claim = json.loads((run / "claim.json").read_text())
    assert (claim["state"], claim["job_id"], claim["cluster"]) == ("claimed", job_id, "slurm")
    # a copy of it while it is queued or runs: cancel of the copy refuses; the scheduler says where it writes
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy2(run / "job.json", copy / "job.json")
    wait_steps(run, 2, timeout_s=240)
    refused = hpc("cancel", str(copy))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [
        f"hpc-hsdp: error: {copy} is not where job {job_id} runs: the scheduler says it writes {run} ({copy} is "
        f"a copy, or was moved); nothing cancelled: cancel it from there (hpc-hsdp cancel {run})"
    ]
    assert _status(run)["state"] == "RUNNING"
    cancelled = hpc("cancel", str(run))
    assert cancelled.returncode == 0, cancelled.stdout + cancelled.stderr
    assert wait_state(run, ("CANCELLED", "FAILED", "COMPLETED"), timeout_s=120)["state"] == "CANCELLED"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one writer: each step once, in order
    claim = json.loads((run / "claim.json").read_text())  # released when status saw the end
    assert (claim["state"], claim["job_id"], claim["ended"]) == ("released", job_id, "CANCELLED")
