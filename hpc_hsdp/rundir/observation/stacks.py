"""Every rank's stack, grouped: what ``hpc-hsdp stacks`` prints and what the hang watchdog
leaves in ``<run_dir>/hang/stacks.json`` for ``status`` (this module names, writes and reads
that file).

A rank's stack, as the node collector (:mod:`hpc_hsdp.submit_host.live_stacks`) or the watchdog gives it::

    {"rank": 3, "node": "n1", "pid": 1234, "how": "py-spy --native",   # or py-spy, faulthandler, watchdog
     "threads": [{"name": "MainThread", "main": true,
                  "frames": [{"function": "wait", "file": "torch/distributed/c10d.py", "line": 12,
                              "native": false}, ...]}],                # innermost first
     "error": null}                                                    # or why there is no stack

:func:`group_stacks` puts the ranks whose main thread runs through the same frames (each frame's
function and file; lines and native addresses aside, so ranks in the same call group although
their loops are at other lines) in one group, the smallest groups first: the odd ones out, the
rank stuck elsewhere, come before the fifteen that wait for it. :func:`stack_lines` says them,
e.g. ``rank 1 (1 of 16): sleep [native] < at_step in hpc_hsdp/task/resilience/injected_faults.py:190``.
All pure but the file's reader and writer.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from hpc_hsdp.files import read_json
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.rundir.files import atomic_write_text
from hpc_hsdp.rundir.observation.flight_recorder import HANG_DIR
from hpc_hsdp.rundir.status_section import RunView, StatusSection
from hpc_hsdp.rundir.training.stragglers import rank_ranges

HANG_STACKS = "stacks.json"
MAX_STACKS_BYTES = 64 << 20
FRAMES_SHOWN = 12
"""Frames of each group's stack that the text shows (innermost first); ``--json`` has them all."""
PACKAGE_ROOTS = ("site-packages/", "dist-packages/", "/hpc_hsdp/")
PASS_THROUGH = (
    "hpc_hsdp/task/observation/collectives.py",
    "torch/distributed/c10d_logger.py",
    "torch/utils/_contextlib.py",
)
"""Wrappers that only pass a call on (the collectives' listeners, torch's logging and no-grad
decorators): the headline names the call they wrap."""
FUNCTION_CHARS = 100

_FAULTHANDLER_THREAD = re.compile(
    r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[[^\]]*\])? \(most recent call first\):"
)
_FAULTHANDLER_FRAME = re.compile(r'^  File "(.*)", line (\d+|\?\?\?) in (.*)$')


def short_path(file: str) -> str:
    """A frame's file as people read it: from the package on (``torch/distributed/...``,
    ``hpc_hsdp/task/...``), else its last two parts."""
    for root in PACKAGE_ROOTS:
        at = file.rfind(root)
        if at >= 0:
            return file[at + len(root) :] if root != "/hpc_hsdp/" else file[at + 1 :]
    parts = file.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


def short_function(name: str) -> str:
    """A C++ function as people read it: template and parameter lists folded (``f<...>(...)``)."""
    out, depth = [], 0
    for char in name:
        if char in "<(":
            if depth == 0:
                out.append(char + "...")
            depth += 1
        elif char in ">)" and depth:
            depth -= 1
            if depth == 0:
                out.append(char)
        elif depth == 0:
            out.append(char)
    folded = "".join(out).replace("operator<...>", "operator<>")
    return folded if len(folded) <= FUNCTION_CHARS else folded[: FUNCTION_CHARS - 3] + "..."


def frame(function: str, file: str, line: int | None, *, native: bool = False) -> dict:
    return {"function": function, "file": file, "line": line, "native": native}


def _is_address(name: str) -> bool:
    return bool(re.fullmatch(r"0x[0-9a-fA-F]+", name or ""))


def threads_from_py_spy(data: object, pid: int | None = None) -> list[dict]:
    """The threads of ``py-spy dump --json`` (a list of threads, frames innermost first; a native
    frame names its library in ``module``); the main thread marked (its OS thread id is the pid)."""
    if not isinstance(data, list):
        raise ValueError("py-spy's answer is not a list of threads")
    threads = []
    for entry in data:
        if not isinstance(entry, dict):
            continue
        frames = []
        for f in entry.get("frames") or ():
            if not isinstance(f, dict):
                continue
            native = f.get("module") is not None
            name = str(f.get("name", "?"))
            file = str(f.get("short_filename") if native else f.get("filename") or f.get("short_filename") or "?")
            line = f.get("line")
            frames.append(frame(name, file, line if isinstance(line, int) and line > 0 else None, native=native))
        threads.append(
            {
                "name": str(entry.get("thread_name") or entry.get("thread_id") or "?"),
                "main": pid is not None and entry.get("os_thread_id") == pid,
                "frames": frames,
            }
        )
    if threads and not any(t["main"] for t in threads):
        _mark_main(threads)
    return threads


