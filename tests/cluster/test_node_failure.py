"""A node that dies mid-job (issue 13), on the real dev cluster (marked ``slurm``; needs 3
nodes, the default of ``scripts/dev-cluster up``): a 2-node job loses one node (``scripts/dev-cluster
kill-node``: its slurmd and tasks killed, as a crashed machine); the survivors give up at once,
the job is requeued without that node, lands on the healthy ones, resumes from the newest
complete checkpoint and finishes, with at most --checkpoint-every steps redone; status shows
the restart and its cause. It prints the time from the node's death to the first resumed step
and the steps redone.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from cluster_helpers import hpc
from dist_helpers import wait_until

from hpc_hsdp.rundir.lifecycle import attempts
from tests.job_helpers import tiny_job

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the real dev cluster

JOB = tiny_job(vocab_size=None, cluster="slurm", device="cpu", nodes=2, gpus_per_node=2, shard=2)
EVERY = 4


def _steps(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_node_dies_the_job_requeues_without_it_and_finishes(slurm_cluster, tmp_path):
    nodes = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%D"], capture_output=True, text=True).stdout.split()
    if sum(int(n) for n in nodes if n.isdigit()) < 3:
        pytest.skip(
            "needs a dev cluster of 3 nodes (scripts/dev-cluster up, default --nodes 3): one dies, the job needs 2"
        )
    run = tmp_path / "run"
    out = hpc(
        "submit",
        *JOB,
        "--run-dir",
        str(run),
        "--steps",
        "40",
        "--checkpoint-every",
        str(EVERY),
        "--max-restarts",
        "2",
        "--env",
        "HPC_HSDP_FAULT_STEP_DELAY_S=0.3",
    )
    assert out.returncode == 0, out.stderr
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    wait_until("step 10", lambda: len(_steps(run)) >= 10, 240)
    layout = json.loads((run / "layout.json").read_text())
    victim = layout["ranks"][-1]["node"]  # the second node of the job (rank 0 survives on the first)
    killed = subprocess.run(
        [str(ROOT / "scripts" / "dev-cluster"), "kill-node", victim], capture_output=True, text=True
    )
    assert killed.returncode == 0, killed.stderr
    died_at = float(re.search(r"at ([0-9.]+)$", killed.stdout.strip()).group(1))
    last_before = max(r["step"] for r in _steps(run))
    try:
        final = wait_until(
            "the end of the job",
            lambda: (lambda s: s if s["state"] in ("COMPLETED", "FAILED", "CANCELLED") else None)(
                json.loads(hpc("status", str(run), "--json").stdout)
            ),
            420,
        )
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)  # a job left held or pending would block the next
        subprocess.run([str(ROOT / "scripts" / "dev-cluster"), "revive-node", victim], capture_output=True, text=True)
    assert final["state"] == "COMPLETED" and final["restarts"] >= 1, final
    lines = [r for r in attempts.read_restarts(run) if r["reason"] == "node_failure"]
    assert lines and f"node {victim} died" in lines[0]["detail"], attempts.read_restarts(run)
    records = _steps(run)
    assert [r["step"] for r in records] == list(range(1, 41))
    resumed = next(r for r in records if r["wall_time"] > died_at)
    redone = last_before - (resumed["step"] - 1)
    assert 0 <= redone <= EVERY, (last_before, resumed["step"])
    layout = json.loads((run / "layout.json").read_text())
    assert victim not in {r["node"] for r in layout["ranks"]}
    shown = hpc("status", str(run)).stdout
    assert "node failure" in shown
    print(f"node death -> first resumed step done: {resumed['wall_time'] - died_at:.1f} s; steps redone: {redone}")
