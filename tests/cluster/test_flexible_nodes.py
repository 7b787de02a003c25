"""A flexible allocation, ``--nodes MIN-MAX`` (issue 13).

On the real dev cluster (marked ``slurm``): a ``--nodes 1-2`` job runs on two nodes while every
other node is busy; its first node dies (``scripts/dev-cluster kill-node``); SLURM requeues it
for two nodes, the survivors restore the range, and it resumes on the one node left by
resharding its checkpoint; the node comes back, a USR2 requeue (which restores the range too)
lets it grow to two nodes again; every step trains on exactly the samples an uninterrupted run
would (the ranks' sample-id log, ``HPC_HSDP_FAULT_SAMPLE_LOG``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from cluster_helpers import hpc
from dist_helpers import wait_until

from tests.job_helpers import tiny_job
from tests.slurm_job_helpers import job_fields

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the real dev cluster

JOB = [
    *("--cluster", "slurm", "--device", "cpu", "--nodes", "1-2", "--gpus-per-node", "2", "--shard", "2"),
    *tiny_job(batch_size=None, vocab_size=None, global_batch_size=8),
]
STEPS = 24
EVERY = 4


def _status(run: Path) -> dict:
    return json.loads(hpc("status", str(run), "--json").stdout)


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _steps(run: Path) -> list[int]:
    return [r["step"] for r in _records(run)]


def _sample_ids(samples: Path) -> tuple[dict[int, list[int]], dict[int, set[int]]]:
    """Per step: the sample ids every rank of every attempt trained on, and the world sizes seen."""
    per_step: dict[int, list[int]] = {}
    worlds: dict[int, set[int]] = {}
    for log in samples.glob("samples-rank*.jsonl"):
        for line in log.read_text().splitlines():
            record = json.loads(line)
            per_step.setdefault(record["step"], []).extend(i for micro in record["sample_ids"] for i in micro)
            worlds.setdefault(record["step"], set()).add(record["world_size"])
    return per_step, worlds


def _layout(run: Path) -> dict:
    return json.loads((run / "layout.json").read_text())


def _debug_nodes(at_least: int) -> list[str]:
    """The debug partition's nodes, sorted; the test is skipped on a smaller dev cluster."""
    shown = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%N"], capture_output=True, text=True).stdout
    nodes = sorted(set(shown.split()))
    if len(nodes) < at_least:
        pytest.skip(f"needs a dev cluster of at least {at_least} nodes (scripts/dev-cluster up, default --nodes 3)")
    return nodes


@contextmanager
def _nodes_busy(nodes: list[str]) -> Iterator[str]:
    """A job holding ``nodes`` whole, running before the block starts and cancelled after it: its id."""
    blocker = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "debug",
            "--exclusive",
            "-N",
            str(len(nodes)),
            "-w",
            ",".join(nodes),
            "-o",
            "/dev/null",
            "--wrap",
            "sleep 900",
        ],
        capture_output=True,
        text=True,
    )
    assert blocker.returncode == 0, blocker.stderr
    blocker_id = blocker.stdout.strip().split(";")[0]
    try:
        wait_until(
            "the blocker running",
            lambda: (
                subprocess.run(
                    ["squeue", "-h", "-j", blocker_id, "-o", "%T"], capture_output=True, text=True
                ).stdout.strip()
                == "RUNNING"
            ),
            60,
        )
        yield blocker_id
    finally:
        subprocess.run(["scancel", blocker_id], capture_output=True)


