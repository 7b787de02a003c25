"""--checkpoint-store on the real dev SLURM cluster (issue 42): a submitted job uploads its
checkpoints to a real S3 server (``rclone serve s3``, the ``s3_server`` fixture, on loopback: the
dev cluster's nodes are this machine) with the credentials of the submitting environment, which
no file of the job holds; a job on two other nodes' worth of tasks in a new run directory (a
cluster that does not see the first one's) resumes from the store."""

from __future__ import annotations

import json
from pathlib import Path

from cluster_helpers import hpc, log_tails, status, wait_ended

from hpc_hsdp.rundir.checkpointing.checkpoint_store import CheckpointStore
from hpc_hsdp.rundir.files import read_jsonl
from tests.job_helpers import tiny_job

JOB = tiny_job(batch_size=None, vocab_size=None, cluster="slurm", device="cpu")
JOB += ["--global-batch-size", "8", "--no-exclusive", "--tracker", "none", "--checkpoint-every", "2"]
URL = "s3://ckpt/cluster/run"


def submit(run: Path, *args: str) -> None:
    out = hpc("submit", *JOB, "--run-dir", str(run), "--checkpoint-store", URL, *args)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_job_saves_to_the_store_and_a_job_elsewhere_resumes_from_it(slurm_cluster, s3_server, tmp_path):
    first = tmp_path / "first"
    submit(first, "--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--steps", "4")
    ended = wait_ended(first, timeout_s=300)
    assert ended["state"].startswith("COMPLETED"), log_tails(first)
    assert ended["checkpoint_store"]["committed_step"] == 4, log_tails(first)
    assert CheckpointStore.open(URL).listing() == ([2, 4], [])
    shown = hpc("status", str(first))
    assert "store: s3://ckpt/cluster/run: step 4 committed" in shown.stdout, shown.stdout
    for path in first.rglob("*"):  # the script, the logs, provenance: no key anywhere
        if path.is_file():
            data = path.read_bytes()
            assert s3_server.secret_key.encode() not in data and s3_server.access_key.encode() not in data, path

    moved = tmp_path / "moved"  # another run directory, one node of two tasks: resharded from the store
    submit(moved, "--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--steps", "6")
    ended = wait_ended(moved, timeout_s=300)
    assert ended["state"].startswith("COMPLETED"), log_tails(moved)
    logs = log_tails(moved, chars=20000)
    assert "fetched step 4 from s3://ckpt/cluster/run" in logs and "resumed from step 4" in logs, logs
    assert [r["step"] for r in read_jsonl(moved / "metrics.jsonl")] == [5, 6]
    assert status(moved)["checkpoint_store"]["committed_step"] == 6
    assert CheckpointStore.open(URL).listing() == ([4, 6], [])
    assert json.loads((moved / "checkpoint_store.json").read_text())["url"] == URL
