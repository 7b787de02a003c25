"""Re-submission on the local emulator (issue 13): into a completed run directory one line and
nothing submitted; with more steps the run resumes."""

from __future__ import annotations

import json

import pytest
from cli_helpers import hpc

from tests.job_helpers import tiny_job

# ----------------------------------------------------------------------------- run directories

TINY = tiny_job(venv="none")


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_submitting_again_a_completed_run_says_so_and_a_longer_one_resumes(tmp_path, local_submit):
    run = tmp_path / "run"
    job = local_submit(run, *TINY)
    first = hpc(*job, "--steps", "3", "--wait")
    assert first.returncode == 0, first.stdout + first.stderr
    job_json = (run / "job.json").read_text()

    again = hpc(*job, "--steps", "3", "--wait")
    assert again.returncode == 2 and again.stdout == "", again.stdout + again.stderr
    assert again.stderr.splitlines() == [
        f"hpc-hsdp: error: run directory {run} already completed step 3 (--steps 3): nothing to train, nothing "
        f"submitted; extend the run with --steps N (N > 3) or choose a new --run-dir"
    ]
    assert (run / "job.json").read_text() == job_json  # nothing submitted

    reseeded = hpc(*job, "--steps", "5", "--seed", "7", "--wait")  # the tasks would refuse to continue: so does submit
    assert reseeded.returncode == 2 and reseeded.stdout == "", reseeded.stdout + reseeded.stderr
    assert reseeded.stderr.splitlines()[-1].startswith(
        "hpc-hsdp: error: checkpoint step-000003 (step 3) was trained with --seed 0, this run has --seed 7; the data "
        "order follows the seed: resume with --seed 0; nothing submitted"
    )
    assert (run / "job.json").read_text() == job_json

    longer = hpc(*job, "--steps", "5", "--wait")
    assert longer.returncode == 0, longer.stdout + longer.stderr
    said = longer.stderr.splitlines()
    assert (
        said[0] == f"run directory {run} has a checkpoint at step 3: the job resumes from step 3 and trains to step 5"
    )
    assert "submitted job" in longer.stdout
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]
    assert "resumed from step 3" in "".join(p.read_text() for p in (run / "logs").glob("*_log.out"))
