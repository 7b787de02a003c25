"""The dev cluster itself (scripts/dev-cluster), on the real daemons (marked ``slurm``, root).

The suite's SLURM tests need the cluster's nodes to themselves at start; a cluster whose
daemons were killed outright (the session or the machine died mid-run) must come back
with none of the dead run's jobs, none of its task processes, and fresh job ids."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import DEV_CLUSTER
from dist_helpers import wait_until

from tests.slurm_job_helpers import job_fields

pytestmark = pytest.mark.slurm


def _environ(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _pids_with(entry: str, *, comm: str | None = None) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        if comm is not None:
            try:
                if (proc / "comm").read_text().strip() != comm:
                    continue
            except OSError:
                continue
        if entry in _environ(int(proc.name)):
            pids.append(int(proc.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] not in ("Z", "X")
    except OSError:
        return False


def _shape_options(state_dir: str) -> list[str]:
    """The options of ``up`` that started the cluster again, from the shape it recorded
    (``nodes=3 cpus=8 ... kill_wait=5``), so the test restarts the cluster it was given."""
    pairs = (item.split("=", 1) for item in (Path(state_dir) / "shape").read_text().split())
    return [arg for key, value in pairs for arg in ("--" + key.replace("_", "-"), value)]


def test_up_after_the_daemons_were_killed_outright(slurm_cluster, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("restarting the dev cluster needs root")
    state_dir = os.environ["HPC_HSDP_DEV_CLUSTER_DIR"]
    marker = f"HPC_HSDP_TEST_MARK={tmp_path.name}"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-N2", "-o", str(tmp_path / "out"), f"--export=ALL,{marker}", "--wrap", "sleep 300"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    job_id = int(submitted.stdout.strip().split(";")[0])
    task_pids = wait_until("the job's task started", lambda: _pids_with(marker, comm="sleep"), 60)

    # What a dying session leaves: slurmctld saved the job as running, no daemon stopped cleanly.
    run = Path(state_dir) / "run"
    daemons = [int(f.read_text()) for f in [run / "slurmctld.pid", *sorted(run.glob("slurmd-*.pid"))]]
    stepds = _pids_with(f"HPC_HSDP_DEV_CLUSTER_OWNER={state_dir}", comm="slurmstepd")
    assert stepds, "no slurmstepd of the job found"
    for pid in daemons + stepds:
        os.kill(pid, signal.SIGKILL)
    wait_until("the killed daemons gone", lambda: not any(_alive(pid) for pid in daemons + stepds), 20)
    assert all(_alive(pid) for pid in task_pids), "the job's task died with its daemons: nothing left to test"

    # A local emulator task of the other test worker: same SLURM_CONF, a job id, another cluster.
    bystander = subprocess.Popen(
        ["sleep", "300"], env={**os.environ, "SLURM_JOB_ID": "1", "SLURM_CLUSTER_NAME": "local-emulator"}
    )
    try:
        up = subprocess.run(
            [str(DEV_CLUSTER), "up", *_shape_options(state_dir)], capture_output=True, text=True, timeout=240
        )
        assert up.returncode == 0, up.stdout + up.stderr
        assert bystander.poll() is None, "the restart killed a process that was not a task of its jobs"
    finally:
        bystander.kill()
        bystander.wait()

    assert subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.strip() == ""
    assert job_fields(str(job_id)) == {}
    assert not [pid for pid in task_pids if _alive(pid)], "the dead job's task outlived the restart"
    states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True).stdout.split()
    assert states and set(states) == {"idle"}, states
    after = subprocess.run(
        ["sbatch", "--parsable", "-o", "/dev/null", "--wrap", "true"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert int(after.stdout.strip().split(";")[0]) > job_id
