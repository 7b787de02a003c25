"""--fault-tolerance replica on the real dev SLURM cluster: 2 replica groups of one node and a
spare; the second group's node crashes (``scripts/dev-cluster kill-node``: its slurmd, its
slurmstepds and its tasks, SIGKILL) in the middle of the run. The job keeps its id, is not
requeued, completes, trains every step once, and the replica count comes back on the spare."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import hpc
from dist_helpers import wait_until

from hpc_hsdp.data.sampler import BatchLayout, SampleOrder
from hpc_hsdp.data.synthetic import SyntheticSamples
from hpc_hsdp.rundir.observation.replica_membership import read_membership
from tests.job_helpers import tiny_job

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30
GLOBAL_BATCH = 8
REPLICA_JOB = tiny_job(
    width=16, heads=2, batch_size=None, vocab_size=None, global_batch_size=GLOBAL_BATCH, straggler_every=0
)
"""The tiny job, ``--vocab-size`` left out (the synthetic data's 256, as the check of the samples below)."""


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _wait_for_the_end(run: Path, timeout_s: float) -> dict:
    """``status --json`` of the run once its job completed, failed or was cancelled."""

    def ended() -> dict | None:
        shown = json.loads(hpc("status", str(run), "--json").stdout)
        return shown if shown["state"] in ("COMPLETED", "FAILED", "CANCELLED") else None

    return wait_until("the end of the job", ended, timeout_s)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_node_dies_its_replica_group_is_lost_and_back_on_the_spare_the_job_goes_on(slurm_cluster, tmp_path):
    nodes = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%D"], capture_output=True, text=True).stdout.split()
    if sum(int(n) for n in nodes if n.isdigit()) < 3:
        pytest.skip("needs a dev cluster of 3 nodes: 2 replica groups and a spare")
    run, samples = tmp_path / "run", tmp_path / "samples"
    samples.mkdir()
    # steps are slow from the kill until the group on the spare has joined (however long a loaded
    # machine takes to start it), then back to the usual pace
    pace = tmp_path / "step-delay"
    pace.write_text("0.4")
    out = hpc(
        "submit",
        *("--cluster", "slurm", "--device", "cpu", "--nodes", "2", "--gpus-per-node", "2", "--shard", "2"),
        *("--fault-tolerance", "replica", "--spare-nodes", "1", "--quorum-timeout", "20"),
        *REPLICA_JOB,
        *("--steps", str(STEPS)),
        *("--run-dir", str(run), "--env", f"HPC_HSDP_FAULT_STEP_DELAY_S=@{pace}"),
        *("--env", f"HPC_HSDP_FAULT_SAMPLE_LOG={samples}"),
    )
    assert out.returncode == 0, out.stderr
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    victim = None
    try:
        wait_until(
            "step 5 with both groups",
            lambda: any(r["step"] >= 5 and r.get("replicas") == 2 for r in _jsonl(run / "metrics.jsonl")),
            300,
        )
        started = [e for e in _jsonl(run / "replicas.jsonl") if e.get("event") == "replica group started"]
        victim = next(e["nodes"][0] for e in started if e["replica_id"] == 1)
        pace.write_text("2")
        killed_at = time.time()
        killed = subprocess.run([str(ROOT / "scripts" / "dev-cluster"), "kill-node", victim], capture_output=True)
        assert killed.returncode == 0, killed.stderr
        killed_after = max(r["step"] for r in _jsonl(run / "metrics.jsonl"))
        wait_until(
            "the group on the spare healed",
            lambda: any(  # after the kill: a group started after its peer heals at the job's start too
                "healed from a live peer" in e.get("cause", "") and e.get("replica_id") == 1 and e["time"] > killed_at
                for e in _jsonl(run / "replicas.jsonl")
            ),
            180,
        )
        pace.write_text("0.4")
        final = _wait_for_the_end(run, 420)
        shown = hpc("status", str(run)).stdout
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        if victim is not None:
            subprocess.run([str(ROOT / "scripts" / "dev-cluster"), "revive-node", victim], capture_output=True)
    assert final["state"] == "COMPLETED" and final["restarts"] == 0, final
    assert final["job_id"] == job_id
    records = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), "a step lost or repeated"
    replicas = [r["replicas"] for r in records[killed_after:]]
    assert 1 in replicas and replicas[-1] == 2, replicas
    events = _jsonl(run / "replicas.jsonl")
    respawned = [e for e in events if e.get("event") == "replica group started" and e.get("attempt") == 1]
    assert respawned and respawned[0]["nodes"] != [victim], events
    assert "replica group 1 lost" in shown, shown

    per_step: dict[int, list[int]] = {}
    for path in samples.glob("samples-rank*.jsonl"):
        for record in _jsonl(path):
            per_step.setdefault(record["step"], []).extend(i for micro in record["sample_ids"] for i in micro)
    train = SyntheticSamples(seed=0, seq_len=8, vocab_size=256)
    order = SampleOrder(num_samples=train.num_samples, seed=0)
    layout = BatchLayout(global_batch=GLOBAL_BATCH, world_size=4, grad_accum=1)
    for step in range(1, STEPS + 1):
        assert sorted(per_step[step]) == sorted(np.asarray(order.sample_ids(layout.step_positions(step))).tolist())


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_replica_groups_meet_on_site_nodes_whose_names_resolve_nowhere(slurm_cluster, tmp_path):
    """Partition 'site' (site1, site2: names no resolver knows, host name on loopback): group 1's
    rendezvous address is found on its own first node by the rule of an ordinary job's batch
    shell (plan/address), not by resolving the SLURM name 'site2' on the batch node."""
    if subprocess.run(["scontrol", "show", "partition", "site"], capture_output=True).returncode != 0:
        pytest.skip("the dev cluster has no 'site' partition (started with --site-nodes 0)")
    run = tmp_path / "run"
    out = hpc(
        "submit",
        *("--cluster", "slurm", "--partition", "site", "--device", "cpu", "--nodes", "2", "--gpus-per-node", "2"),
        *("--shard", "2", "--fault-tolerance", "replica", "--min-replicas", "2", "--quorum-timeout", "20"),
        *REPLICA_JOB,
        *("--steps", "6", "--run-dir", str(run)),
    )
    assert out.returncode == 0, out.stderr
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    try:
        final = _wait_for_the_end(run, 240)
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
    events = read_membership(run)
    assert final["state"] == "COMPLETED" and final["restarts"] == 0, (final, events)
    records = _jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 7)) and all(r["replicas"] == 2 for r in records), records
    started = {e["replica_id"]: e for e in events if e.get("event") == "replica group started"}
    assert started[1]["nodes"] == ["site2"] and started[1]["address"] not in ("site2", "127.0.0.1"), started
    assert started[1]["address"] == started[0]["address"]  # the dev cluster's site nodes are one machine