def threads_from_faulthandler(text: str) -> list[dict]:
    """The threads of a faulthandler dump (``kill -QUIT``: every thread, frames innermost first)
    found in ``text``, a log that other lines may interleave; the main thread marked."""
    threads: list[dict] = []
    current: dict | None = None
    for raw in text.splitlines():
        header = _FAULTHANDLER_THREAD.match(raw)
        if header:
            current = {"name": header.group(2), "main": False, "current": header.group(1) == "Current thread"}
            current["frames"] = []
            threads.append(current)
            continue
        found = _FAULTHANDLER_FRAME.match(raw)
        if found and current is not None:
            line = found.group(2)
            current["frames"].append(frame(found.group(3), found.group(1), int(line) if line.isdigit() else None))
        elif not raw.strip():
            current = None
    _mark_main(threads)
    for thread in threads:
        thread.pop("current", None)
    return threads


def _mark_main(threads: list[dict]) -> None:
    """The main thread: the one whose outermost Python frame is a module's body (a thread that
    ``threading`` started begins in ``_bootstrap``); else the one faulthandler ran in."""
    for thread in threads:
        python = [f for f in thread["frames"] if not f["native"]]
        if python and python[-1]["function"] == "<module>":
            thread["main"] = True
            return
    for thread in threads:
        if thread.get("current") or thread.get("name") == "MainThread":
            thread["main"] = True
            return


def main_frames(stack: dict) -> list[dict]:
    """The frames of the rank's main thread (the first thread where none is marked)."""
    threads = stack.get("threads") or []
    for thread in threads:
        if thread.get("main"):
            return thread.get("frames") or []
    return threads[0].get("frames") or [] if threads else []


def stack_key(stack: dict) -> tuple:
    """What ranks in one group share: the main thread's frames, each as (function, file), the
    native frames that are bare addresses left out; a rank without a stack: its error."""
    if stack.get("error") or not stack.get("threads"):
        return ("error", str(stack.get("error") or "no stack"))
    return tuple((f["function"], short_path(f["file"])) for f in main_frames(stack) if not _is_address(f["function"]))


def headline(frames: Sequence[dict]) -> str:
    """Where a stack is, in words: the innermost Python frame, after the innermost native one
    when the thread is in native code (``sleep [native] < at_step in .../injected_faults.py:190``)."""
    named = [f for f in frames if not _is_address(f["function"])]
    python = next((f for f in named if not f["native"] and short_path(f["file"]) not in PASS_THROUGH), None)
    native = named[0] if named and named[0]["native"] else None
    words = []
    if native is not None:
        words.append(f"{short_function(native['function'])} [native]")
    if python is not None:
        line = f":{python['line']}" if python.get("line") else ""
        words.append(f"{python['function']} in {short_path(python['file'])}{line}")
    return " < ".join(words) or "no Python frames"


def in_collective(frames: Sequence[dict]) -> bool:
    """Whether the thread waits inside torch.distributed (a collective, or FSDP's wait for one)."""
    return any("torch/distributed/" in short_path(f["file"]) for f in frames if not f["native"])


def group_stacks(stacks: Iterable[dict], world_size: int | None = None) -> list[dict]:
    """The ranks with the same stack (:func:`stack_key`) together, the smallest groups first, of
    groups as small those outside torch.distributed first (a rank that never reached the
    collective the others wait in), then by their first rank; each ``{"ranks", "headline",
    "waiting", "frames", "how"}``, ``frames`` the main thread's of the group's first rank, or
    ``{"ranks", "error"}``. Ranks of
    ``range(world_size)`` that have no entry at all form a group of their own."""
    groups: dict[tuple, list[dict]] = {}
    seen: set[int] = set()
    for stack in sorted(stacks, key=lambda s: s["rank"]):
        if stack["rank"] in seen:
            continue
        seen.add(stack["rank"])
        groups.setdefault(stack_key(stack), []).append(stack)
    out = []
    for key, members in groups.items():
        ranks = [m["rank"] for m in members]
        first = members[0]
        if key and key[0] == "error":
            out.append({"ranks": ranks, "error": key[1]})
        else:
            frames = main_frames(first)
            out.append(
                {
                    "ranks": ranks,
                    "headline": headline(frames),
                    "waiting": in_collective(frames),
                    "frames": frames,
                    "how": first.get("how"),
                }
            )
    missing = sorted(set(range(world_size)) - seen) if world_size is not None else []
    if missing:
        out.append(
            {"ranks": missing, "error": "no answer (the rank is not in the job's layout, or its node did not reply)"}
        )
    out.sort(key=lambda g: (len(g["ranks"]), g.get("waiting", False), g["ranks"][0]))
    return out


