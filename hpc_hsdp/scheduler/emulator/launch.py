"""Starting emulated jobs: a job's PENDING state file, its script and its ``srun`` shim written,
then its supervisor started detached with the job-level variables of a real allocation; a job
array's points, and the runner that starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_hsdp.files import open_for_writing, write_atomically
from hpc_hsdp.scheduler.emulator.allocation import LocalAllocation, job_environment
from hpc_hsdp.scheduler.emulator.emulated_job import LocalJob
from hpc_hsdp.scheduler.emulator.ports import reserve_port
from hpc_hsdp.scheduler.emulator.processes import SUPERVISOR_MARK, process_start_time
from hpc_hsdp.scheduler.emulator.state_files import (
    LAUNCH_KEYS,
    emulator_private_dir,
    emulator_state_dir,
    new_job_id,
    read_launch,
    read_state,
    spool_path,
    spooled_launch_path,
    state_path,
    write_state,
)

EMULATOR_MODULE = "hpc_hsdp.scheduler.emulator"
"""What the emulator's processes run (``python -m``): its srun, a job's supervisor, an array's runner."""


def launch_local(
    script: str,
    *,
    alloc: LocalAllocation,
    logs_dir: Path,
    job_id: str | None = None,
    submit_dir: str | None = None,
    run_dir: str | Path | None = None,
) -> LocalJob:
    """Start the supervisor of one emulated job and return its handle at once. ``run_dir``: the
    run directory the job writes, whose claim the supervisor releases when the job ends."""
    path = prepare_local(script, alloc=alloc, logs_dir=logs_dir, job_id=job_id, submit_dir=submit_dir, run_dir=run_dir)
    start_local(path)
    return LocalJob(logs_dir=path.parent, job_id=read_state(path)["job_id"])


def prepare_local(
    script: str,
    *,
    alloc: LocalAllocation,
    logs_dir: Path,
    job_id: str | None = None,
    submit_dir: str | None = None,
    run_dir: str | Path | None = None,
    array_env: dict[str, str] | None = None,
    array_runner: str | None = None,
) -> Path:
    """Write a PENDING emulated job (its script, its srun, its state file); its state file.
    ``array_env``: the variables SLURM gives a job array's task (a sweep's point)."""
    logs_dir = Path(logs_dir).resolve()
    logs_dir.mkdir(parents=True, exist_ok=True)
    job_id = job_id or new_job_id()
    # the job's state, the srun it runs and the port reservations: nobody else may change them
    emulator_private_dir(logs_dir, mode=0o777)  # its permissions are the user's; its owner must be too
    shim_dir = emulator_private_dir(logs_dir / ".emulator-bin")
    emulator_private_dir(emulator_state_dir())  # refused here, before anything of the job is written
    shim = shim_dir / "srun"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable!s} -m {EMULATOR_MODULE} srun "$@"\n')
    shim.chmod(0o755)
    script_path = logs_dir / f"{job_id}_submission.sh"
    write_atomically(script_path, script)
    state = {
        "job_id": job_id,
        "state": "PENDING",
        "exit_code": None,
        "submitted_at": time.time(),
        "started_at": None,
        "ended_at": None,
        "supervisor_pid": None,
        "script": str(script_path),
        "logs_dir": str(logs_dir),  # where the job writes: the emulator's own record (a copied run directory differs)
        "run_dir": None if run_dir is None else str(Path(run_dir).absolute()),
        "tasks_per_node": list(alloc.tasks_per_node),
        "node_names": list(alloc.node_names),
        "gpus_per_node": alloc.gpus_per_node,
        "job_name": alloc.job_name,
        "submit_dir": submit_dir or os.getcwd(),
        "array_env": dict(array_env or {}),
        "array_runner": array_runner,  # a job array's point: the state file of the runner that starts it
    }
    path = state_path(logs_dir, job_id)
    emulator_private_dir(spool_path(path).parent)
    write_atomically(spool_path(path), script, private=True)
    launch = {key: state[key] for key in LAUNCH_KEYS}
    write_atomically(spooled_launch_path(path), json.dumps(launch), private=True)
    write_state(path, state)
    return path


