"""Sweeps on the real dev SLURM cluster (submit --sweep --cluster slurm): one job array of
multi-node points, K at a time; a point requeued mid-run (scontrol requeue ARRAY_TASK) and one
preempted (the warning signal) resume exactly while the others finish; a sweep over --nodes, one
job array per #SBATCH header, completes, a point of its second array requeued alone resumes, and
cancelling such a sweep cancels every array; more
points than MaxArraySize is refused before anything is written."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
from cluster_helpers import hpc

from hpc_hsdp.rundir.files import read_jsonl
from tests.job_helpers import tiny_job

JOB = tiny_job(vocab_size=None, cluster="slurm", device="cpu")
TWO_BY_TWO = ["--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--no-exclusive"]
STEPS = 40
SLOW = "HPC_HSDP_FAULT_STEP_DELAY_S"  # test hook: a tiny job lasts long enough to be requeued mid-training
# max_restarts changes nothing a step computes: the points seed=S,max_restarts=2 and =3 are twins, and the
# requeued one must end with its twin's every loss
POINTS = ["seed=0,max_restarts=2", "seed=0,max_restarts=3", "seed=1,max_restarts=2", "seed=1,max_restarts=3"]
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def sweep_status(sweep: Path) -> dict:
    out = hpc("status", str(sweep), "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [r["step"] for r in read_jsonl(path)] if path.is_file() else []


def logs(run: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run / "logs").glob("*_log.*")))


def wait_until(what: str, check, timeout_s: float, sweep: Path):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached in {timeout_s} s; {sweep_status(sweep)}")
        time.sleep(0.5)


@pytest.mark.slurm
@pytest.mark.timeout(600)
def test_a_2x2_sweep_of_two_node_points_runs_two_at_a_time_and_a_requeued_point_resumes_exactly(
    slurm_cluster, tmp_path
):
    sweep = tmp_path / "sweep"
    out = hpc(
        "submit",
        *JOB,
        *TWO_BY_TWO,
        "--steps",
        str(STEPS),
        "--env",
        f"{SLOW}=0.15",
        "--run-dir",
        str(sweep),
        "--sweep",
        "seed=0,1",
        "--sweep",
        "max_restarts=2,3",
        "--array-parallelism",
        "2",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    array = json.loads((sweep / "sweep.json").read_text())["job_id"]
    shown = subprocess.run(["scontrol", "-o", "show", "job", f"{array}_0"], capture_output=True, text=True).stdout
    assert re.search(r"ArrayTaskThrottle=2\b", shown) or "%2" in shown, shown  # one array, 2 at a time

    requeued = sweep / POINTS[0]
    wait_until("step 4 of the first point", lambda: len(steps(requeued)) >= 4, 240, sweep)
    assert subprocess.run(["scontrol", "requeue", f"{array}_0"]).returncode == 0  # that array task alone
    # a later point preempted: the warning signal to its tasks, rank 0 requeues its own array task
    preempted = sweep / POINTS[2]
    wait_until("step 4 of the third point", lambda: len(steps(preempted)) >= 4, 300, sweep)
    assert subprocess.run(["scancel", "--signal=USR2", f"{array}_2"]).returncode == 0

    final = wait_until(
        "the end of every point",
        lambda: (lambda s: s if all(p["state"].split()[0] in ENDED for p in s["points"]) else None)(
            sweep_status(sweep)
        ),
        420,
        sweep,
    )
    assert [p["name"] for p in final["points"]] == POINTS
    assert [p["state"] for p in final["points"]] == ["COMPLETED"] * 4, final
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name != "logs") == sorted(POINTS)
    for name in POINTS:
        run = sweep / name
        assert steps(run) == list(range(1, STEPS + 1)), name  # no gap, no repeat
        layout = json.loads((run / "layout.json").read_text())
        assert len({r["node"] for r in layout["ranks"]}) == 2, name  # every point a 2-node job

    # the requeued point stopped, saved, and resumed from its checkpoint; the others ran once
    point = json.loads(hpc("status", str(requeued), "--json").stdout)
    assert point["job_id"] == f"{array}_0" and point["restarts"] >= 1, point
    text = logs(requeued)
    assert re.search(r"TERM: every rank stops after step \d+ and saves", text), text[-3000:]
    assert "resumed from step" in text and "(restart 1)" in text
    text = logs(preempted)
    assert "on USR2: requeued job" in text and "(restart 1)" in text, text[-3000:]
    for name in (POINTS[1], POINTS[3]):
        assert json.loads(hpc("status", str(sweep / name), "--json").stdout)["restarts"] == 0, name
    # exactly: every loss of the requeued point is its uninterrupted twin's
    losses = {name: [r["loss"] for r in read_jsonl(sweep / name / "metrics.jsonl")] for name in POINTS}
    assert losses[POINTS[0]] == losses[POINTS[1]]
    assert losses[POINTS[2]] == losses[POINTS[3]] and losses[POINTS[0]] != losses[POINTS[2]]

    # never more than 2 points at once (SLURM's own record of each task's last run)
    acct = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", array, "-o", "JobID,Start,End"], capture_output=True, text=True
    ).stdout
    spans = [tuple(line.split("|")[1:]) for line in acct.splitlines() if line.count("|") == 2]
    assert len(spans) == 4, acct
    for start, _ in spans:
        assert sum(1 for a, b in spans if a <= start < b) <= 2, acct

    report = hpc("report", str(sweep))
    assert report.returncode == 0 and "best first by their last loss" in report.stdout, report.stdout + report.stderr


def one_node_each(nodes: int) -> list[str]:
    return ["--nodes", str(nodes), "--gpus-per-node", "1", "--shard", "1", "--no-exclusive"]


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_sweep_over_nodes_is_two_arrays_that_complete_a_point_requeues_alone_and_cancel_ends_both(
    slurm_cluster, tmp_path
):
    done, cancelled = tmp_path / "done", tmp_path / "cancelled"
    try:
        for sweep, count, delay in ((done, 3, 0), (cancelled, 200, 0.5)):
            out = hpc(
                "submit", *JOB, *one_node_each(1), "--steps", str(count), "--env", f"{SLOW}={delay}",
                "--run-dir", str(sweep), "--sweep", "nodes=1,2", "--array-parallelism", "1",
            )  # fmt: skip
            assert out.returncode == 0, out.stdout + out.stderr
            assert "2 job arrays" in out.stdout, out.stdout
        arrays = json.loads((cancelled / "sweep.json").read_text())["job_ids"]
        assert len(arrays) == 2 and [
            json.loads((cancelled / n).read_text())["job_id"] for n in ("nodes=1/job.json", "nodes=2/job.json")
        ] == [f"{a}_0" for a in arrays]
        for nodes, array in zip((1, 2), arrays):
            shown = subprocess.run(
                ["scontrol", "-o", "show", "job", f"{array}_0"], capture_output=True, text=True
            ).stdout
            assert re.search(rf"NumNodes={nodes}(-{nodes})? ", shown), shown  # each array its own header's node count

        # the long sweep: both points running; the second array's point requeued alone resumes from its
        # checkpoint while the first array's goes on; then one cancel of the sweep's directory ends both arrays
        wait_until("both points training", lambda: all(steps(cancelled / f"nodes={n}") for n in (1, 2)), 120, cancelled)
        assert subprocess.run(["scontrol", "requeue", f"{arrays[1]}_0"]).returncode == 0
        wait_until(
            "the requeued point resumed", lambda: "resumed from step" in logs(cancelled / "nodes=2"), 120, cancelled
        )
        restarts = [
            json.loads(hpc("status", str(cancelled / f"nodes={n}"), "--json").stdout)["restarts"] for n in (1, 2)
        ]
        assert restarts == [0, 1], restarts
        out = hpc("cancel", str(cancelled))
        assert out.returncode == 0, out.stderr
        assert (
            f"cancelled 2 point(s) of job arrays {arrays[0]} {arrays[1]}: {arrays[0]}_0 {arrays[1]}_0" in out.stdout
        ), out.stdout
        states = [p["state"].split()[0] for p in sweep_status(cancelled)["points"]]
        assert states == ["CANCELLED", "CANCELLED"], states
        acct = subprocess.run(
            ["sacct", "-X", "-n", "-P", "-j", ",".join(arrays), "-o", "JobID,State"], capture_output=True, text=True
        ).stdout
        assert sorted(line.split("|")[0] for line in acct.splitlines()) == sorted(f"{a}_0" for a in arrays), acct
        assert all(line.split("|")[1].startswith("CANCELLED") for line in acct.splitlines()), acct

        # the short sweep: both arrays complete, each point on its own number of nodes
        final = wait_until(
            "the end of both points",
            lambda: (lambda s: s if all(p["state"].split()[0] in ENDED for p in s["points"]) else None)(
                sweep_status(done)
            ),
            180,
            done,
        )
        assert (
            final["job_ids"] == json.loads((done / "sweep.json").read_text())["job_ids"] and len(final["job_ids"]) == 2
        )
        assert [(p["name"], p["state"]) for p in final["points"]] == [
            ("nodes=1", "COMPLETED"),
            ("nodes=2", "COMPLETED"),
        ]
        for nodes in (1, 2):
            run = done / f"nodes={nodes}"
            assert steps(run) == [1, 2, 3]
            layout = json.loads((run / "layout.json").read_text())
            assert len({r["node"] for r in layout["ranks"]}) == nodes, layout
    finally:  # whatever failed, none of the test's jobs is left behind
        records = [sweep / "sweep.json" for sweep in (done, cancelled) if (sweep / "sweep.json").is_file()]
        ids = [i for record in records for i in json.loads(record.read_text())["job_ids"]]
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True)


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_more_points_than_max_array_size_is_refused_in_one_line_and_nothing_is_written(slurm_cluster, tmp_path):
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    most = int(re.search(r"MaxArraySize\s*=\s*(\d+)", config).group(1))
    sweep = tmp_path / "sweep"
    seeds = ",".join(str(i) for i in range(most + 1))
    out = hpc("submit", *JOB, *TWO_BY_TWO, "--steps", "2", "--run-dir", str(sweep), "--sweep", f"seed={seeds}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"more than this cluster's MaxArraySize ({most}" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and out.stdout == ""
    assert not sweep.exists()


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_a_swapped_script_of_a_pending_point_fails_that_point_in_one_line_and_does_not_run(slurm_cluster, tmp_path):
    """Issue 43: the array's script, which SLURM keeps its own copy of, carries each point's SHA-256;
    another user who replaces a pending point's point.sbatch gets the point FAILED, their script unrun."""
    import os

    sweep, marker = tmp_path / "sweep", tmp_path / "pwned"
    try:
        out = hpc(
            "submit", *JOB, *one_node_each(1), "--steps", "3", "--run-dir", str(sweep),
            "--sweep", "seed=0,1", "--array-parallelism", "1",
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        pending = sweep / "seed=1"
        planted = pending / ".planted"
        planted.write_text(f"#!/bin/bash\ntouch {marker}\n")
        os.replace(planted, pending / "point.sbatch")  # the rename another user with write access can do
        final = wait_until(
            "the end of both points",
            lambda: (lambda s: s if all(p["state"].split()[0] in ENDED for p in s["points"]) else None)(
                sweep_status(sweep)
            ),
            180,
            sweep,
        )
        assert [(p["name"], p["state"].split()[0]) for p in final["points"]] == [
            ("seed=0", "COMPLETED"),
            ("seed=1", "FAILED"),
        ], final
        assert not marker.exists()
        said = [line for line in logs(pending).splitlines() if "submit wrote" in line]
        assert len(said) == 1 and "point.sbatch is not the script submit wrote" in said[0], logs(pending)
        assert steps(sweep / "seed=0") == [1, 2, 3]
    finally:
        if (sweep / "sweep.json").is_file():
            subprocess.run(["scancel", *json.loads((sweep / "sweep.json").read_text())["job_ids"]], capture_output=True)