def group_words(group: dict, world_size: int | None = None) -> str:
    """``ranks 0,2-15 (15 of 16): all_gather_into_tensor in torch/distributed/...:3850``."""
    ranks = group["ranks"]
    label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
    if world_size:
        label += f" ({len(ranks)} of {world_size})"
    what = group.get("headline") or f"no stack: {group.get('error')}"
    return f"{label}: {what}"


def stack_lines(
    groups: Sequence[dict], world_size: int | None = None, *, frames_shown: int = FRAMES_SHOWN
) -> list[str]:
    """Each group's line and its stack below it (innermost first, at most ``frames_shown`` frames)."""
    lines = []
    for group in groups:
        lines.append(group_words(group, world_size))
        frames = [f for f in group.get("frames") or () if not _is_address(f["function"])]
        for f in frames[:frames_shown]:
            where = short_path(f["file"]) + (f":{f['line']}" if f.get("line") else "")
            name = short_function(f["function"]) if f["native"] else f["function"]
            lines.append(f"    {name} ({where})" + (" [native]" if f["native"] else ""))
        if len(frames) > frames_shown:
            lines.append(f"    ... {len(frames) - frames_shown} outer frames")
    return lines


def summary(groups: Sequence[dict], world_size: int | None = None) -> str:
    """The groups in one line, odd ones out first: ``rank 1: sleep ...; ranks 0,2-15: wait ...``."""
    return "; ".join(group_words(g) for g in groups) if groups else "no stacks"


# ---------------------------------------------------------------------- the watchdog's file


def hang_stacks_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / HANG_DIR / HANG_STACKS


def write_hang_stacks(run_dir: str | Path, stacks: Sequence[dict], *, world_size: int, step: int) -> Path:
    """Rank 0's watchdog, when it ends a hung job: every rank's stack that reached it, grouped."""
    path = hang_stacks_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "taken_at": time.time(),
        "step": step,
        "world_size": world_size,
        "groups": group_stacks(stacks, world_size),
        "stacks": list(stacks),
    }
    atomic_write_text(path, json.dumps(record) + "\n")
    return path


def read_hang_stacks(run_dir: str | Path) -> dict | None:
    """The watchdog's last grouped stacks (None: no hang recorded, or a damaged file)."""
    try:
        record = read_json(hang_stacks_path(run_dir), max_bytes=MAX_STACKS_BYTES)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("stacks"), list):
        return None
    try:
        stacks = [s for s in record["stacks"] if _is_stack(s)]
        world = record.get("world_size")
        world = world if isinstance(world, int) and not isinstance(world, bool) and 0 < world < 1 << 24 else None
        return {
            "taken_at": record.get("taken_at"),
            "step": record.get("step"),
            "world_size": world,
            "groups": group_stacks(stacks, world),  # regrouped: the file may be a copy someone edited
        }
    except (KeyError, TypeError, ValueError):
        return None


def _is_stack(stack: object) -> bool:
    if not isinstance(stack, dict):
        return False
    rank = stack.get("rank")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 1 << 24:
        return False
    for thread in stack.get("threads") or ():
        if not isinstance(thread, dict) or not isinstance(thread.get("frames", []), list):
            return False
        for f in thread.get("frames", []):
            if not isinstance(f, dict) or not isinstance(f.get("function"), str) or not isinstance(f.get("file"), str):
                return False
            f.setdefault("native", False)
            f.setdefault("line", None)
    return True


HANG_FRAMES_SHOWN = 4
"""Frames of each group's stack that ``status`` shows of the watchdog's (``hang/stacks.json`` has them all)."""


def _hang_stacks_lines(record: dict | None) -> list[str]:
    if not record or not record["groups"]:
        return []
    groups = stack_lines(record["groups"], record["world_size"], frames_shown=HANG_FRAMES_SHOWN)
    return [f"stacks the watchdog took after step {record['step']} (hpc-hsdp stacks: the ranks' stacks now):"] + [
        terminal_safe(f"  {line}") for line in groups
    ]


HANG_STACKS_SECTION: StatusSection[RunView, dict | None] = StatusSection(
    name="hang-stacks",
    read=lambda view: read_hang_stacks(view.run_dir),
    lines=_hang_stacks_lines,
    fields=lambda record: {"hang_stacks": record},
)
