"""``hpc-hsdp stacks`` and ``hpc-hsdp debug`` of a running 2-node job on the real dev SLURM cluster:
the nodes reached through ``srun --overlap --jobid`` (a step of the job itself), a frozen rank named
as the odd one out, one rank's pdb attached through an interactive overlapping step."""

from __future__ import annotations

import json
import time

import pytest
from cluster_helpers import hpc

from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

TINY = tiny_job(device="cpu")


def submit(run, *args, env=None):
    argv = ["submit", "--cluster", "slurm", "--nodes", "2", "--gpus-per-node", "2", "--shard", "2"]
    sub = hpc(*argv, "--run-dir", str(run), *TINY, *args, env=env)
    assert sub.returncode == 0, sub.stderr
    deadline = time.monotonic() + 150
    while not (run / "metrics.jsonl").exists():
        assert time.monotonic() < deadline, hpc("logs", str(run)).stdout[-3000:]
        time.sleep(1)


def state(run) -> str:
    return json.loads(hpc("status", str(run), "--json").stdout)["state"]


def test_stacks_of_a_running_two_node_job_name_the_frozen_rank(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    submit(run, "--steps", "1000", "--hang-timeout", "600", env={"HPC_HSDP_FAULT_FREEZE_AT": "1:3"})
    try:
        deadline = time.monotonic() + 90
        while True:
            shown = hpc("stacks", str(run), "--json", timeout=120)
            assert shown.returncode == 0, shown.stderr
            answer = json.loads(shown.stdout)
            groups = answer["groups"]
            if "at_step" in groups[0].get("headline", "") or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert groups[0]["ranks"] == [1], groups
        assert sorted(r for g in groups[1:] for r in g["ranks"]) == [0, 2, 3]
        assert {s["node"] for s in answer["stacks"]} == {"n1", "n2"}  # both nodes answered, each for its own
        assert all(s["threads"] for s in answer["stacks"]), answer["stacks"]
        text = hpc("stacks", str(run), "--python-only", timeout=120)
        assert text.returncode == 0, text.stderr
        assert text.stdout.startswith("rank 1 (1 of 4): at_step in hpc_hsdp/task/resilience/injected_faults.py:"), (
            text.stdout
        )
        assert state(run) == "RUNNING"
    finally:
        hpc("cancel", str(run), "--no-wait")


def test_debug_attaches_through_an_overlapping_step_and_continue_goes_on(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    submit(run, "--steps", "100000", env={"HPC_HSDP_FAULT_STEP_DELAY_S": "0.1"})
    try:
        debugged = hpc("debug", str(run), "--rank", "3", input="p 6 * 7\nc\n", timeout=200)
        assert debugged.returncode == 0, debugged.stderr
        assert "(Pdb rank 3) 42\n" in debugged.stdout, debugged.stdout + debugged.stderr
        session = json.loads((run / "debug" / "session.json").read_text())
        node_of_rank3 = json.loads((run / "layout.json").read_text())["ranks"][3]["node"]
        assert session["node"] == node_of_rank3 and session["state"] == "continue"
        before = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        deadline = time.monotonic() + 60
        while json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] < before + 3:
            assert time.monotonic() < deadline, "the job did not go on after continue"
            time.sleep(0.5)
        assert state(run) == "RUNNING"
    finally:
        cancelled = hpc("cancel", str(run))
    assert cancelled.returncode == 0, cancelled.stderr
