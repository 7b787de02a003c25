"""The handle of an emulated job, rebuilt from its logs folder and id in any shell: its state,
waiting for it, cancelling it, its tasks' results."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from hpc_hsdp.rundir.lifecycle.claim import release_claim
from hpc_hsdp.scheduler.emulator.processes import is_supervisor, pid_alive, process_start_time
from hpc_hsdp.scheduler.emulator.state_files import TERMINAL_STATES, read_job_state, read_state, state_path, write_state


class LocalJob:
    """Handle of an emulated job, rebuilt from its logs folder and id in any shell."""

    def __init__(self, *, logs_dir: Path, job_id: str, alive: Callable[[int], bool] | None = None) -> None:
        self.logs_dir = Path(logs_dir)
        self.job_id = str(job_id)
        self.alive = pid_alive if alive is None else alive
        """Whether a process lives (this machine's process table; a fake one in tests)."""

    def info(self) -> dict:
        path = state_path(self.logs_dir, self.job_id)
        try:
            data = read_job_state(path)
        except (OSError, ValueError):  # none, garbage or torn by someone else: nothing to trust in it
            return {"state": "UNKNOWN", "exit_code": None}
        pid = data.get("supervisor_pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            pid = None  # not a pid: nothing to look at
        if data["state"] == "PENDING" and not pid and data.get("array_runner") and not self._runner_lives(data):
            time.sleep(0.2)  # it may have started the point just now
            try:
                data = read_job_state(path)
            except (OSError, ValueError):
                return {"state": "UNKNOWN", "exit_code": None}
            if data.get("state") == "PENDING" and not data.get("supervisor_pid"):  # never to be started
                data["state"], data["exit_code"] = "FAILED", -1
                data["reason"] = "the emulator's runner of its job array ended before it started this point"
            return data
        if data["state"] in ("PENDING", "RUNNING") and pid and not self.alive(pid):
            time.sleep(0.2)  # it may have written its last state just now
            try:
                data = read_job_state(path)
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
            write_state(path, info)
            if info.get("run_dir"):
                release_claim(info["run_dir"], self.job_id, ended="CANCELLED")
            return
        if is_supervisor(pid, info.get("supervisor_started"), state_path(self.logs_dir, self.job_id)) and self.alive(
            pid
        ):
            os.kill(pid, signal.SIGTERM)

    def results(self) -> list:
        """Each task's return value (submitit's result pickles), raising the first task error."""
        from hpc_hsdp.scheduler.backends.submitit_hooks import load_result, result_path  # noqa: PLC0415  (submitit, only for results)

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
