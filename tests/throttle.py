"""Slowing one node "from outside", as a throttled GPU or a busy host would: every process of a job
on that node is stopped (SIGSTOP) for most of each period and let run (SIGCONT) for the rest, until
told to stop. The stopping is done by a process of its own, scheduled in real time where allowed (this machine
is loaded by the very job it slows, and a thread of the test would be starved with it). Works for the
local emulator's tasks and the dev SLURM cluster's (both run on this machine; a task's node is its
SLURMD_NODENAME)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
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


def _wake_on_time() -> None:
    """Real-time scheduling where it is allowed (root on the test machines), else a higher priority:
    on a loaded machine an ordinary process wakes late, and each late wake-up lengthens the run."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (AttributeError, OSError):
        try:
            os.nice(-10)
        except OSError:
            pass


def throttle(job_id: str, node: str, stopped: float, period_s: float, needle: bytes, report: str = "") -> None:
    """The throttling process's loop, until SIGTERM: the node's processes stopped ``stopped`` of the
    time, and looked for again (every period until there are some, then every few: new ones start)
    while they are stopped: on a loaded machine the scan of /proc takes longer than a period, and it
    must lengthen the stop, not the run. A run that overran its share (a late wake-up) is made up by
    a longer stop. All let run at the end; ``report``: a JSON file of what it did (pids found and
    when, the time stopped and run)."""
    _wake_on_time()
    done = []
    signal.signal(signal.SIGTERM, lambda *_: done.append(1))
    began = time.monotonic()
    found: dict[int, float] = {}
    cycle, pids = 0, []
    ran = period_s * (1 - stopped)
    totals = {"stopped_s": 0.0, "ran_s": 0.0}
    while not done:
        started = time.monotonic()
        _signal(pids, signal.SIGSTOP)
        if not pids or cycle % 10 == 0:
            pids = node_pids(job_id, node, needle)
            _signal(pids, signal.SIGSTOP)
            for pid in pids:
                found.setdefault(pid, round(time.monotonic() - began, 3))
        cycle += 1
        time.sleep(max(0.0, ran * stopped / (1 - stopped) - (time.monotonic() - started)))
        _signal(pids, signal.SIGCONT)
        resumed = time.monotonic()
        time.sleep(period_s * (1 - stopped))
        ran = time.monotonic() - resumed
        if pids:
            totals["stopped_s"] += resumed - started
            totals["ran_s"] += ran
    _signal(found, signal.SIGCONT)
    if report:
        summary = {"found_after_s": found, "cycles": cycle, "scheduler": os.sched_getscheduler(0), **totals}
        Path(report).write_text(json.dumps(summary))


class Throttle:
    """``with Throttle(job_id, "n2", stopped=0.95):`` the node's processes run 5% of the time;
    :meth:`report` says what it did, for a test's failure message."""

    def __init__(self, job_id: str, node: str, *, stopped: float = 0.8, period_s: float = 0.05, needle: bytes = b""):
        self.args = (job_id, node, stopped, period_s, needle)
        self.process: subprocess.Popen | None = None
        self.summary: dict = {}
        self.report_file = Path(tempfile.mkstemp(prefix="throttle-", suffix=".json")[1])

    def __enter__(self) -> Throttle:
        job_id, node, stopped, period_s, needle = self.args
        code = (
            f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); from throttle import throttle; "
            f"throttle({job_id!r}, {node!r}, {stopped!r}, {period_s!r}, {needle!r}, {str(self.report_file)!r})"
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
        try:
            self.summary = json.loads(self.report_file.read_text() or "{}")
        except (OSError, ValueError):
            self.summary = {}
        self.report_file.unlink(missing_ok=True)

    def report(self) -> dict:
        """What the throttle did (after the ``with``): pids found and when, seconds stopped and run."""
        return self.summary


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
