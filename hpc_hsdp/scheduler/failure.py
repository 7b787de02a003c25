"""Which task of a job failed first, and how, read from the job's logs (SLURM's ``srun`` lines
or the emulator's, the latest run of a requeued job)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from hpc_hsdp.files import read_capped

LOG_TAIL_BYTES = 16 << 20
"""How much of the end of a log is read for its latest run (a log may grow without bound)."""


def _log_text(path: Path) -> str:
    """The last :data:`LOG_TAIL_BYTES` of a log, read as a regular file only ('' when it is none)."""
    try:
        return read_capped(path, max_bytes=LOG_TAIL_BYTES, tail=True).decode(errors="replace")
    except (OSError, ValueError):
        return ""


def failure_summary(logs: Path, job_id: str, *, rank_of_task: Callable[[int], int | None], lines: int = 12) -> str:
    """Which rank failed first and how, with the last lines of its log.

    The cause is the first task srun reports as failed in the batch log of the latest
    run (``srun: error: n2: task 3: Killed`` for a SIGKILL, ``... Exited with exit code
    1`` for a raise; the emulator's ``srun (emulator): task 3 exited with code -9``);
    tasks srun terminated afterwards, and errors that only say a peer went away, are
    effects. Without such a line: the first task log with an error of its own."""
    batch = logs / f"{job_id}_0_log.err"
    cause = _first_failed_task(_latest_run(_log_text(batch)))
    if cause is not None:
        task, node, what = cause
        rank = rank_of_task(task)
        who = f"rank {rank} (task {task}{f' on {node}' if node else ''})" if rank is not None else f"task {task}"
        head = f"{who} failed first: {what}"
        path = logs / f"{job_id}_{task}_log.err"
        text = _latest_run(_log_text(path))
        if task == 0:  # task 0's stderr is the batch log: keep the task's own lines
            text = "\n".join(line for line in text.splitlines() if not line.startswith(("srun", "slurmstepd")))
        tail = "\n".join(text.rstrip().splitlines()[-lines:])
        return f"{head}\n--- {path.name} ---\n{tail}" if tail else head
    errs = sorted(logs.glob(f"{job_id}_*_log.err"), key=task_index)
    markers = ("Traceback", "Error", "error:", "FAILED")
    scored = []
    for path in errs:
        text = _latest_run(_log_text(path))
        if any(m in text for m in markers):
            first = min(text.find(m) for m in markers if m in text)
            scored.append((first, path, text))
    if not scored:
        return ""
    # the task whose log shows an error of its own, not one about a peer or srun terminating it, is the cause
    causes = [s for s in scored if not any(m in s[2] for m in _EFFECT_MARKERS) and "terminat" not in s[2].lower()]
    _, path, text = (causes or scored)[0]
    tail = "\n".join(text.rstrip().splitlines()[-lines:])
    return f"--- {path.name} (task {task_index(path)}) ---\n{tail}"


_EFFECT_MARKERS = (
    "SIGTERM",
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited",
    "Broken pipe",
    "DistNetworkError",
)
_RUN_START = "hpc-hsdp: job "  # the batch script's first stderr line of each run: "hpc-hsdp: job N starts (restart R)"
_TASK_START = "[hpc-hsdp] rank "  # a task's first line of each run (runtime.dist.init)
_SRUN_TASK_FAILED = re.compile(
    r"^srun: error: (?P<node>[^:\s]+): task (?P<task>\d+): (?P<what>.+)$"
    r"|^srun \(emulator\): task (?P<etask>\d+) exited with code (?P<code>-?\d+)",
    re.MULTILINE,
)


def _latest_run(text: str) -> str:
    """The part of an appended log written by the latest run of a (requeued) job."""
    for marker in (_RUN_START, _TASK_START):
        at = text.rfind("\n" + marker)
        if at >= 0 or text.startswith(marker):
            return text[at + 1 :] if at >= 0 else text
    return text


def _first_failed_task(batch_log: str) -> tuple[int, str | None, str] | None:
    """(task, node, what happened) of the first task srun reports as failed, not terminated by it."""
    for match in _SRUN_TASK_FAILED.finditer(batch_log):
        if match.group("task") is not None:
            what = match.group("what").strip()
            if what.startswith("Terminated"):
                continue  # srun ended it after another task failed
            if what == "Killed":
                what = "killed by SIGKILL (kill -9, the out-of-memory killer, or the node) | " + match.group(0)
            return int(match.group("task")), match.group("node"), what
        code = int(match.group("code"))
        what = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return int(match.group("etask")), None, what + " | " + match.group(0).split(";")[0]
    return None


def task_index(path: Path) -> int:
    """The task of a log ``<job>_<task>_log.out``; a sweep point's job is its array task
    (``<array>_<index>_<task>_log.out``)."""
    parts = path.name.split("_")
    if len(parts) > 3 and parts[0].isdigit() and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[2])
    return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0
