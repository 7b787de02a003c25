"""The local emulator: run a rendered sbatch script on this machine as SLURM would.

``launch_local`` starts a detached supervisor that runs the very script ``render``
produced under ``bash``, with the job-level variables of a real allocation and an
``srun`` of ours first on PATH. That ``srun`` starts one process per task, each with the
task-level variables a real step gives it (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURMD_NODENAME``, ... from :func:`hpc_hsdp.plan.slurm_env.task_environments`), writes
each task's output to the ``--output``/``--error`` patterns, and, like
``srun --kill-on-bad-exit``, ends the step when one task fails. Every task runs on CPU.

The supervisor records the job's state in ``<logs>/<job id>_local.json``; ``LocalJob``
reads it, so status, logs and cancel work from the run directory alone. :class:`LocalBackend`
is the emulator behind the interface every scheduler has (:mod:`hpc_hsdp.job.backends.base`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import private_dir, read_capped, read_json, user_state_dir, write_atomically
from hpc_hsdp.job.backends.base import Backend
from hpc_hsdp.job.status import JobStatus, release_if_ended
from hpc_hsdp.plan.address import FIRST_PORT_VARIABLE, hostfile_lines, pick_port, port_is_free
from hpc_hsdp.plan.float8_support import fp8_local_refusal
from hpc_hsdp.plan.slurm_env import DISTRIBUTIONS, compress_nodelist, task_environments
from hpc_hsdp.plan.topology import (
    default_node_names,
    expand_nodelist,
    format_tasks_per_node,
    parse_tasks_per_node,
    rendezvous_port,
)
from hpc_hsdp.rundir.claim import release_claim
from hpc_hsdp.rundir.job_record import JobRecord

KILL_WAIT_S = 5
CANCEL_KILL_WAIT_S = 30
"""Seconds a cancelled job's tasks get between SIGTERM and SIGKILL: SLURM's default KillWait, in
which every rank agrees to stop, saves and ends, as under ``scancel``."""
MAX_LOCAL_TASKS = 64
"""The emulator runs every task as a process on this machine; more would only exhaust it."""
TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED")
EMULATOR_VARIABLE = "HPC_HSDP_EMULATOR"
"""Set to ``1`` in every emulated job's environment: a task can tell that its job is the emulator's."""


MAX_STATE_BYTES = 1 << 20


def read_state(path: str | Path) -> dict:
    """A JSON object the emulator wrote (a job's ``<logs>/<id>_local.json``, the port
    reservations), read as data that may be hostile (:func:`hpc_hsdp.files.read_json`: a regular
    file, at most 1 MiB). OSError (FileNotFoundError when missing) or ValueError, one line."""
    data = read_json(path, max_bytes=MAX_STATE_BYTES)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def _write_json_atomic(path: Path, data: dict) -> None:
    write_atomically(path, json.dumps(data, indent=1))


def emulator_state_dir() -> Path:
    """The emulator's own state on this machine (the ports it reserved, and their lock)."""
    return user_state_dir("emulator")


PORTS_FILE = "ports.json"
PORTS_LOCK = "ports.lock"


