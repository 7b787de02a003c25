"""A flexible allocation, ``--nodes MIN-MAX`` (issue 13).

Pure: the spec, render and plan accept it where the shard groups fit at both ends and the
global batch splits at both ends (derived from ``--batch-size`` at MAX when not given), so
the sample stream is the same whatever SLURM grants; anything else is one line and exit 2.

On the real dev cluster (marked ``slurm``): a ``--nodes 1-2`` job starts on two nodes, is
preempted (USR2) while every other node is drained, resumes on the one node left by
resharding its checkpoint, and trains on exactly the samples an uninterrupted run would
(the ranks' sample-id log, ``HPC_HSDP_FAULT_SAMPLE_LOG``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_hsdp.errors import HsdpError, SpecError
from dist_helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_hsdp", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("value, expected", [(2, (2, 2)), ("2", (2, 2)), ("1-2", (1, 2)), (" 3-8 ", (3, 8)),
                                             ("4-4", (4, 4))])  # fmt: skip
def test_parse_nodes(value, expected):
    from hpc_hsdp.spec import parse_nodes

    assert parse_nodes(value) == expected


@pytest.mark.parametrize("value, words", [("2-1", ["fewest", "write 1-2"]), ("x", ["not a node count", "MIN-MAX"]),
                                          ("1-", ["not a node count"]), ("-2", ["not a node count"]),
                                          ("1-2-3", ["not a node count"])])  # fmt: skip
def test_parse_nodes_rejects(value, words):
    from hpc_hsdp.spec import parse_nodes

    with pytest.raises(SpecError) as raised:
        parse_nodes(value)
    assert all(w in str(raised.value) for w in words), raised.value


def _spec(tmp_path, **options):
    from hpc_hsdp.cli.job_options import job_spec_from_options

    return job_spec_from_options({"run_dir": str(tmp_path / "run"), "device": "cpu", **options}, environ={},
                                 cwd=tmp_path, default_venv=None)  # fmt: skip


def test_the_global_batch_is_derived_at_the_most_nodes_and_kept_at_the_fewest(tmp_path):
    spec = _spec(tmp_path, nodes="1-2", gpus_per_node=2, shard_size=2, training_batch_size=3)
    assert (spec.min_nodes, spec.nodes, spec.flexible, spec.nodes_text) == (1, 2, True, "1-2")
    training = spec.run.training
    assert training.global_batch_size == 12  # 3 per rank x 4 ranks at 2 nodes
    assert (training.rank_batch_size(4), training.rank_batch_size(2)) == (3, 6)
    assert spec.plan_at(1).world_size == 2 and spec.plan.world_size == 4
    fixed = _spec(tmp_path, nodes="2-2", gpus_per_node=2, shard_size=2)
    assert (fixed.min_nodes, fixed.flexible, fixed.nodes_text, fixed.run.training.global_batch_size) == (None, False, "2", None)


REJECTED = [
    # (options, words of the one line)
    ({"nodes": "2-3", "gpus_per_node": 2, "shard_size": 2, "training_batch_size": 1},
     ["--nodes 2-3", "global batch 6", "4 ranks", "multiple of 12"]),
    ({"nodes": "2-3", "gpus_per_node": 2, "shard_size": 2, "training_global_batch_size": 8},
     ["global batch 8", "6 ranks", "multiple of 12"]),
    ({"nodes": "1-2", "gpus_per_node": 2, "shard_size": 4}, ["--nodes 1-2", "at 1 node(s)", "shard size 4"]),
    ({"nodes": "1-2", "gpus_per_node": 2, "shard_size": 1, "ntasks": 3}, ["--ntasks 3", "fixed node count"]),
    ({"nodes": "3-2", "gpus_per_node": 2, "shard_size": 2}, ["fewest", "write 2-3"]),
]  # fmt: skip


@pytest.mark.parametrize("options, words", REJECTED, ids=[str(o["nodes"]) + "-" + str(i) for i, (o, _) in enumerate(REJECTED)])
def test_flexible_allocations_that_cannot_keep_the_stream_are_refused(tmp_path, options, words):
    with pytest.raises(HsdpError) as raised:  # SpecError or TopologyError: one line, exit 2
        _spec(tmp_path, **options)
    assert all(w in str(raised.value) for w in words), raised.value


def test_render_writes_the_range_and_both_layouts_and_plan_shows_both_ends(tmp_path):
    out = run_cli("render", "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "2", "--device", "cpu",
                  "--run-dir", str(tmp_path / "run"), "-o", str(tmp_path / "job.sbatch"))  # fmt: skip
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --nodes=1-2\n" in text and "#SBATCH --ntasks-per-node=2\n" in text
    assert "# layout at 2 nodes: 4 ranks" in text and "# layout at 1 node: 2 ranks" in text
    assert "--global-batch-size 16" in text  # the default --batch-size 4 x 4 ranks, fixed for both ends
    assert "export HPC_HSDP_REQUEUE_REQUEST='NumNodes=1-2 NumTasks=2'\n" in text  # a requeue restores the range
    torchrun = run_cli("render", "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "2", "--device", "cpu",
                       "--launcher", "torchrun", "--run-dir", str(tmp_path / "run"))  # fmt: skip
    assert '--nnodes="$SLURM_JOB_NUM_NODES"' in torchrun.stdout, torchrun.stderr
    bad = run_cli("render", "--nodes", "2-3", "--gpus-per-node", "2", "--shard", "2", "--device", "cpu", "--batch-size", "1",
                  "--run-dir", str(tmp_path / "bad"), "-o", str(tmp_path / "bad.sbatch"))  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "multiple of 12" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad.sbatch").exists() and not (tmp_path / "bad").exists()

    plan = run_cli("plan", "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "2")
    assert plan.returncode == 0, plan.stderr
    assert "at 2 nodes (the most):" in plan.stdout and "at 1 node (the fewest):" in plan.stdout
    assert "mesh (replicate=2, shard=2)" in plan.stdout and "mesh (replicate=1, shard=2)" in plan.stdout
    data = json.loads(run_cli("plan", "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "2", "--json").stdout)
    assert (data["world_size"], data["flexible"]["min_nodes"], data["flexible"]["at_min_nodes"]["world_size"]) == (4, 1, 2)
    refused = run_cli("plan", "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "4")
    assert refused.returncode == 2 and "at 1 node(s)" in refused.stderr and refused.stderr.count("\n") == 1


def test_a_config_file_takes_a_range(tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('nodes = "1-2"\ngpus_per_node = 2\nshard = 2\n')
    spec = _spec(tmp_path, config=str(config))
    assert (spec.min_nodes, spec.nodes) == (1, 2)


# ----------------------------------------------------------------------------- the real dev cluster

JOB = ["--cluster", "slurm", "--device", "cpu", "--width", "32", "--layers", "1", "--seq-len", "8",
       "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "2", "--global-batch-size", "8"]  # fmt: skip
STEPS = 16


def _status(run: Path) -> dict:
    return json.loads(run_cli("status", str(run), "--json").stdout)


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_a_flexible_job_resumes_on_the_one_node_left_with_the_same_samples(slurm_cluster, tmp_path):
    from hpc_hsdp.data.sampler import BatchLayout, SampleOrder
    from hpc_hsdp.data.synthetic import SyntheticSamples

    debug_nodes = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N"], capture_output=True,
                                 text=True).stdout.split()  # fmt: skip
    if len(set(debug_nodes)) < 2:
        pytest.skip("needs a dev cluster of at least 2 nodes")
    run, samples = tmp_path / "run", tmp_path / "samples"
    samples.mkdir()
    out = run_cli("submit", *JOB, "--run-dir", str(run), "--steps", str(STEPS), "--checkpoint-every", "4",
                  "--env", f"HPC_HSDP_FAULT_SAMPLE_LOG={samples}", "--env", "HPC_HSDP_FAULT_STEP_DELAY_S=0.3")  # fmt: skip
    assert out.returncode == 0, out.stderr
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    drained: list[str] = []
    try:
        wait_until("step 3", lambda: len(_steps(run)) >= 3, 240)
        first = json.loads((run / "layout.json").read_text())
        assert first["plan"]["world_size"] == 4, first["plan"]  # an idle cluster grants the most
        keep = first["ranks"][0]["node"]
        drained = sorted(set(debug_nodes) - {keep})
        done = subprocess.run(["scontrol", "update", f"nodename={','.join(drained)}", "state=drain",
                               "reason=hpc-hsdp flexible-allocation test"], capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert subprocess.run(["scancel", "--signal=USR2", job_id]).returncode == 0  # save, requeue
        final = wait_until("the end of the job", lambda: (lambda s: s if s["state"].split()[0] in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL") else None)(_status(run)), 300)  # fmt: skip
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
        if drained:
            subprocess.run(["scontrol", "update", f"nodename={','.join(drained)}", "state=resume"], capture_output=True)
    assert final["state"].startswith("COMPLETED") and final["restarts"] >= 1, final
    assert _steps(run) == list(range(1, STEPS + 1))
    last = json.loads((run / "layout.json").read_text())
    assert last["plan"]["world_size"] == 2 and {r["node"] for r in last["ranks"]} == {keep}, last

    per_step: dict[int, list[int]] = {}
    worlds: dict[int, set[int]] = {}
    for log in samples.glob("samples-rank*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            per_step.setdefault(record["step"], []).extend(i for micro in record["sample_ids"] for i in micro)
            worlds.setdefault(record["step"], set()).add(record["world_size"])
    assert sorted(per_step) == list(range(1, STEPS + 1))
    assert {w for step in worlds for w in worlds[step]} == {2, 4}  # both ends trained
    synthetic = SyntheticSamples(seed=0, seq_len=8, vocab_size=256)
    order = SampleOrder(num_samples=synthetic.num_samples, seed=0)
    stream = BatchLayout(global_batch=8, world_size=1)
    for step, ids in per_step.items():
        # a step redone after the restart appears twice: once per attempt, each the same batch
        attempts = len(ids) // 8
        assert len(ids) == 8 * attempts and attempts >= 1, (step, ids)
        assert sorted(ids) == sorted(order.sample_ids(stream.step_positions(step)).tolist() * attempts), step
