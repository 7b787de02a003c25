"""Against the real dev SLURM cluster: a frozen slurmctld (SIGSTOP) while ``submit``, ``status``
and ``runs`` are called, and a job whose derived rendezvous port another process holds (issue 29).

The freeze always ends (SIGCONT in ``finally``), whatever the test found.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from cluster_helpers import hpc

from hpc_hsdp.scheduler.backends.slurm_command import config_value, controller_host, slurm_config
from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

TINY = tiny_job(vocab_size=None, device="cpu")
TIMEOUT_S = 3


def timed(*args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    out = hpc(*args, env=env, timeout=120)
    return out, time.monotonic() - start


@contextmanager
def frozen_controller():
    """slurmctld stopped (SIGSTOP) for the duration; continued (SIGCONT) however the block ends."""
    pid_file = config_value(slurm_config(), "SlurmctldPidFile")
    assert pid_file, "the dev cluster's slurm.conf names no SlurmctldPidFile"
    pid = int(Path(pid_file).read_text().split()[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
            if " is UP" in ping.stdout:
                break
            time.sleep(0.5)


def test_a_frozen_controller_refuses_submit_and_bounds_status_and_runs(slurm_cluster, tmp_path):
    env = {"HPC_HSDP_SLURM_TIMEOUT": str(TIMEOUT_S)}
    host = controller_host(slurm_config())
    runs = tmp_path / "runs"
    live = runs / "live"
    out = hpc(
        "submit",
        "--cluster",
        "slurm",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--steps",
        "400",
        "--run-dir",
        str(live),
        *TINY,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = re.search(r"submitted job (\d+)", out.stdout).group(1)
    try:
        deadline = time.monotonic() + 60
        while True:  # a state SLURM told while it answered: RUNNING
            seen = json.loads(hpc("status", str(live), "--json", env=env).stdout)
            if seen["state"] == "RUNNING" or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert seen["state"] == "RUNNING" and seen["controller_answered"] is True, seen
        with frozen_controller():
            refused = tmp_path / "refused"
            sub, sub_s = timed(
                "submit",
                "--nodes",
                "1",
                "--gpus-per-node",
                "2",
                "--shard",
                "2",
                "--run-dir",
                str(refused),
                *TINY,
                env=env,
            )
            status, status_s = timed("status", str(live), "--json", env=env)
            human, _ = timed("status", str(live), env=env)
            listing, runs_s = timed("runs", str(runs), env=env)
        print(
            f"frozen slurmctld, HPC_HSDP_SLURM_TIMEOUT={TIMEOUT_S}: submit refused in {sub_s:.1f} s, "
            f"status --json {status_s:.1f} s, runs {runs_s:.1f} s"
        )
        assert sub.returncode == 2, sub.stdout + sub.stderr
        assert sub.stderr.strip().splitlines() == [
            f"hpc-hsdp: error: the SLURM controller {host} did not answer within {TIMEOUT_S} s; nothing submitted: "
            f"try again, or --cluster local to run on this machine"
        ]
        assert not refused.exists() and "running on the local emulator" not in sub.stdout + sub.stderr
        assert sub_s < TIMEOUT_S + 6

        assert status.returncode == 0, status.stderr
        data = json.loads(status.stdout)
        assert data["controller_answered"] is False and data["last_known_state"] == "RUNNING", data
        assert data["state"] == "RUNNING" and data["last_known_age_s"] is not None
        assert data["scheduler_note"].startswith(f"the SLURM controller {host} did not answer squeue within")
        assert status_s < 2 * TIMEOUT_S + 6  # squeue (timed out) and sacct (slurmdbd answers): nothing more
        assert f"scheduler: the SLURM controller {host} did not answer" in human.stdout

        assert listing.returncode == 0, listing.stderr
        assert f"scheduler: the SLURM controller {host} did not answer squeue" in listing.stdout
        assert "RUNNING (last known" in listing.stdout
        assert runs_s < 2 * TIMEOUT_S + 6

        after = json.loads(hpc("status", str(live), "--json", env=env).stdout)
        assert after["controller_answered"] is True and after["scheduler_note"] is None, after
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def test_runs_asks_the_cluster_once_for_many_job_ids(slurm_cluster, tmp_path):
    """1,000 run directories of jobs this cluster never had (ids far beyond its own): one squeue and
    one sacct answer for all of them, well within the timeout."""
    for k in range(1000):
        run = tmp_path / f"run-{k:04d}"
        run.mkdir()
        record = {
            "job_id": str(90_000_000 + k),
            "cluster": "slurm",
            "run_dir": str(run),
            "logs_dir": str(run / "logs"),
            "job_name": "t",
            "ntasks": 1,
            "launcher": "srun",
            "submitted_at": 0.0,
        }
        (run / "job.json").write_text(json.dumps(record))
    listing, took = timed("runs", str(tmp_path))
    print(f"runs over 1,000 run directories against the dev cluster: {took:.2f} s (CLI start included)")
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert len(lines) == 1001 and sum(" UNKNOWN" in line for line in lines) == 1000, lines[:3]
    assert "scheduler:" not in listing.stdout
    assert took < 10


def test_a_held_rendezvous_port_is_no_failed_job(slurm_cluster, tmp_path):
    """The next job's derived port (20000 + id mod 10000) is held by a listening socket on this
    machine, where every dev-cluster node lives: the batch script takes the first fallback port."""
    for _ in range(3):
        probe = subprocess.run(
            ["sbatch", "--parsable", "--wrap", "true", "-o", "/dev/null"], capture_output=True, text=True, timeout=30
        )
        assert probe.returncode == 0, probe.stderr
        next_id = int(probe.stdout.strip().split(";")[0]) + 1
        derived = 20000 + next_id % 10000
        with socket.socket() as held:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind(("0.0.0.0", derived))
            held.listen()
            run = tmp_path / f"run-{next_id}"
            out = hpc(
                "submit",
                "--cluster",
                "slurm",
                "--nodes",
                "2",
                "--gpus-per-node",
                "2",
                "--shard",
                "2",
                "--steps",
                "2",
                "--wait",
                "--run-dir",
                str(run),
                *TINY,
            )
        job_id = re.search(r"submitted job (\d+)", out.stdout)
        if job_id and int(job_id.group(1)) != next_id:
            continue  # another job took that id in between: try again
        assert out.returncode == 0, out.stdout + out.stderr
        assert "COMPLETED" in out.stderr
        batch_log = next((run / "logs").glob(f"{next_id}_0_log.out")).read_text()
        said = re.search(r"rendezvous at \S+:(\d+)", batch_log)
        assert said and int(said.group(1)) == derived - 10000, batch_log[-2000:]  # the first fallback
        return
    pytest.fail("three times another job took the id this test expected")