def reserve_port(job_id: str, state_file: Path, *, is_free=port_is_free) -> int:
    """The rendezvous port of emulated job ``job_id``: the one derived from its id, or the first
    free fallback (:func:`~hpc_hsdp.plan.address.port_candidates`), that no other live emulated job holds. Chosen and recorded under an
    exclusive lock (``flock`` on ``ports.lock`` in :func:`emulator_state_dir`), so that two jobs
    started at once never get the same one; a reservation lasts while its job is pending or
    running (``state_file``)."""
    folder = _private(emulator_state_dir())  # its reservations name state files: nobody else may add one
    with open(folder / PORTS_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            held = read_state(folder / PORTS_FILE)
        except (OSError, ValueError):
            held = {}
        live = {port: r for port, r in held.items() if isinstance(r, dict) and _reservation_live(r)}
        derived = rendezvous_port({"SLURM_JOB_ID": job_id})
        port = pick_port(derived, taken={int(p) for p in live if str(p).isdigit()}, is_free=is_free)
        live[str(port)] = {"job_id": job_id, "state_file": str(state_file), "at": time.time()}
        _write_json_atomic(folder / PORTS_FILE, live)
    return port


def _private(path: Path, *, mode: int = 0o700) -> Path:
    """:func:`~hpc_hsdp.files.private_dir`, refusing a symlink or another user's directory as a user error."""
    try:
        return private_dir(path, mode=mode)
    except PermissionError as exc:
        raise SpecError(f"the local emulator cannot use {exc}") from None


def _reservation_live(reservation: dict) -> bool:
    """A reserved port stays held while its job may still bind it: pending (a minute at most
    without a supervisor) or running with a live supervisor."""
    try:
        state = read_state(reservation["state_file"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if state.get("state") not in ("PENDING", "RUNNING"):
        return False
    pid = state.get("supervisor_pid")
    if pid:
        return _alive(pid)
    return time.time() - float(reservation.get("at") or 0) < 60


_TAKEN_IDS = [0]
"""The highest job id this process gave out (a job array's tasks' included)."""


def new_job_id(tasks: int = 0) -> str:
    """A numeric id like SLURM's (ports and file names derive from it), unique enough locally; in
    one process always above every id given before, and above the ``tasks`` ids after it (a job
    array's tasks' own job ids: a sweep of several arrays submits them one after the other)."""
    found = max(int(time.time() * 1000) % 90_000_000 + 10_000_000, _TAKEN_IDS[0] + 1)
    _TAKEN_IDS[0] = found + tasks
    return str(found)


def state_path(logs_dir: Path, job_id: str) -> Path:
    return Path(logs_dir) / f"{job_id}_local.json"


@dataclass(frozen=True, kw_only=True)
class LocalAllocation:
    """What a real allocation would have given the job."""

    tasks_per_node: tuple[int, ...]
    node_names: tuple[str, ...]
    job_name: str
    gpus_per_node: int = 0


def allocation_for(*, tasks_per_node: Sequence[int], gpus_per_node: int, job_name: str) -> LocalAllocation:
    """The allocation of ``tasks_per_node`` (the job spec's: one task per GPU, ``--ntasks``
    laid out as SLURM would, or one per node for torchrun) on nodes ``n1, n2, ...``, named as
    ``plan`` and the dev cluster name them."""
    counts = tuple(tasks_per_node)
    if sum(counts) > MAX_LOCAL_TASKS:
        raise SpecError(
            f"the local emulator runs every task as a process on this machine: {sum(counts):,} tasks are more "
            f"than its {MAX_LOCAL_TASKS}; submit to SLURM (--cluster slurm) or use fewer --nodes/--gpus-per-node"
        )
    names = default_node_names(len(counts))
    return LocalAllocation(tasks_per_node=counts, node_names=names, job_name=job_name, gpus_per_node=gpus_per_node)


NVIDIA_SMI_TIMEOUT_S = 10.0
DRIVER_MARKERS = ("/proc/driver/nvidia/gpus", "/dev/nvidia0", "/dev/kfd")
"""What a GPU driver leaves on a machine without ``nvidia-smi`` (NVIDIA's; ``/dev/kfd``: ROCm's)."""


def local_gpus(*, which=shutil.which) -> list[tuple[str, tuple[int, int] | None]] | None:
    """This machine's GPUs, where the emulator's tasks run, read without torch: ``nvidia-smi``'s
    (name, compute capability; None where the driver is too old to say it); ``[]``: no GPU here
    (no ``nvidia-smi`` and no driver); None: it cannot be told (a driver without ``nvidia-smi``,
    an ``nvidia-smi`` that fails): the tasks decide."""
    smi = which("nvidia-smi")
    if smi is None:
        return None if any(Path(marker).exists() for marker in DRIVER_MARKERS) else []
    for fields in ("name,compute_cap", "name"):  # compute_cap: drivers from 510 on
        try:
            out = subprocess.run(
                [smi, f"--query-gpu={fields}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=NVIDIA_SMI_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if out.returncode == 0:
            break
    else:
        return None
    gpus = []
    for line in out.stdout.splitlines():
        if not line.strip():
            continue
        name, _, cap = line.rpartition(",") if fields == "name,compute_cap" else (line, "", "")
        major, dot, minor = cap.strip().partition(".")
        capability = (int(major), int(minor)) if dot and major.isdigit() and minor.isdigit() else None
        gpus.append((name.strip(), capability))
    return gpus


def job_environment(
    alloc: LocalAllocation, *, job_id: str, submit_dir: str, shim_dir: Path, port: int
) -> dict[str, str]:
    """The batch script's environment: job-level SLURM variables, rendezvous on loopback."""
    nodelist = compress_nodelist(alloc.node_names)
    env = dict(os.environ)
    for key in [k for k in env if k.startswith("SLURM") or k in ("MASTER_ADDR", "MASTER_PORT")]:
        del env[key]
    env.update(
        {
            "SLURM_JOB_ID": job_id,
            "SLURM_JOBID": job_id,
            "SLURM_JOB_NAME": alloc.job_name,
            "SLURM_JOB_NODELIST": nodelist,
            "SLURM_NODELIST": nodelist,
            "SLURM_JOB_NUM_NODES": str(len(alloc.node_names)),
            "SLURM_NNODES": str(len(alloc.node_names)),
            "SLURM_NTASKS": str(sum(alloc.tasks_per_node)),
            "SLURM_NPROCS": str(sum(alloc.tasks_per_node)),
            "SLURM_TASKS_PER_NODE": format_tasks_per_node(alloc.tasks_per_node),
            "SLURM_SUBMIT_DIR": submit_dir,
            "SLURMD_NODENAME": alloc.node_names[0],
            "SLURM_NODEID": "0",
            "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0",
            "SLURM_CLUSTER_NAME": "local-emulator",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),  # a script that keeps it uses it; the rendered one picks from the next
            FIRST_PORT_VARIABLE: str(port),
            EMULATOR_VARIABLE: "1",
            "HPC_HSDP_EMULATED_GPUS_PER_NODE": str(alloc.gpus_per_node),
            "PATH": os.pathsep.join([str(shim_dir), str(Path(sys.executable).parent), env.get("PATH", "")]),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _sbatch_value(script: str, key: str) -> str | None:
    """The value of ``#SBATCH --KEY=VALUE`` as sbatch reads it: a double-quoted one (what
    :func:`hpc_hsdp.job.render.sbatch_quote` writes for a path with spaces) unescaped."""
    match = re.search(rf'^#SBATCH\s+--{key}[= ]("(?:[^"\\]|\\.)*"|\S+)\s*$', script, re.MULTILINE)
    if not match:
        return None
    value = match.group(1)
    if value[:1] == value[-1:] == '"' and len(value) > 1:
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value[1:-1] if value[:1] == value[-1:] == "'" and len(value) > 1 else value


def expand_pattern(
    pattern: str,
    *,
    job_id: str,
    procid: int = 0,
    node_id: int = 0,
    node: str = "",
    array_job: str | None = None,
    array_task: str | None = None,
) -> str:
    """SLURM's filename pattern: %j job id, %t task id, %n node id, %N node name, %A/%a a job array's
    id and task (the job id and 0 outside an array), %% a percent."""
    table = {
        "j": job_id,
        "J": job_id,
        "A": array_job or job_id,
        "a": array_task or "0",
        "t": str(procid),
        "n": str(node_id),
        "N": node,
        "x": "job",
        "u": os.environ.get("USER", "user"),
        "%": "%",
    }
    return re.sub(r"%(\w|%)", lambda m: table.get(m.group(1), m.group(0)), pattern)


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
    _private(logs_dir, mode=0o777)  # its permissions are the user's; its owner must be too
    shim_dir = _private(logs_dir / ".emulator-bin")
    _private(emulator_state_dir())  # refused here, before anything of the job is written
    shim = shim_dir / "srun"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable!s} -m hpc_hsdp.job.backends.local srun "$@"\n')
    shim.chmod(0o755)
    script_path = logs_dir / f"{job_id}_submission.sh"
    script_path.write_text(script)
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
    _write_json_atomic(path, state)
    return path


def start_local(path: Path) -> bool:
    """Start the supervisor of the PENDING emulated job of state file ``path``; False when it is no
    longer pending (cancelled before it started)."""
    state = read_state(path)
    if state.get("state") != "PENDING" or state.get("supervisor_pid"):
        return False
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
        [sys.executable, "-m", "hpc_hsdp.job.backends.local", "supervise", str(path)],
        env=env,
        cwd=submit_dir,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(logs_dir / f"{job_id}_supervisor.log", "ab"),
    )
    # the supervisor rewrites the file when it starts; keep the pid if it has not yet
    current = read_state(path)
    if current.get("supervisor_pid") is None:
        current["supervisor_pid"], current["supervisor_started"] = proc.pid, process_start_time(proc.pid)
        _write_json_atomic(path, current)
    return True


def submit_local(spec, script, func, args, kwargs):
    """Start ``script`` (the rendered job of ``spec``) on the emulator, its tasks running ``func(*args, **kwargs)``."""

    from hpc_hsdp.job.backends.submitit_hooks import dump_call  # noqa: PLC0415  (submitit, only when a job is submitted)

    job_id = new_job_id()
    dump_call(spec.log_dir, job_id, func, args, kwargs)
    tasks_per_node = (1,) * spec.nodes if spec.launch.launcher == "torchrun" else spec.tasks_per_node
    tasks_per_node += (spec.gpus_per_node,) * spec.spare_nodes  # --fault-tolerance replica: spares wait
    alloc = allocation_for(
        tasks_per_node=tasks_per_node, gpus_per_node=spec.gpus_per_node, job_name=spec.scheduler.job_name
    )
    return launch_local(script, alloc=alloc, logs_dir=Path(spec.log_dir), job_id=job_id, run_dir=spec.run.run_dir)


def submit_local_array(
    specs, script: str, *, parallelism: int | None, array_dir: Path, indices: Sequence[int] | None = None
) -> str:
    """A sweep's job array on the emulator: every point a PENDING emulated job (``<array>_<i>``, in its
    own run directory's logs, with the variables SLURM gives an array task), and a detached runner
    that starts them in order, at most ``parallelism`` at once. The array's id."""
    indices = list(range(len(specs))) if indices is None else list(indices)
    array_id = new_job_id(tasks=1 + max(indices))  # its tasks' SLURM_JOB_IDs follow it
    points = []
    array_dir = _private(Path(array_dir).resolve(), mode=0o777)
    runner_state = array_dir / f"{array_id}_array_local.json"
    for index, spec in zip(indices, specs):
        tasks_per_node = (1,) * spec.nodes if spec.launch.launcher == "torchrun" else spec.tasks_per_node
        alloc = allocation_for(
            tasks_per_node=tasks_per_node, gpus_per_node=spec.gpus_per_node, job_name=spec.scheduler.job_name
        )
        array_env = {
            "SLURM_ARRAY_JOB_ID": array_id,
            "SLURM_ARRAY_TASK_ID": str(index),
            "SLURM_ARRAY_TASK_COUNT": str(len(indices)),
            "SLURM_ARRAY_TASK_MIN": str(min(indices)),
            "SLURM_ARRAY_TASK_MAX": str(max(indices)),
            # SLURM gives each task a job id of its own
            "SLURM_JOB_ID": str(int(array_id) + 1 + index),
            "SLURM_JOBID": str(int(array_id) + 1 + index),
        }
        path = prepare_local(
            script,
            alloc=alloc,
            logs_dir=Path(spec.log_dir),
            job_id=f"{array_id}_{index}",
            run_dir=spec.run.run_dir,
            array_env=array_env,
            array_runner=str(runner_state),
        )
        points.append(str(path))
    _write_json_atomic(runner_state, {"job_id": array_id, "points": points, "parallelism": parallelism})
    runner = subprocess.Popen(
        [sys.executable, "-m", "hpc_hsdp.job.backends.local", "array", str(runner_state)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(array_dir / f"{array_id}_array_runner.log", "ab"),
    )
    runner_info = {"runner_pid": runner.pid, "runner_started": process_start_time(runner.pid)}
    _write_json_atomic(runner_state, {**read_state(runner_state), **runner_info})
    return array_id


ARRAY_POLL_S = 0.5


def _run_array(runner_state: str) -> int:
    """The emulator's scheduler of one job array: starts its PENDING points in order, at most
    ``parallelism`` running at once, until none is left pending (a cancelled one is skipped)."""
    data = read_state(runner_state)
    paths = [Path(p) for p in data["points"]]
    limit = data.get("parallelism") or len(paths)
    while True:
        infos = []
        for path in paths:
            job = LocalJob(logs_dir=path.parent, job_id=read_state(path)["job_id"])
            infos.append((path, job.info()))
        waiting = [path for path, info in infos if info["state"] == "PENDING" and not info.get("supervisor_pid")]
        running = sum(1 for _, info in infos if info["state"] in ("PENDING", "RUNNING") and info.get("supervisor_pid"))
        if not waiting:
            return 0
        for path in waiting[: max(0, limit - running)]:
            start_local(path)
        time.sleep(ARRAY_POLL_S)


class LocalJob:
    """Handle of an emulated job, rebuilt from its logs folder and id in any shell."""

    def __init__(self, *, logs_dir: Path, job_id: str, alive: Callable[[int], bool] | None = None) -> None:
        self.logs_dir = Path(logs_dir)
        self.job_id = str(job_id)
        self.alive = _alive if alive is None else alive
        """Whether a process lives (this machine's process table; a fake one in tests)."""

    def info(self) -> dict:
        path = state_path(self.logs_dir, self.job_id)
        try:
            data = read_state(path)
        except (OSError, ValueError):  # none, garbage or torn by someone else: nothing to trust in it
            return {"state": "UNKNOWN", "exit_code": None}
        if not isinstance(data.get("state"), str):
            return {"state": "UNKNOWN", "exit_code": None}
        pid = data.get("supervisor_pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            pid = None  # not a pid: nothing to look at
        if data["state"] == "PENDING" and not pid and data.get("array_runner") and not self._runner_lives(data):
            time.sleep(0.2)  # it may have started the point just now
            try:
                data = read_state(path)
            except (OSError, ValueError):
                return {"state": "UNKNOWN", "exit_code": None}
            if data.get("state") == "PENDING" and not data.get("supervisor_pid"):  # never to be started
                data["state"], data["exit_code"] = "FAILED", -1
                data["reason"] = "the emulator's runner of its job array ended before it started this point"
            return data
        if data["state"] in ("PENDING", "RUNNING") and pid and not self.alive(pid):
            time.sleep(0.2)  # it may have written its last state just now
            try:
                data = read_state(path)
            except (OSError, ValueError):
                return {"state": "UNKNOWN", "exit_code": None}
            if data.get("state") in ("PENDING", "RUNNING"):
                data["state"], data["exit_code"] = "FAILED", data.get("exit_code") or -1
        return data

    def _runner_lives(self, data: dict) -> bool:
        """The runner of the job array this pending point belongs to still lives (unknown: it does)."""
        try:
            runner = read_state(data["array_runner"])
        except (OSError, ValueError, TypeError):
            return False
        pid = runner.get("runner_pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return True  # not recorded yet: just started
        started = runner.get("runner_started")
        if started is not None and process_start_time(pid) not in (None, started):
            return False  # the pid names another process now
        return self.alive(pid)

    @property
    def state(self) -> str:
        return self.info()["state"]

    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    def wait(self, poll_s: float = 0.5, timeout_s: float | None = None) -> str:
        start = time.monotonic()
        while not self.done():
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"local job {self.job_id} still {self.state} after {timeout_s:.0f} s")
            time.sleep(poll_s)
        return self.state

    def cancel(self) -> None:
        info = self.info()
        pid = info.get("supervisor_pid")
        if info.get("state") == "PENDING" and not pid:  # a job array's point not started yet: it never will be
            path = state_path(self.logs_dir, self.job_id)
            info.update(state="CANCELLED", ended_at=time.time())
            _write_json_atomic(path, info)
            if info.get("run_dir"):
                release_claim(info["run_dir"], self.job_id, ended="CANCELLED")
            return
        own = _is_supervisor(pid, info.get("supervisor_started"), state_path(self.logs_dir, self.job_id))
        if own and self.alive(pid):
            os.kill(pid, signal.SIGTERM)

    def results(self) -> list:
        """Each task's return value (submitit's result pickles), raising the first task error."""
        from hpc_hsdp.job.backends.submitit_hooks import load_result, result_path  # noqa: PLC0415  (submitit, only for results)

        self.wait()
        ntasks = sum(self.info()["tasks_per_node"])
        outcomes = []
        for procid in range(ntasks):
            path = result_path(self.logs_dir, self.job_id, procid)
            if not path.exists():
                raise RuntimeError(
                    f"local job {self.job_id} ({self.state}): task {procid} left no result; "
                    f"see {self.logs_dir}/{self.job_id}_{procid}_log.err"
                )
            outcome, value = load_result(path)
            if outcome != "success":
                raise RuntimeError(f"local job {self.job_id}: task {procid} failed:\n{value}")
            outcomes.append(value)
        return outcomes


class LocalBackend(Backend):
    """The local emulator: every task a process on this machine; a job's state is its state file."""

    name = "local"
    title = "local emulator"
    has_time_limits = False
    separate_machines = False
    requeues = False

    def __init__(self, *, alive: Callable[[int], bool] | None = None) -> None:
        self.alive = alive

    def job(self, record: JobRecord) -> LocalJob:
        return LocalJob(logs_dir=Path(record.logs_dir), job_id=record.job_id, alive=self.alive)

    def submit(self, spec, script, func, args, kwargs):
        job = submit_local(spec, script, func, args, kwargs)
        return job.job_id, job

    def submit_array(self, specs, script, script_path, *, parallelism, indices):
        logs = Path(script_path).parent / "logs"
        return submit_local_array(specs, script, parallelism=parallelism, array_dir=logs, indices=indices)

    def status(self, record: JobRecord) -> JobStatus:
        info = self.job(record).info()
        code = info.get("exit_code")
        return release_if_ended(record, JobStatus(state=info["state"], exit_code=None if code is None else str(code)))

    def statuses(self, records: list[JobRecord]) -> dict[str, JobStatus]:
        statuses = {}
        for record in records:
            try:
                statuses[record.run_dir] = self.status(record)
            except (OSError, ValueError) as exc:  # a broken state file is shown, not fatal
                statuses[record.run_dir] = JobStatus(state="UNKNOWN", reason=f"{type(exc).__name__}: {exc}"[:200])
        return statuses

    def cancel(self, record: JobRecord) -> None:
        self.job(record).cancel()

    def works_in(self, record: JobRecord) -> Path | None:
        """The run directory the emulator launched the job for, from its state file."""
        info = self.job(record).info()
        logs = info.get("logs_dir")
        if not isinstance(logs, str) or not logs:  # a state file of before: its script lies in the logs
            logs = str(Path(info["script"]).parent) if isinstance(info.get("script"), str) else None
        return Path(logs) if logs else None

    def requeue(self, job_id: str) -> None:
        return None  # the emulator requeues nothing: a stopped job is submitted again

    def fp8_refusal(self, spec) -> str | None:
        return fp8_local_refusal(local_gpus())


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat`` field 22):
    with the pid it names one process, never a later one that got the same pid."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


SUPERVISOR_MARK = "HPC_HSDP_EMULATOR_STATE"
"""Set in the environment the emulator starts a job's supervisor with: the absolute path of the
job's state file. A process is that job's supervisor only when its environment says so."""


def _is_supervisor(pid: object, started: object, state_file: Path) -> bool:
    """``pid`` (from the job's state file, which anyone with the run directory could edit) is
    the supervisor this emulator started for ``state_file``: a process of this user that began
    when the state file says and whose environment (``/proc/PID/environ``, readable by its owner
    alone, fixed when it started) names ``state_file`` in :data:`SUPERVISOR_MARK`. A pid, start
    time and owner copied from ``/proc`` into a forged record name another process of the user,
    whose environment has no such mark: it is not signalled."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 1 or pid == os.getpid():
        return False
    now = process_start_time(pid)
    if now is None and not Path("/proc/self/stat").exists():
        return True  # no /proc here (macOS): the pid alone
    if now is None or now != started:
        return False
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.geteuid():
            return False
        marks = _environment_value(pid, SUPERVISOR_MARK)
        return marks is not None and os.path.realpath(marks) == os.path.realpath(state_file)
    except OSError:
        return False


def _environment_value(pid: int, name: str) -> str | None:
    """``name``'s value in the environment process ``pid`` started with (None: not set)."""
    data = read_capped(f"/proc/{pid}/environ", max_bytes=MAX_ENVIRON_BYTES)
    prefix = f"{name}=".encode()
    for entry in data.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


MAX_ENVIRON_BYTES = 16 << 20


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of ours counts as dead
        waited, _ = os.waitpid(pid, os.WNOHANG)
        return waited == 0
    except ChildProcessError:
        return True


# ----------------------------------------------------------------------------- supervisor


def _supervise(state_file: str) -> int:
    path = Path(state_file)
    state = read_state(path)
    if state.get("state") != "PENDING":  # a job array's point cancelled just as it was started
        return 0
    script = Path(state["script"]).read_text()
    job_id = state["job_id"]
    array_env = state.get("array_env") or {}
    array = {"array_job": array_env.get("SLURM_ARRAY_JOB_ID"), "array_task": array_env.get("SLURM_ARRAY_TASK_ID")}
    job_id = array_env.get("SLURM_JOB_ID", job_id)
    out = expand_pattern(_sbatch_value(script, "output") or f"slurm-{job_id}.out", job_id=job_id, **array)
    err = expand_pattern(_sbatch_value(script, "error") or out, job_id=job_id, **array)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    state.update(
        state="RUNNING",
        started_at=time.time(),
        supervisor_pid=os.getpid(),
        supervisor_started=process_start_time(os.getpid()),
    )
    _write_json_atomic(path, state)
    cancelled = False
    with open(out, "ab") as stdout, open(err, "ab") as stderr:
        batch = subprocess.Popen(
            ["bash", state["script"]], stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, start_new_session=True
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
    _write_json_atomic(path, state)
    if state.get("run_dir"):  # as SLURM ends a job: the run directory is free again
        release_claim(state["run_dir"], state["job_id"], ended=state["state"])
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


# ----------------------------------------------------------------------------- srun


def _srun_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="srun (hpc-hsdp local emulator)", allow_abbrev=False)
    parser.add_argument("--kill-on-bad-exit", "-K", nargs="?", const="1", default="0")
    parser.add_argument("--unbuffered", "-u", action="store_true")
    parser.add_argument("--output", "-o", default=None)
    parser.add_argument("--error", "-e", default=None)
    parser.add_argument("--distribution", "-m", default="block")
    parser.add_argument("--ntasks-per-node", type=int, default=None)
    parser.add_argument("--ntasks", "-n", type=int, default=None)
    parser.add_argument("--nodes", "-N", type=int, default=None)
    parser.add_argument("--relative", "-r", type=int, default=None)  # a step on nodes N.. of the allocation
    parser.add_argument("--nodelist", "-w", default=None)  # a step on these nodes of the allocation
    parser.add_argument("--label", "-l", action="store_true")
    parser.add_argument("--export", default=None)
    parser.add_argument("--cpu-bind", default=None)
    parser.add_argument("--cpus-per-task", "-c", type=int, default=None)  # every task runs on this machine's CPUs
    parser.add_argument("--container-image", default=None)
    parser.add_argument("--container-name", default=None)
    parser.add_argument("--container-mounts", default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def _hostfile_layout(path: str, node_names: Sequence[str]) -> tuple[tuple[int, ...], str]:
    """Tasks per node and their order (block or cyclic) from ``SLURM_HOSTFILE``."""
    if not path or not Path(path).is_file():
        raise ValueError(f"SLURM_HOSTFILE={path!r} is not a file")
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    counts = tuple(lines.count(name) for name in node_names)
    env = {"SLURM_JOB_NODELIST": ",".join(node_names)}
    for distribution in DISTRIBUTIONS:
        if hostfile_lines(env, counts, distribution) == lines:
            return counts, distribution
    raise ValueError("the emulator places tasks node by node (block) or round-robin (cyclic) only")


def _srun(argv: Sequence[str]) -> int:
    args = _srun_parser().parse_args(argv)
    if not args.command:
        print("srun (emulator): no command given", file=sys.stderr)
        return 2
    if args.container_image:
        print(
            "srun (emulator): --container-image needs the pyxis plugin of a real cluster; "
            "the local emulator runs commands directly. Submit with --cluster slurm.",
            file=sys.stderr,
        )
        return 2
    env = os.environ
    job_id = env["SLURM_JOB_ID"]
    node_names = expand_nodelist(env["SLURM_JOB_NODELIST"])
    counts = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
    if args.nodelist is not None:  # a step on these nodes of the job (a replica group under one switch)
        wanted = set(expand_nodelist(args.nodelist))
        if not wanted <= set(node_names) or (args.nodes is not None and args.nodes != len(wanted)):
            print(
                f"srun (emulator): --nodelist={args.nodelist} --nodes={args.nodes}: the job's nodes are "
                f"{env['SLURM_JOB_NODELIST']}",
                file=sys.stderr,
            )
            return 2
        kept = [i for i, name in enumerate(node_names) if name in wanted]  # SLURM's order, as a real step's
        node_names, counts = tuple(node_names[i] for i in kept), tuple(counts[i] for i in kept)
    elif args.relative is not None or args.nodes is not None:  # a step on some of the job's nodes (a replica group)
        first = args.relative or 0
        last = first + (args.nodes or len(node_names) - first)
        if last > len(node_names):
            print(
                f"srun (emulator): --relative={first} --nodes={args.nodes}: the job has {len(node_names)} nodes",
                file=sys.stderr,
            )
            return 2
        node_names, counts = node_names[first:last], counts[first:last]
    if args.ntasks_per_node is not None:
        counts = (args.ntasks_per_node,) * len(counts)
    distribution = args.distribution.split(":")[0].split(",")[0]
    if distribution == "arbitrary":
        try:
            counts, distribution = _hostfile_layout(env.get("SLURM_HOSTFILE", ""), node_names)
        except ValueError as exc:
            print(f"srun (emulator): --distribution=arbitrary: {exc}", file=sys.stderr)
            return 2
    if distribution not in DISTRIBUTIONS:
        print(
            f"srun (emulator): --distribution={args.distribution} is not emulated; use block or cyclic", file=sys.stderr
        )
        return 2
    task_envs = task_environments(
        tasks_per_node=counts,
        node_names=node_names,
        job_id=job_id,
        distribution=distribution,
        job_name=env.get("SLURM_JOB_NAME", "job"),
    )
    procs: list[subprocess.Popen] = []
    files = []
    for task in task_envs:
        procid, node_id = int(task["SLURM_PROCID"]), int(task["SLURM_NODEID"])
        names = {
            "job_id": job_id,
            "procid": procid,
            "node_id": node_id,
            "node": task["SLURMD_NODENAME"],
            "array_job": env.get("SLURM_ARRAY_JOB_ID"),
            "array_task": env.get("SLURM_ARRAY_TASK_ID"),
        }
        out = open(expand_pattern(args.output, **names), "ab") if args.output else None
        err = open(expand_pattern(args.error, **names), "ab") if args.error else out
        files += [f for f in (out, err) if f is not None]
        job_level = {k: env[k] for k in ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES") if k in env}
        task_env = {**env, **task, **job_level, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0"}
        procs.append(subprocess.Popen(args.command, env=task_env, stdout=out, stderr=err, stdin=subprocess.DEVNULL))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(sig, forward)
    kill_on_bad_exit = args.kill_on_bad_exit not in ("0", None)
    first_failure: int | None = None
    reported: set[int] = set()
    kill_at = None

    def report_failures() -> None:
        # like srun, one line per failed task, in the order seen (tasks ending within one
        # poll: by task id); the first one is the job's cause
        nonlocal first_failure, kill_at
        for procid, p in enumerate(procs):
            code = p.poll()
            if code in (None, 0) or procid in reported:
                continue
            reported.add(procid)
            first = first_failure is None
            first_failure = code if first else first_failure
            print(
                f"srun (emulator): task {procid} exited with code {code}"
                + ("; terminating the other tasks (--kill-on-bad-exit)" if first and kill_on_bad_exit else ""),
                file=sys.stderr,
            )
            if first and kill_on_bad_exit and any(q.poll() is None for q in procs):
                forward(signal.SIGTERM, None)
                kill_at = time.monotonic() + KILL_WAIT_S

    while any(p.poll() is None for p in procs):
        report_failures()
        if kill_at is not None and time.monotonic() > kill_at:
            forward(signal.SIGKILL, None)
        time.sleep(0.1)
    report_failures()  # tasks that ended since the last look
    for f in files:
        f.close()
    if first_failure is None:
        return 0
    return first_failure if first_failure > 0 else 128 - first_failure


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["srun"]:
        return _srun(argv[1:])
    if argv[:1] == ["supervise"] and len(argv) == 2:
        return _supervise(argv[1])
    if argv[:1] == ["array"] and len(argv) == 2:
        return _run_array(argv[1])
    print(
        "usage: python -m hpc_hsdp.job.backends.local srun [srun options] command... | supervise STATE_FILE",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
