"""Slowing one node "from outside", as a throttled GPU or a busy host would: every process of a job
on that node is stopped (SIGSTOP) for most of each period and let run (SIGCONT) for the rest, by a
thread of the test, until told to stop. Works for the local emulator's tasks and the dev SLURM
cluster's (both run on this machine; a task's node is its SLURMD_NODENAME)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path


def node_pids(job_id: str, node: str, needle: bytes = b"") -> list[int]:
    """This user's processes of job ``job_id`` on ``node`` (their environment says so) whose command
    line holds ``needle``."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={node}".encode()}
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.geteuid():
                continue
            environ = set((entry / "environ").read_bytes().split(b"\0"))
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if wanted <= environ and needle in cmdline:
            pids.append(int(entry.name))
    return pids


class Throttle:
    """``with Throttle(job_id, "n2", stopped=0.8):`` the node's processes run 20% of the time."""

    def __init__(self, job_id: str, node: str, *, stopped: float = 0.8, period_s: float = 0.05, needle: bytes = b""):
        self.job_id, self.node, self.needle = job_id, node, needle
        self.stopped, self.period_s = stopped, period_s
        self.done = threading.Event()
        self.seen: set[int] = set()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _signal(self, pids, sig) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def _run(self) -> None:
        cycle, pids = 0, []
        while not self.done.is_set():
            if cycle % 10 == 0:  # new processes start: look again every few periods
                pids = node_pids(self.job_id, self.node, self.needle)
                self.seen.update(pids)
            cycle += 1
            self._signal(pids, signal.SIGSTOP)
            self.done.wait(self.period_s * self.stopped)
            self._signal(pids, signal.SIGCONT)
            self.done.wait(self.period_s * (1 - self.stopped))
        self._signal(list(self.seen), signal.SIGCONT)

    def __enter__(self) -> Throttle:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=10)
