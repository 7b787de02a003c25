"""Sweeps on the local emulator (submit --sweep --cluster local): one job array whose points run
K at a time, each a whole multi-node job in its own run directory; status, runs, report and
cancel of the sweep's directory; a sweep submitted again; the Python API's submit_sweep and its
wait(), with --snapshot-code (each point runs its copy)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import hpc

from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

TINY = tiny_job()
POINTS = ["lr=3e-4,seed=0", "lr=3e-4,seed=1", "lr=1e-3,seed=0", "lr=1e-3,seed=1"]


def point_states(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/logs/*_local.json"))]


def test_a_2x2_sweep_runs_two_at_a_time_each_point_a_multi_node_job(tmp_path, local_submit):
    sweep = tmp_path / "sweep"
    argv = local_submit(sweep, "--steps", "4", *TINY, nodes=2, gpus_per_node=1, shard=1)
    out = hpc(*argv, "--sweep", "lr=3e-4,1e-3", "--sweep", "seed=0,1", "--array-parallelism", "2", "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 points, at most 2 at once" in out.stdout
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name != "logs") == sorted(POINTS)
    record = json.loads((sweep / "sweep.json").read_text())
    array = record["job_id"]
    for index, name in enumerate(POINTS):
        run = sweep / name
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3, 4], name
        layout = json.loads((run / "layout.json").read_text())
        assert sorted({r["node"] for r in layout["ranks"]}) == ["n1", "n2"]  # each point: 2 nodes
        job = json.loads((run / "job.json").read_text())
        assert job["job_id"] == f"{array}_{index}"
        assert (run / "logs" / f"{array}_{index}_1_log.out").is_file()  # rank 1's log, named by the array task
        assert json.loads((run / "claim.json").read_text())["state"] == "released"
    # the seeds and learning rates reached the points: their losses differ
    losses = {
        name: json.loads((sweep / name / "metrics.jsonl").read_text().splitlines()[-1])["loss"] for name in POINTS
    }
    assert len(set(losses.values())) == 4, losses
    # never more than 2 at once: at every start, at most one other point was running
    spans = [(s["started_at"], s["ended_at"]) for s in point_states(sweep)]
    assert len(spans) == 4 and all(s["state"] == "COMPLETED" for s in point_states(sweep))
    for start, _ in spans:
        assert sum(1 for a, b in spans if a <= start < b) <= 2, spans

    status = json.loads(hpc("status", str(sweep), "--json").stdout)
    assert [p["name"] for p in status["points"]] == POINTS and {p["state"] for p in status["points"]} == {"COMPLETED"}
    listed = hpc("runs", str(sweep)).stdout.splitlines()
    assert len(listed) == 5 and all(any(line.startswith(name) for line in listed) for name in POINTS), listed
    report = hpc("report", str(sweep))
    assert report.returncode == 0, report.stderr
    best = min(losses, key=losses.get)
    assert f"  1     {best}" in report.stdout, report.stdout
    html = (sweep / "report.html").read_text()
    assert all(name in html for name in POINTS) and f"#1 {best}" in html


def test_a_point_cancelled_before_it_starts_never_runs_and_the_others_finish(tmp_path, local_submit):
    sweep = tmp_path / "sweep"
    argv = local_submit(sweep, "--steps", "3", *TINY, nodes=1, gpus_per_node=2, shard=2)
    out = hpc(*argv, "--sweep", "seed=0,1,2", "--array-parallelism", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    cancel = hpc("cancel", str(sweep / "seed=2"), "--no-wait")
    assert cancel.returncode == 0, cancel.stderr
    from hpc_hsdp.submit_host.sweep_handle import SweepHandle

    results = {r.name: r for r in SweepHandle.find(sweep).wait(poll_s=0.5, timeout_s=200)}
    assert results["seed=0"].state == "COMPLETED" and results["seed=1"].state == "COMPLETED"
    assert results["seed=2"].state == "CANCELLED" and not (sweep / "seed=2" / "metrics.jsonl").exists()

    # the same sweep submitted again: the completed points are not, the cancelled one runs
    again = hpc(*argv, "--sweep", "seed=0,1,2", "--array-parallelism", "1", "--wait")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "2 point(s) already completed, not submitted again: seed=0, seed=1" in again.stderr
    assert "#SBATCH --array=2%1" in (sweep / "sweep.sbatch").read_text()
    results = {r.name: r for r in SweepHandle.find(sweep).results()}
    assert [results[name].state for name in ("seed=0", "seed=1", "seed=2")] == ["COMPLETED"] * 3
    array = json.loads((sweep / "sweep.json").read_text())["job_id"]
    assert results["seed=2"].job_id == f"{array}_2" and results["seed=0"].job_id != f"{array}_0"
    refused = hpc(*argv, "--sweep", "seed=0,1,2")
    assert refused.returncode == 2 and "every point of the sweep" in refused.stderr, refused.stderr


def test_the_python_api_submits_a_sweep_and_waits_for_its_ranked_results(tmp_path, monkeypatch):
    import hpc_hsdp

    for key in [k for k in os.environ if k.startswith(("SLURM", "MASTER_"))]:
        monkeypatch.delenv(key)
    handle = hpc_hsdp.submit_sweep(
        {"lr": [1e-3, 3e-2]},
        array_parallelism=2,
        cluster="local",
        nodes=1,
        gpus_per_node=2,
        shard=2,
        device="cpu",
        steps=3,
        width=32,
        layers=1,
        seq_len=8,
        batch_size=2,
        vocab_size=64,
        run_dir=str(tmp_path / "api"),
        snapshot_code=True,
    )
    results = handle.wait(poll_s=0.5, timeout_s=200)
    assert [r.state for r in results] == ["COMPLETED", "COMPLETED"]
    assert sorted(r.name for r in results) == ["lr=0.001", "lr=0.03"]
    assert results[0].loss <= results[1].loss and all(r.step == 3 for r in results)
    assert all(Path(r.run_dir).parent == tmp_path / "api" for r in results)
    from hpc_hsdp.rundir.lifecycle.provenance_record import read_provenance, read_task_provenance

    for r in results:  # --snapshot-code: each point runs its own copy of the code of the submit
        assert read_task_provenance(r.run_dir)["snapshot_used"] is True
        assert (Path(r.run_dir) / "code" / "hpc_hsdp").is_dir()
        assert read_provenance(r.run_dir)["job_id"] == r.job_id


def test_a_sweep_over_nodes_is_one_job_array_per_header_and_each_point_gets_its_nodes(tmp_path, local_submit):
    sweep = tmp_path / "sweep"
    argv = local_submit(sweep, "--steps", "2", *TINY, nodes=1, gpus_per_node=1, shard=1)
    out = hpc(*argv, "--sweep", "nodes=1,2", "--array-parallelism", "1", "--wait")
    assert out.returncode == 0, out.stdout + out.stderr
    record = json.loads((sweep / "sweep.json").read_text())
    arrays = record["job_ids"]
    assert len(arrays) == 2 and "2 job arrays" in out.stdout and "at most 1 at once in each array" in out.stdout
    assert (sweep / "sweep-1.sbatch").is_file() and (sweep / "sweep-2.sbatch").is_file()
    for array, nodes in zip(arrays, (1, 2)):
        run = sweep / f"nodes={nodes}"
        assert f"#SBATCH --nodes={nodes}\n" in (sweep / f"sweep-{nodes}.sbatch").read_text()
        assert json.loads((run / "job.json").read_text())["job_id"] == f"{array}_0"  # task 0 of its own array
        layout = json.loads((run / "layout.json").read_text())
        assert sorted({r["node"] for r in layout["ranks"]}) == ["n1", "n2"][:nodes], layout
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]
    status = json.loads(hpc("status", str(sweep), "--json").stdout)
    assert status["job_ids"] == arrays
    assert [(p["name"], p["state"], p["job_id"]) for p in status["points"]] == [
        ("nodes=1", "COMPLETED", f"{arrays[0]}_0"),
        ("nodes=2", "COMPLETED", f"{arrays[1]}_0"),
    ]
    listed = hpc("runs", str(sweep)).stdout.splitlines()
    assert len(listed) == 3 and any(line.startswith("nodes=2") for line in listed), listed


def test_cancel_of_a_sweep_says_what_each_point_saved(tmp_path, local_submit):
    import time  # noqa: PLC0415

    sweep = tmp_path / "sweep"
    argv = local_submit(sweep, "--steps", "100000", *TINY, nodes=1, gpus_per_node=1, shard=1)
    out = hpc(*argv, "--sweep", "seed=0,1")
    assert out.returncode == 0, out.stdout + out.stderr
    deadline = time.monotonic() + 120
    while not all((sweep / name / "metrics.jsonl").exists() for name in ("seed=0", "seed=1")):
        assert time.monotonic() < deadline, "the points did not start"
        time.sleep(0.5)
    cancelled = hpc("cancel", str(sweep))
    assert cancelled.returncode == 0, cancelled.stderr
    for name in ("seed=0", "seed=1"):
        last = [json.loads(line)["step"] for line in (sweep / name / "metrics.jsonl").read_text().splitlines()][-1]
        assert f"{name}: step {last} saved: the same submit --sweep resumes from it\n" in cancelled.stdout, (
            cancelled.stdout
        )
