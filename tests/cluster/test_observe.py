"""Seeing a run on the real dev SLURM cluster: speed and ETA in ``status`` against SLURM's time limit."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from cluster_helpers import hpc

from tests.job_helpers import tiny_job

# ----------------------------------------------------------------------------- the real dev SLURM cluster


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_status_compares_the_eta_with_slurms_time_left(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    out = hpc(
        "submit",
        *tiny_job(vocab_size=None, cluster="slurm", device="cpu", nodes=2, gpus_per_node=2, shard=2, steps=400),
        *("--time", "3", "--signal", "USR2@20", "--run-dir", str(run), "--env", "HPC_HSDP_FAULT_STEP_DELAY_S=0.5"),
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
        r"^time: [0-9.]+ steps/s, all steps done in \S+; \S+ left in the allocation: needs \d+ requeues? "
        r"\(limit 3m00s per run\)$",
        shown,
        re.MULTILINE,
    ), shown
    progress = data["progress"]
    assert 0 < progress["time_left_s"] <= 180 and progress["time_limit_s"] == 180
    # 400 steps of >= 0.5 s cannot fit in 3 minutes: at least one more run
    assert progress["eta_s"] > 150 and progress["requeues"] >= 1, progress
