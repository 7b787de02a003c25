"""The rendezvous ports of the emulated jobs on this machine: one per live job, reserved under a lock."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path

from hpc_hsdp.plan.address import pick_port, port_is_free
from hpc_hsdp.plan.topology import rendezvous_port
from hpc_hsdp.scheduler.emulator.processes import pid_alive
from hpc_hsdp.scheduler.emulator.state_files import emulator_private_dir, emulator_state_dir, read_state, write_state

PORTS_FILE = "ports.json"


PORTS_LOCK = "ports.lock"


def reserve_port(job_id: str, state_file: Path, *, is_free=port_is_free) -> int:
    """The rendezvous port of emulated job ``job_id``: the one derived from its id, or the first
    free fallback (:func:`~hpc_hsdp.plan.address.port_candidates`), that no other live emulated job holds. Chosen and recorded under an
    exclusive lock (``flock`` on ``ports.lock`` in :func:`emulator_state_dir`), so that two jobs
    started at once never get the same one; a reservation lasts while its job is pending or
    running (``state_file``)."""
    folder = emulator_private_dir(emulator_state_dir())  # its reservations name state files: nobody else may add one
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
        write_state(folder / PORTS_FILE, live)
    return port


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
        return pid_alive(pid)
    return time.time() - float(reservation.get("at") or 0) < 60