def start_local(path: Path) -> bool:
    """Start the supervisor of the PENDING emulated job of state file ``path``; False when it is no
    longer pending (cancelled before it started)."""
    state = read_state(path)
    if state.get("state") != "PENDING" or state.get("supervisor_pid"):
        return False
    state = {**state, **read_launch(path)}
    job_id, logs_dir = state["job_id"], Path(path).parent
    alloc = LocalAllocation(
        tasks_per_node=tuple(state["tasks_per_node"]),
        node_names=tuple(state["node_names"]),
        job_name=state.get("job_name") or "job",
        gpus_per_node=int(state.get("gpus_per_node") or 0),
    )
    port = reserve_port(job_id, path)
    submit_dir = state.get("submit_dir") or os.getcwd()
    env = job_environment(alloc, job_id=job_id, submit_dir=submit_dir, shim_dir=logs_dir / ".emulator-bin", port=port)
    array_env = state.get("array_env") or {}
    env.update({str(k): str(v) for k, v in array_env.items()})
    env[SUPERVISOR_MARK] = str(path)  # what cancel checks: this process is this job's supervisor
    proc = subprocess.Popen(
        [sys.executable, "-m", EMULATOR_MODULE, "supervise", str(path)],
        env=env,
        cwd=submit_dir,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open_for_writing(logs_dir / f"{job_id}_supervisor.log", append=True),
    )
    # the supervisor rewrites the file when it starts; keep the pid if it has not yet
    current = read_state(path)
    if current.get("supervisor_pid") is None:
        current["supervisor_pid"], current["supervisor_started"] = proc.pid, process_start_time(proc.pid)
        write_state(path, current)
    return True


@dataclass(frozen=True, kw_only=True)
class ArrayPoint:
    """One point of an emulated job array: its task index, the allocation it gets, where it writes."""

    index: int
    alloc: LocalAllocation
    logs_dir: Path
    run_dir: str | Path | None = None


def launch_array(script: str, points: Sequence[ArrayPoint], *, parallelism: int | None, array_dir: Path) -> str:
    """A job array on the emulator: every point a PENDING emulated job (``<array>_<i>``, in its
    own logs folder, with the variables SLURM gives an array task), and a detached runner that
    starts them in order, at most ``parallelism`` at once. The array's id."""
    indices = [point.index for point in points]
    array_id = new_job_id(tasks=1 + max(indices))  # its tasks' SLURM_JOB_IDs follow it
    paths = []
    array_dir = emulator_private_dir(Path(array_dir).resolve(), mode=0o777)
    runner_state = array_dir / f"{array_id}_array_local.json"
    for point in points:
        array_env = {
            "SLURM_ARRAY_JOB_ID": array_id,
            "SLURM_ARRAY_TASK_ID": str(point.index),
            "SLURM_ARRAY_TASK_COUNT": str(len(indices)),
            "SLURM_ARRAY_TASK_MIN": str(min(indices)),
            "SLURM_ARRAY_TASK_MAX": str(max(indices)),
            # SLURM gives each task a job id of its own
            "SLURM_JOB_ID": str(int(array_id) + 1 + point.index),
            "SLURM_JOBID": str(int(array_id) + 1 + point.index),
        }
        path = prepare_local(
            script,
            alloc=point.alloc,
            logs_dir=point.logs_dir,
            job_id=f"{array_id}_{point.index}",
            run_dir=point.run_dir,
            array_env=array_env,
            array_runner=str(runner_state),
        )
        paths.append(str(path))
    write_state(runner_state, {"job_id": array_id, "points": paths, "parallelism": parallelism})
    runner = subprocess.Popen(
        [sys.executable, "-m", EMULATOR_MODULE, "array", str(runner_state)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open_for_writing(array_dir / f"{array_id}_array_runner.log", append=True),
    )
    runner_info = {"runner_pid": runner.pid, "runner_started": process_start_time(runner.pid)}
    write_state(runner_state, {**read_state(runner_state), **runner_info})
    return array_id
