"""One writer per run directory, and the directory is the run (issue 27), on the local emulator.

Two submissions raced into one run directory (two processes released together by a barrier
file): one job, one refusal naming it; a copied and a moved run directory of a real small run
read the same as the original (status, logs, report, runs); resuming a copy leaves the original
byte for byte as it was; cancel of a copy whose job runs elsewhere refuses. The claims alone:
tests/fast/test_run_dir_claims.py; the race on the dev cluster: tests/cluster/test_run_dir_claims.py.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cluster_helpers import (
    hpc,
)  # SLURM_CONF kept: tests/cluster/test_run_dir_claims.py runs these helpers on the dev cluster

from tests.claims_helpers import _local_job, _tree
from tests.run_dir_claims_helpers import (
    TINY,
    _status,
    one_run_one_refusal,
    race,
    wait_state,
    wait_steps,
)

LOCAL_JOB = ["--nodes", "1", "--gpus-per-node", "1", "--shard", "1", "--device", "cpu", *TINY]


# ----------------------------------------------------------------------------- one writer


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_two_racing_submits_on_the_emulator_give_one_run_and_one_refusal(tmp_path):
    run = tmp_path / "run"
    results = race(tmp_path, "submit", "--cluster", "local", "--run-dir", str(run), "--steps", "100000", *LOCAL_JOB)
    job_id, _ = one_run_one_refusal(results, run)
    assert sorted({p.name.split("_")[0] for p in (run / "logs").glob("*_local.json")}) == [job_id]  # one job
    claim = json.loads((run / "claim.json").read_text())
    assert (claim["state"], claim["job_id"], claim["cluster"], claim["logs_dir"]) == (
        "claimed",
        job_id,
        "local",
        "logs",
    )

    # while it runs, a copy of its directory is not where it runs: cancel of the copy refuses, naming it
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("job.json", "claim.json"):
        shutil.copy2(run / name, copy / name)
    shutil.copytree(run / "logs", copy / "logs", ignore=shutil.ignore_patterns(".emulator-bin"))
    refused = hpc("cancel", str(copy))
    why = f"{refused.stdout}{refused.stderr}; the job: {hpc('status', str(run)).stdout}"
    assert refused.returncode == 2 and refused.stdout == "", why
    assert refused.stderr.splitlines() == [
        f"hpc-hsdp: error: {copy} is not where job {job_id} runs: the scheduler says it writes {run} ({copy} is "
        f"a copy, or was moved); nothing cancelled: cancel it from there (hpc-hsdp cancel {run})"
    ]
    wait_steps(run, 2)
    assert wait_state(run, ("RUNNING",))["job_id"] == job_id  # the copy's cancel left it running
    cancelled = hpc("cancel", str(run))
    assert cancelled.returncode == 0 and cancelled.stdout.startswith(f"cancelled job {job_id} ("), cancelled.stderr
    assert wait_state(run, ("CANCELLED", "FAILED", "COMPLETED"))["state"] == "CANCELLED"
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, len(steps) + 1))  # one writer: each step once, in order
    claim = json.loads((run / "claim.json").read_text())  # released by the emulator as the job ended
    assert (claim["state"], claim["job_id"], claim["ended"]) == ("released", job_id, "CANCELLED")


# ----------------------------------------------------------------------------- the directory is the run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real small run of the emulator, completed: 3 steps, one eval."""
    run = tmp_path_factory.mktemp("orig") / "run"
    done = hpc(
        "submit", "--cluster", "local", "--run-dir", str(run), "--steps", "3", "--eval-every", "3", *LOCAL_JOB, "--wait"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return run


def _same_reading(original: Path, other: Path) -> None:
    from hpc_hsdp.report import load_runs

    mine, theirs = _status(original), _status(other)
    assert theirs["run_dir"] == str(other) and mine["run_dir"] == str(original)
    for key in ("job_id", "state", "exit_code", "last_step", "total_steps", "failure"):
        assert theirs[key] == mine[key], key
    assert theirs["state"] == "COMPLETED" and theirs["last_step"]["step"] == 3
    text = hpc("status", str(other)).stdout.splitlines()
    assert text[-1] == f"run directory: {other}"
    assert [line for line in text if line.startswith("last step")] == [
        line for line in hpc("status", str(original)).stdout.splitlines() if line.startswith("last step")
    ]
    logs, copied_logs = hpc("logs", str(original), "--rank", "0"), hpc("logs", str(other), "--rank", "0")
    assert copied_logs.returncode == 0 and "rank 0" in copied_logs.stdout
    assert copied_logs.stdout == logs.stdout
    assert hpc("logs", str(other)).stdout == hpc("logs", str(original)).stdout
    a, b = load_runs([str(original)])[0], load_runs([str(other)])[0]
    assert (b.state, b.last, b.total_steps, b.series("loss"), b.series("eval_loss")) == (
        a.state,
        a.last,
        a.total_steps,
        a.series("loss"),
        a.series("eval_loss"),
    )
    drawn = hpc("report", str(other), "-o", str(other.parent / "r.html"))
    assert drawn.returncode == 0, drawn.stderr

    def row(root: Path) -> list[str]:
        lines = hpc("runs", str(root)).stdout.splitlines()
        assert len(lines) == 2, lines
        return lines[1].split()[1:-3]  # STATE STEP LOSS (not the label, not the age)

    assert row(other.parent) == row(original.parent)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_copied_and_a_moved_run_read_as_the_original_and_a_resumed_copy_leaves_it_untouched(finished_run, tmp_path):
    original = finished_run
    pristine = _tree(original)
    copy = tmp_path / "copies" / "copy"
    shutil.copytree(original, copy, symlinks=True)
    _same_reading(original, copy)

    # moved: the old path is gone
    staged = tmp_path / "staged"
    shutil.copytree(original, staged, symlinks=True)
    moved = tmp_path / "archive" / "moved"
    moved.parent.mkdir()
    staged.rename(moved)
    assert not staged.exists()
    _same_reading(original, moved)
    (tmp_path / "archive" / "r.html").unlink()

    # resuming the copy writes into the copy only
    resumed = hpc("submit", "--cluster", "local", "--run-dir", str(copy), "--steps", "5", *LOCAL_JOB, "--wait")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert resumed.stderr.splitlines()[0] == (
        f"run directory {copy} has a checkpoint at step 3: the job resumes from step 3 and trains to step 5"
    )
    assert [json.loads(line)["step"] for line in (copy / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert _tree(original) == pristine  # byte for byte
    assert json.loads((copy / "job.json").read_text())["run_dir"] == str(copy)
    assert json.loads((copy / "job.json").read_text())["logs_dir"] == "logs"


# ----------------------------------------------------------------------------- hpc-hsdp run (a rendered script under plain sbatch, torchrun)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_hpc_hsdp_run_refuses_a_directory_another_job_writes_and_a_requeued_attempt_is_its_claimant(tmp_path):
    from dist_helpers import job_envs

    from hpc_hsdp.rundir.lifecycle.claim import write_claim

    run = tmp_path / "run"
    _local_job(run, "556", pid=os.getpid())  # an emulated job still running (its supervisor: this process)
    write_claim(run, "claimed", job_id="556", cluster="local", logs_dir="logs")
    env = {**job_envs(tasks_per_node=[1], job_id="777")[0], "OMP_NUM_THREADS": "1"}
    task = ["run", "--shard", "1", "--run-dir", str(run), "--device", "cpu", "--steps", "2", *TINY[:-2]]
    refused = hpc(*task, env=env, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.splitlines() == [
        f"hpc-hsdp: error: job 556 is still RUNNING in run directory {run}: nothing started; wait for it, cancel it "
        f"(hpc-hsdp cancel {run}) or choose a new --run-dir"
    ]
    assert not (run / "metrics.jsonl").exists()

    # job 777 itself (a requeued attempt, its claim released when it was seen to end): the same claimant
    write_claim(run, "released", job_id="777", cluster="slurm", logs_dir="logs", ended="PREEMPTED")
    ran = hpc(*task, env=env, timeout=240)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "claim" not in ran.stderr
    claim = json.loads((run / "claim.json").read_text())
    assert (claim["state"], claim["job_id"]) == ("claimed", "777")
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]

    # torchrun outside any job claims the directory for its process and releases it as it ends; the claim
    # was job 777's (whose state nobody can tell here: taken over, said so)
    bare = {k: v for k, v in env.items() if not k.startswith(("SLURM_", "MASTER_"))}
    bare.update(TORCHELASTIC_RUN_ID="t", GROUP_RANK="0", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    bare.update(WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=env["MASTER_PORT"])
    longer = hpc(*task, "--steps", "3", env=bare, timeout=240)
    assert longer.returncode == 0, longer.stdout + longer.stderr
    said = longer.stderr.splitlines()[0]  # "UNKNOWN (no SLURM here to ask)", or SLURM's UNKNOWN where it answers
    assert said.startswith(f"hpc-hsdp: run directory {run} was claimed by job 777, which is UNKNOWN"), said
    assert said.endswith(": this run takes the claim over"), said
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    claim = json.loads((run / "claim.json").read_text())
    assert (claim["state"], claim["job_id"]) == ("released", None)
