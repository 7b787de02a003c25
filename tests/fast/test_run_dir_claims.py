"""One writer per run directory (issue 27), its claims alone: a claim left by a job or a
submission that ended is taken over and said so, a live one refuses; a requeued attempt is the
same claimant, a damaged claim is none."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from hpc_hsdp.errors import SpecError
from tests.claims_helpers import _local_job, _tree

# ----------------------------------------------------------------------------- one writer


def _spec(run: Path, tmp_path: Path):
    from hpc_hsdp.cli.job_options import job_spec_from_options

    return job_spec_from_options(
        {"shard_size": 1, "nodes": 1, "gpus_per_node": 1, "run_dir": str(run), "training_steps": 6},
        cwd=tmp_path,
        default_venv=None,
    )


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_stale_claim_is_taken_over_and_said_so_a_live_one_refuses(tmp_path):
    from hpc_hsdp.rundir.lifecycle.claim import read_claim, write_claim
    from hpc_hsdp.submit_host.claims import check_run_dir, claimed

    run = tmp_path / "run"
    spec = _spec(run, tmp_path)
    # a claim of an emulated job whose supervisor died without a word (FAILED to the emulator)
    _local_job(run, "555", pid=_dead_pid())
    write_claim(run, "claimed", job_id="555", cluster="local", logs_dir="logs")
    assert check_run_dir(spec) == (
        f"run directory {run} was claimed by job 555, which is FAILED: this submission takes the claim over"
    )
    # the same under the submission's own lock: taken over at once (its release does not wait for the lock)
    write_claim(run, "claimed", job_id="555", cluster="local", logs_dir="logs")
    start = time.monotonic()
    with claimed(run, cluster="local") as (said, _):
        assert (
            said == f"run directory {run} was claimed by job 555, which is FAILED: this submission takes the claim over"
        )
        assert read_claim(run)["state"] == "submitting"
    assert time.monotonic() - start < 2
    # a submission that died before it had a job id
    write_claim(run, "submitting", cluster="local")
    assert check_run_dir(spec) == (
        f"run directory {run} was claimed by a submission (pid {os.getpid()} on {read_claim(run)['host']}) that "
        f"did not finish: this submission takes the claim over"
    )
    # a live one (an emulated job whose supervisor is this very process) refuses, naming the job
    _local_job(run, "556", pid=os.getpid())
    write_claim(run, "claimed", job_id="556", cluster="local", logs_dir="logs")
    (run / "claim.lock").touch()  # as a submission leaves it (never removed: another may wait on it)
    before = _tree(run)
    refused = f"^job 556 is still RUNNING in run directory {run}: nothing submitted"
    with pytest.raises(SpecError, match=refused), claimed(run, cluster="local"):
        pytest.fail("claimed a directory a running job holds")
    assert _tree(run) == before  # nothing written

    # a submission that fails after it claimed puts the claim back as it was; a directory made for it goes
    _local_job(run, "556", pid=os.getpid(), state="COMPLETED")
    write_claim(run, "released", job_id="556", cluster="local", logs_dir="logs", ended="COMPLETED")
    before = (run / "claim.json").read_bytes()
    with pytest.raises(RuntimeError, match="sbatch said no"), claimed(run, cluster="local") as (said, _):
        assert said is None and read_claim(run)["state"] == "submitting"
        raise RuntimeError("sbatch said no")
    assert (run / "claim.json").read_bytes() == before
    fresh = tmp_path / "a" / "b" / "fresh"
    with pytest.raises(RuntimeError), claimed(fresh, cluster="local"):
        raise RuntimeError("refused")
    assert not (tmp_path / "a").exists()


def test_a_refused_submission_that_made_the_directory_leaves_the_winners_claim(tmp_path, monkeypatch):
    """Two racers: the loser made the directory, the winner claimed it first. The loser's
    refusal removes nothing (its clean-up once took the winner's claim.json with it)."""
    from hpc_hsdp.rundir.lifecycle.claim import write_claim
    from hpc_hsdp.submit_host import claims as job_claims
    from hpc_hsdp.submit_host.claims import claimed

    run = tmp_path / "run"

    def made_here_then_won_by_another(path):
        path.mkdir()
        _local_job(path, "557", pid=os.getpid())
        write_claim(path, "claimed", job_id="557", cluster="local", logs_dir="logs")
        return [path]

    monkeypatch.setattr(job_claims, "_make_dirs", made_here_then_won_by_another)
    with pytest.raises(SpecError, match="^job 557 is still RUNNING"), claimed(run, cluster="local"):
        pytest.fail("claimed a directory a running job holds")
    assert {"claim.json", "claim.lock", "logs"} <= set(os.listdir(run))


def test_a_requeued_attempt_is_the_same_claimant_and_a_damaged_claim_is_none(tmp_path):
    """The job a claim names holds the directory whatever attempt of it runs: a resubmission
    is refused while it is pending again (its claim and job.json agree); garbage is no claim."""
    from hpc_hsdp.rundir.lifecycle.claim import read_claim
    from hpc_hsdp.submit_host.claims import check_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "claim.json").write_text('{"state": "claimed", "job_id": 7}')
    assert read_claim(run) is None
    (run / "claim.json").write_text("x" * 100_000)
    assert read_claim(run) is None
    assert check_run_dir(_spec(run, tmp_path)) is None


# ----------------------------------------------------------------------------- the directory is the run
