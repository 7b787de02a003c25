"""--snapshot-code on the real dev SLURM cluster (hpc_hsdp.submit_host.provenance): a job that waits in
the queue while its code is edited on disk runs the code of its submit, and so does its requeue."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cluster_helpers import hpc, status, wait_until

from hpc_hsdp.rundir.lifecycle.provenance_record import read_provenance, read_task_provenance
from tests.snapshot_code_helpers import package

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(500)]


def cache_env(tmp_path: Path) -> dict:
    """The private copies of checked snapshots go under the test's directory (every node sees it)."""
    return {"HPC_HSDP_CODE_CACHE": str(tmp_path / "code-cache")}


def markers(run: Path) -> list[str]:
    path = run / "markers.txt"
    return path.read_text().splitlines() if path.exists() else []


def test_a_queued_job_and_its_requeue_run_the_code_of_the_submit_not_the_code_on_disk(slurm_cluster, tmp_path):
    src = tmp_path / "src"
    commit = package(src)
    run, go = tmp_path / "run", tmp_path / "go"
    go.touch()  # the entry need not wait: the queue holds the job
    out = hpc(
        "submit",
        "--cluster",
        "slurm",
        "--device",
        "cpu",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--shard",
        "1",
        "--no-exclusive",
        "--entry",
        "snapmod.entry:main",
        "--snapshot-code",
        "--sbatch",
        "begin=now+3600",  # behind the queue until the test moves its start
        "--run-dir",
        str(run),
        env={**cache_env(tmp_path), "PYTHONPATH": str(src), "SNAP_GO": str(go), "SNAP_HOLD_FIRST": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    assert status(run)["state"].startswith("PENDING")

    # the code on disk changes while the job waits: committed and uncommitted alike
    (src / "snapmod" / "marker.py").write_text('MARKER = "new"\n')
    subprocess.run(["git", "-C", str(src), "commit", "-qam", "new", "--author", "t <t@t>"], check=True)
    (src / "snapmod" / "marker.py").write_text('MARKER = "newer"\n')
    assert subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"]).returncode == 0

    first = wait_until("the first attempt's marker", lambda: markers(run), 180, run)
    assert first[0].startswith("MARKER=old restart=0 from="), first
    checked = tmp_path / "code-cache" / read_provenance(run)["snapshot"]["sha256"]  # code/, checked, copied privately
    assert first[0].endswith(str(checked / "hpc_hsdp" / "job" / "task_call.py")), first
    assert read_task_provenance(run)["snapshot_used"] is True

    (src / "snapmod" / "marker.py").write_text('MARKER = "newest"\n')
    assert subprocess.run(["scontrol", "requeue", job_id]).returncode == 0
    both = wait_until(
        "the requeued attempt's marker", lambda: (lambda m: m if len(m) >= 2 else None)(markers(run)), 240, run
    )
    assert both[1].startswith("MARKER=old restart=1 from="), both
    wait_until("the end", lambda: status(run)["state"].startswith("COMPLETED"), 120, run)
    task = read_task_provenance(run)
    assert task["restart"] == "1" and task["snapshot_used"] is True and task["job_id"] == job_id

    record = read_provenance(run)
    assert record["script"] == f"logs/{job_id}_submission.sh"  # the script sbatch was sent, as submitit kept it
    check = f"python -m hpc_hsdp.batch_shell.code_snapshot {run / 'code'} {record['snapshot']['sha256']})"
    assert check in (run / record["script"]).read_text()
    mine = next(c for c in record["code"] if c["name"] == "snapmod")
    assert mine["commit"] == commit and mine["dirty"] is False  # what was submitted, not what came after
    shown = hpc("status", str(run)).stdout
    assert f"code: {commit[:10]} ({src}: snapmod)" in shown, shown


def test_a_queued_job_whose_snapshot_another_user_swaps_fails_in_one_line_and_runs_none_of_it(slurm_cluster, tmp_path):
    """Issue 43: renaming code/ needs only write access to the run directory, and the job imported
    it first. The script SLURM keeps carries its SHA-256: the swapped tree fails the job in one line."""
    import shutil

    src, run, marker = tmp_path / "src", tmp_path / "run", tmp_path / "pwned"
    package(src)
    (tmp_path / "go").touch()
    out = hpc(
        "submit", "--cluster", "slurm", "--device", "cpu", "--nodes", "1", "--gpus-per-node", "1", "--shard", "1",
        "--no-exclusive", "--entry", "snapmod.entry:main", "--snapshot-code", "--sbatch", "begin=now+3600",
        "--run-dir", str(run),
        env={**cache_env(tmp_path), "PYTHONPATH": str(src), "SNAP_GO": str(tmp_path / "go")},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = json.loads((run / "job.json").read_text())["job_id"]
    try:
        (run / "code").rename(run / "code.submitted")
        shutil.copytree(run / "code.submitted", run / "code")
        (run / "code" / "snapmod" / "entry.py").write_text(f"def main(ctx):\n    open({str(marker)!r}, 'w').close()\n")
        assert subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"]).returncode == 0
        wait_until("the job's end", lambda: status(run)["state"].split()[0] in ("FAILED", "COMPLETED"), 180, run)
        assert status(run)["state"].startswith("FAILED")
        assert not marker.exists() and not (run / "markers.txt").exists()
        said = [line for p in (run / "logs").glob("*_log.*") for line in p.read_text().splitlines()
                if "snapshot" in line]  # fmt: skip
        assert len(said) == 1 and "is not the code submit copied" in said[0], said
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)
