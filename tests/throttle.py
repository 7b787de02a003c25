"""Slowing one node "from outside", as a throttled GPU or a busy host would: every process of a job
on that node is stopped (SIGSTOP) for most of each period and let run (SIGCONT) for the rest, until
told to stop. The stopping is done by a process of its own at a higher priority (this machine is
loaded by the very job it slows, and a thread of the test would be starved with it). Works for the
local emulator's tasks and the dev SLURM cluster's (both run on this machine; a task's node is its
SLURMD_NODENAME)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def user_pids(environ: set[bytes], argv=lambda argv: True) -> list[int]:
    """This user's processes (not this one) whose environment holds every ``environ`` entry
    (``b"NAME=value"``) and whose argument list (bytes) ``argv`` accepts."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if entry.stat().st_uid != os.geteuid():
                continue
            found = set((entry / "environ").read_bytes().split(b"\0"))
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if environ <= found and argv(args):
            pids.append(int(entry.name))
    return pids


def node_pids(job_id: str, node: str, needle: bytes = b"") -> list[int]:
    """This user's processes of job ``job_id`` on ``node`` (their environment says so) whose command
    line holds ``needle``."""
    wanted = {f"SLURM_JOB_ID={job_id}".encode(), f"SLURMD_NODENAME={node}".encode()}
    return user_pids(wanted, lambda args: needle in b"\0".join(args))


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def throttle(job_id: str, node: str, stopped: float, period_s: float, needle: bytes) -> None:
    """The throttling process's loop, until SIGTERM: the node's processes stopped ``stopped`` of each
    period, and looked for again every few periods (new ones start) while they are stopped: on a
    loaded machine the scan of /proc takes longer than a period, and it must lengthen the stop, not
    the run. All let run at the end."""
    try:
        os.nice(-10)  # root on the test machines; elsewhere it stays at the default priority
    except OSError:
        pass
    done = []
    signal.signal(signal.SIGTERM, lambda *_: done.append(1))
    seen: set[int] = set()
    cycle, pids = 0, []
    while not done:
        started = time.monotonic()
        _signal(pids, signal.SIGSTOP)
        if cycle % 10 == 0:
            pids = node_pids(job_id, node, needle)
            _signal(pids, signal.SIGSTOP)
            seen.update(pids)
        cycle += 1
        time.sleep(max(0.0, period_s * stopped - (time.monotonic() - started)))
        _signal(pids, signal.SIGCONT)
        time.sleep(period_s * (1 - stopped))
    _signal(seen, signal.SIGCONT)


class Throttle:
    """``with Throttle(job_id, "n2", stopped=0.95):`` the node's processes run 5% of the time."""

    def __init__(self, job_id: str, node: str, *, stopped: float = 0.8, period_s: float = 0.05, needle: bytes = b""):
        self.args = (job_id, node, stopped, period_s, needle)
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Throttle:
        job_id, node, stopped, period_s, needle = self.args
        code = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from throttle import throttle; "
            f"throttle({job_id!r}, {node!r}, {stopped!r}, {period_s!r}, {needle!r})"
        )
        self.process = subprocess.Popen([sys.executable, "-c", code])
        return self

    def __exit__(self, *exc) -> None:
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def check_figures(check: dict) -> dict:
    """What a failed assertion on a check shows: each node's and link's figures, short."""
    return {
        name: {key: round(value, 4) for key, value in figures.items() if isinstance(value, float)}
        for name, figures in {**check["nodes"], **check["links"]}.items()
    }


def trained_nodes(run_dir: Path) -> list[str]:
    """The nodes a run's ranks trained on (layout.json), in rank order."""
    layout = json.loads((run_dir / "layout.json").read_text())
    return list(dict.fromkeys(r["node"] for r in layout["ranks"]))
