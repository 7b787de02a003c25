"""The processes that stand in for SLURM's daemons: one job's supervisor (runs its batch script,
records its state, cancels it as ``scancel`` would, frees its run directory) and a job array's
runner (starts its points in order, at most so many at once)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpc_hsdp.files import open_for_writing, read_capped
from hpc_hsdp.rundir.lifecycle.claim import release_claim
from hpc_hsdp.scheduler.emulator.emulated_job import LocalJob
from hpc_hsdp.scheduler.emulator.launch import start_local
from hpc_hsdp.scheduler.emulator.processes import process_start_time
from hpc_hsdp.scheduler.emulator.slurm_patterns import expand_pattern, sbatch_value
from hpc_hsdp.scheduler.emulator.state_files import (
    MAX_SPOOLED_SCRIPT_BYTES,
    read_job_state,
    read_launch,
    read_state,
    spool_path,
    write_state,
)

CANCEL_KILL_WAIT_S = 30
"""Seconds a cancelled job's tasks get between SIGTERM and SIGKILL: SLURM's default KillWait, in
which every rank agrees to stop, saves and ends, as under ``scancel``."""


def supervise(state_file: str) -> int:
    path = Path(state_file)
    state = read_state(path)
    if state.get("state") != "PENDING":  # a job array's point cancelled just as it was started
        return 0
    try:
        launch = read_launch(path)
    except (OSError, ValueError) as exc:
        print(f"hpc-hsdp: the emulator's record of how this job starts cannot be read ({exc})", file=sys.stderr)
        state.update(state="FAILED", exit_code=2, ended_at=time.time())
        write_state(path, state)
        return 2
    spooled = spool_path(path)
    try:
        script = read_capped(spooled, max_bytes=MAX_SPOOLED_SCRIPT_BYTES).decode("utf-8")
    except (OSError, ValueError) as exc:
        print(f"hpc-hsdp: the emulator's copy of this job's script cannot be read ({exc})", file=sys.stderr)
        state.update(state="FAILED", exit_code=2, ended_at=time.time())
        write_state(path, state)
        if launch.get("run_dir"):
            release_claim(launch["run_dir"], launch["job_id"], ended=state["state"])
        return 2
    job_id = launch["job_id"]
    array_env = launch.get("array_env") or {}
    job_id = array_env.get("SLURM_JOB_ID", job_id)
    expand = functools.partial(
        expand_pattern,
        job_id=job_id,
        array_job=array_env.get("SLURM_ARRAY_JOB_ID"),
        array_task=array_env.get("SLURM_ARRAY_TASK_ID"),
    )
    out = expand(sbatch_value(script, "output") or f"slurm-{job_id}.out")
    err = expand(sbatch_value(script, "error") or out)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    state.update(
        state="RUNNING",
        started_at=time.time(),
        supervisor_pid=os.getpid(),
        supervisor_started=process_start_time(os.getpid()),
    )
    write_state(path, state)
    cancelled = False
    with open_for_writing(out, append=True) as stdout, open_for_writing(err, append=True) as stderr:
        batch = subprocess.Popen(
            ["bash", str(spooled)], stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True
        )

        def on_cancel(signum, frame):
            nonlocal cancelled
            cancelled = True
            _signal_group(batch.pid, signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_cancel)
        signal.signal(signal.SIGINT, on_cancel)
        deadline = None
        while True:
            try:
                code = batch.wait(timeout=1)
                break
            except subprocess.TimeoutExpired:
                if cancelled:
                    deadline = deadline or time.monotonic() + CANCEL_KILL_WAIT_S
                    if time.monotonic() > deadline:
                        _signal_group(batch.pid, signal.SIGKILL)
        if cancelled:  # the batch shell dies of SIGTERM at once; the tasks still save, as under slurmd's KillWait
            deadline = deadline or time.monotonic() + CANCEL_KILL_WAIT_S
            while _group_alive(batch.pid) and time.monotonic() < deadline:
                time.sleep(0.2)
        _signal_group(batch.pid, signal.SIGKILL)  # leftovers of the step, as slurmd would
    state.update(
        state="CANCELLED" if cancelled else ("COMPLETED" if code == 0 else "FAILED"),
        exit_code=code,
        ended_at=time.time(),
    )
    write_state(path, state)
    spooled.unlink(missing_ok=True)
    if launch.get("run_dir"):  # as SLURM ends a job: the run directory is free again
        release_claim(launch["run_dir"], launch["job_id"], ended=state["state"])
    return 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


ARRAY_POLL_S = 0.5


def run_array(runner_state: str) -> int:
    """The emulator's scheduler of one job array: starts its PENDING points in order, at most
    ``parallelism`` running at once, until none is left pending (a cancelled one is skipped)."""
    data = read_state(runner_state)
    paths = [Path(p) for p in data["points"]]
    limit = data.get("parallelism") or len(paths)
    while True:
        infos = []
        for path in paths:
            try:
                job_id = str(read_job_state(path)["job_id"])
            except (OSError, ValueError, KeyError):  # a point's state file broken by someone: it is not started
                continue
            infos.append((path, LocalJob(logs_dir=path.parent, job_id=job_id).info()))
        waiting = [path for path, info in infos if info["state"] == "PENDING" and not info.get("supervisor_pid")]
        running = sum(1 for _, info in infos if info["state"] in ("PENDING", "RUNNING") and info.get("supervisor_pid"))
        if not waiting:
            return 0
        for path in waiting[: max(0, limit - running)]:
            start_local(path)
        time.sleep(ARRAY_POLL_S)