@pytest.mark.slurm
@pytest.mark.timeout(480)
def test_a_flexible_job_loses_a_node_resumes_on_the_one_left_then_grows_back_with_the_same_samples(
    slurm_cluster, tmp_path
):
    """``--nodes 1-2`` on two nodes, every other node busy (a blocker job). The job's first node
    (rank 0's, and the batch shell's) dies: SLURM requeues the job for the 2 nodes it had, the
    survivors put the range back, and it resumes on the one node left, resharding its checkpoint.
    The dead node comes back; a USR2 (save, our own requeue, which restores the range too) makes
    it resume on two nodes again. Every step trains on exactly the uninterrupted run's samples."""
    from hpc_hsdp.data.sampler import BatchLayout, SampleOrder
    from hpc_hsdp.data.synthetic import SyntheticSamples
    from hpc_hsdp.rundir.lifecycle import attempts

    debug_nodes = _debug_nodes(3)
    run, samples = tmp_path / "run", tmp_path / "samples"
    samples.mkdir()
    job_id, victim = "", ""
    with _nodes_busy(debug_nodes[2:]):
        try:
            out = hpc(
                "submit",
                *JOB,
                "--run-dir",
                str(run),
                "--steps",
                str(STEPS),
                "--checkpoint-every",
                str(EVERY),
                "--max-restarts",
                "2",
                "--env",
                f"HPC_HSDP_FAULT_SAMPLE_LOG={samples}",
                "--env",
                "HPC_HSDP_FAULT_STEP_DELAY_S=0.3",
            )
            assert out.returncode == 0, out.stderr
            job_id = json.loads((run / "job.json").read_text())["job_id"]
            wait_until("step 6", lambda: len(_steps(run)) >= 6, 240)
            first = _layout(run)
            assert first["plan"]["world_size"] == 4, first["plan"]  # the two free nodes
            victim = first["ranks"][0]["node"]  # rank 0's: the batch shell dies with it, the survivors act
            survivor = first["ranks"][-1]["node"]
            killed = subprocess.run(
                [str(ROOT / "scripts" / "dev-cluster"), "kill-node", victim], capture_output=True, text=True
            )
            assert killed.returncode == 0, killed.stderr
            died_at = float(re.search(r"at ([0-9.]+)$", killed.stdout.strip()).group(1))
            last_before = max(_steps(run))
            wait_until(
                "the requeued job running again",
                lambda: job_fields(job_id).get("Restarts") == "1" and job_fields(job_id).get("JobState") == "RUNNING",
                180,
            )
            assert job_fields(job_id)["NodeList"] == survivor  # the one free node, not the two it had
            # the dead node comes back while the job starts on the one left: the next requeue may grow it
            revived = subprocess.run(
                [str(ROOT / "scripts" / "dev-cluster"), "revive-node", victim], capture_output=True, text=True
            )
            assert revived.returncode == 0, revived.stderr
            wait_until(
                "the first step resumed on one node", lambda: any(r["wall_time"] > died_at for r in _records(run)), 180
            )
            alone = _layout(run)
            assert {r["node"] for r in alone["ranks"]} == {survivor}, alone
            resumed = next(r for r in _records(run) if r["wall_time"] > died_at)
            redone = last_before - (resumed["step"] - 1)
            assert 0 <= redone <= EVERY, (last_before, resumed["step"])
            wait_until("a step on one node", lambda: max(_steps(run)) > resumed["step"], 60)
            assert max(_steps(run)) < STEPS - 4, "the job ran out of steps before the second restart"
            assert subprocess.run(["scancel", "--signal=USR2", job_id]).returncode == 0  # save, requeue with the range
            final = wait_until(
                "the end of the job",
                lambda: (
                    lambda s: (
                        s
                        if s["state"].split()[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
                        else None
                    )
                )(_status(run)),
                300,
            )
        finally:
            if job_id:
                subprocess.run(["scancel", job_id], capture_output=True)
            if victim:
                subprocess.run([str(ROOT / "scripts" / "dev-cluster"), "revive-node", victim], capture_output=True)
    assert final["state"].startswith("COMPLETED") and final["restarts"] >= 2, final
    assert _steps(run) == list(range(1, STEPS + 1))
    logs = "\n".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("*.err")))
    assert (
        f"[hpc-hsdp] job {job_id} requeued by SLURM: node range restored (NumNodes=1-2 NumTasks=2)" in logs
    )  # a survivor
    # the USR2 requeue: rank 0 requeued with the range (the batch shell's own restore on SLURM's SIGTERM
    # is a second try that runs only when the SIGTERM comes while srun still runs: not asserted)
    assert f"requeued job {job_id} (scontrol requeuehold, update NumNodes=1-2 NumTasks=2, release); it resumes" in logs
    reasons = [r["reason"] for r in attempts.read_restarts(run)]
    assert reasons[:2] == ["node_failure", "warning_signal"], attempts.read_restarts(run)
    last = _layout(run)
    assert last["plan"]["world_size"] == 4 and {r["node"] for r in last["ranks"]} == {victim, survivor}, last

    per_step, worlds = _sample_ids(samples)
    assert sorted(per_step) == list(range(1, STEPS + 1))
    assert worlds[1] == {4} and worlds[resumed["step"]] >= {2} and worlds[STEPS] == {4}  # 2 nodes, 1, 2 again
    synthetic = SyntheticSamples(seed=0, seq_len=8, vocab_size=256)
    order = SampleOrder(num_samples=synthetic.num_samples, seed=0)
    stream = BatchLayout(global_batch=8, world_size=1)
    for step, ids in per_step.items():
        # a step redone after a restart appears once per attempt, each time the same batch (the
        # step the node died in: on the ranks that had logged it)
        counts = Counter(ids)
        expected = set(order.sample_ids(stream.step_positions(step)).tolist())
        assert len(expected) == 8 and set(counts) == expected, (step, ids)
        assert max(counts.values()) - min(counts.values()) <= 1, (step, ids)
    print(
        f"flexible job, node death -> first resumed step done on 1 node: {resumed['wall_time'] - died_at:.1f} s; "
        f"steps redone: {redone}"
    )


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_results_of_a_flexible_job_granted_fewer_nodes_are_those_of_the_tasks_that_ran(slurm_cluster, tmp_path):
    """``hpc_hsdp.submit(fn, nodes="1-2")`` with one node free: SLURM grants one, two tasks run;
    ``job.results()`` is their two results (submitit alone waits for the result files of the two
    tasks of the node never granted, then raises)."""
    debug_nodes = _debug_nodes(2)
    code = f"""
import hpc_hsdp, json, time
def fn(ctx):
    return [ctx.rank, ctx.world_size, ctx.layout.node]
job = hpc_hsdp.submit(fn, cluster="slurm", nodes="1-2", gpus_per_node=2, shard=2, run_dir={str(tmp_path / "api")!r},
                      device="cpu")
while not all(job.task(k).paths.result_pickle.exists() for k in (0, 1)):
    time.sleep(0.2)
started = time.monotonic()
results = job.results()
print(json.dumps({{"results": results, "seconds": time.monotonic() - started}}))
"""
    with _nodes_busy(debug_nodes[1:]):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["results"] == [[0, 2, debug_nodes[0]], [1, 2, debug_nodes[0]]], answer
    assert answer["seconds"] < 10, answer  # from the tasks' results: no wait for files that no task writes
