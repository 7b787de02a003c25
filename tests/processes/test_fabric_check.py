"""The fabric check for real on the local emulator: the rendered script's check step (one task per
GPU on every node, gloo), the verdict in the batch shell, and the training step on the nodes it
chose; one node slowed from outside (its processes stopped most of the time) during the check."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import hpc
from throttle import Throttle, check_figures, trained_nodes

from hpc_hsdp.cli.job_options import job_spec_from_options
from hpc_hsdp.cli.render_cmd import render
from hpc_hsdp.scheduler.emulator.allocation import allocation_for
from hpc_hsdp.scheduler.emulator.launch import launch_local
from hpc_hsdp.submit_host.render import render_sbatch
from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

# the throttled node runs about 5% of the time (20x slower); a healthy one on this shared 2-core
# machine swings by up to ~3x, so the threshold sits between with room on both sides
THRESHOLD = "0.25"
CHECKED_JOB = tiny_job(
    width=16, heads=2, batch_size=None, vocab_size=None, global_batch_size=8, steps=3, straggler_every=0, device="cpu"
)


def _spec(run_dir: Path, *extra: str):
    argv = [
        *("--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--check", "--check-threshold", THRESHOLD),
        *CHECKED_JOB,
        *("--run-dir", str(run_dir), "--venv", "none", "--python", sys.executable),
        *extra,
    ]
    params = render.make_context("render", argv).params
    return job_spec_from_options(params, environ={}, cwd=run_dir.parent, default_venv=None)


def _launch(spec):
    nodes = spec.nodes + spec.spare_nodes
    (Path(spec.run.run_dir) / "logs").mkdir(parents=True, exist_ok=True)
    return launch_local(
        render_sbatch(spec),
        alloc=allocation_for(tasks_per_node=(spec.gpus_per_node,) * nodes, gpus_per_node=2, job_name="check"),
        logs_dir=Path(spec.log_dir),
    )


def test_a_node_slowed_during_the_check_is_left_out_and_a_spare_trains_in_its_place(tmp_path: Path) -> None:
    """Submitted as a person would (hpc-hsdp submit on the emulator), n2 throttled from outside."""
    run_dir = tmp_path / "run"
    argv = [
        *("--cluster", "local", "--nodes", "2", "--spare-nodes", "1", "--gpus-per-node", "2", "--shard", "2"),
        *("--check", "--check-threshold", THRESHOLD, *CHECKED_JOB, "--run-dir", str(run_dir)),
    ]
    out = hpc("submit", *argv)
    assert out.returncode == 0, out.stderr
    job_id = json.loads((run_dir / "job.json").read_text())["job_id"]
    try:
        with Throttle(job_id, "n2", stopped=0.95, needle=b"fabric_check") as throttled:
            deadline = time.monotonic() + 180
            while not (run_dir / "check.json").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            state = json.loads(hpc("status", str(run_dir), "--json").stdout)["state"]
            if state not in ("PENDING", "RUNNING"):
                break
            time.sleep(1)
    finally:
        hpc("cancel", str(run_dir), "--no-wait")
    assert state == "COMPLETED", hpc("logs", str(run_dir), "--tail", "20").stdout
    check = json.loads((run_dir / "check.json").read_text())
    assert check["bad_nodes"] == ["n2"], (check_figures(check), throttled.report())
    assert any(f["name"] == "n2" and f["kind"] == "node" for f in check["findings"])
    assert sorted(check["nodes"]) == ["n1", "n2", "n3"] and check["threshold"] == float(THRESHOLD)
    decision = json.loads((run_dir / "checks.jsonl").read_text().splitlines()[-1])
    assert decision["action"] == "train" and decision["excluded"] == ["n2"] and decision["spares_used"] == ["n3"]
    assert trained_nodes(run_dir) == ["n1", "n3"]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    shown = hpc("status", str(run_dir))
    assert "check: n2 left out, spare n3 in its place" in shown.stdout, shown.stdout + shown.stderr


def test_a_healthy_allocation_trains_on_its_own_nodes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    job = _launch(_spec(run_dir, "--spare-nodes", "1"))
    try:
        state = job.wait(timeout_s=240)
    finally:
        job.cancel()
    assert state == "COMPLETED"
    check = json.loads((run_dir / "check.json").read_text())
    assert check["bad_nodes"] == [] and len(check["links"]) == 3, check_figures(check)
    decision = json.loads((run_dir / "checks.jsonl").read_text().splitlines()[-1])
    assert decision["spares_used"] == [] and decision["nodes"] == ["n1", "n2"]
    assert trained_nodes(run_dir) == ["n1", "n2"]


def test_check_command_measures_its_own_job_and_prints_the_table(tmp_path: Path) -> None:
    """hpc-hsdp check: a job of its own on 4 emulated nodes, the table, exit 0 when none is slow."""
    run_dir = tmp_path / "check"
    out = hpc(
        "check", "--cluster", "local", "--nodes", "4", "--gpus-per-node", "1", "--device", "cpu",
        "--check-threshold", "0.2", "--run-dir", str(run_dir),
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    for node in ("n1", "n2", "n3", "n4"):
        assert any(line.startswith(node + " ") for line in out.stdout.splitlines()), out.stdout
    for link in ("n1-n2", "n3-n4", "n2-n3", "n4-n1"):  # two rounds of disjoint pairs
        assert link in out.stdout
    assert "4 node(s), 4 link(s)" in out.stdout and "no node below its peers" in out.stdout
    check = json.loads((run_dir / "check.json").read_text())
    assert check["rounds"] == [["n1-n2", "n3-n4"], ["n2-n3", "n4-n1"]] and check["backend"] == "gloo"
    assert not (run_dir / "metrics.jsonl").exists()  # it trained nothing
