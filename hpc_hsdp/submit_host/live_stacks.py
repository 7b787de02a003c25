"""``hpc-hsdp stacks``: every rank's stack of a running job, taken without stopping it.

The login side (:func:`collect_stacks`) reads the ranks' nodes and process ids from the run's
``layout.json`` and asks the job's backend to run this module once on each of the job's nodes
(``srun --overlap --jobid=J`` on SLURM, a plain process on the emulator, whose ranks are
processes of this machine). On a node (``python -m hpc_hsdp.submit_host.live_stacks``), for each of the
job's ranks there, in parallel:

1. the process is checked: it is this user's and its environment names the job (a run
   directory may be writable by others: a process id read from it is not taken on trust);
2. ``py-spy dump --json --native`` (Python and native frames; ``--native`` dropped where it
   fails, e.g. a Python py-spy cannot unwind); the rank allowed a same-user tracer at start-up
   (:func:`hpc_hsdp.task.parallelism.dist.allow_same_user_tracer`), so yama's ``ptrace_scope=1`` lets it in;
3. where py-spy is missing or cannot attach: ``kill -QUIT``, on which every rank prints its
   Python stacks (faulthandler, :data:`hpc_hsdp.task.parallelism.dist.STACK_DUMP_SIGNAL`) to its stderr,
   read back from the file behind the process's fd 2 (its log).

The node prints one line, ``hpc-hsdp-stacks {"node": ..., "stacks": [...]}``, in the format
:mod:`hpc_hsdp.rundir.observation.stacks` names and groups. py-spy stops a rank for the few milliseconds
of a dump (``--nonblocking`` would not, and could read torn stacks); nothing else touches it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpc_hsdp.errors import HsdpError
from hpc_hsdp.rundir.layout import rank_entries
from hpc_hsdp.rundir.observation.stacks import threads_from_faulthandler, threads_from_py_spy

MARKER = "hpc-hsdp-stacks "
PY_SPY_TIMEOUT_S = 20.0
FAULTHANDLER_WAIT_S = 3.0
"""How long a rank has to print its stacks after ``kill -QUIT``."""
MAX_STDERR_READ = 4 << 20
PARALLEL = 16


# ---------------------------------------------------------------------- the login side


def stack_targets(run_dir: str | Path) -> list[dict]:
    """``{"rank", "node", "pid"}`` of every rank that ``layout.json`` names with a process id."""
    entries = rank_entries(run_dir)
    if entries is None:
        raise HsdpError(
            f"{run_dir} has no readable layout.json: the job has not started its ranks yet "
            "(wait until `hpc-hsdp status` shows a step)"
        )
    targets = []
    for entry in entries:
        pid = entry.get("pid")
        if isinstance(pid, int) and not isinstance(pid, bool) and 1 < pid < 1 << 31:
            targets.append({"rank": entry["rank"], "node": str(entry.get("node", "")), "pid": pid})
    if not targets:
        raise HsdpError(f"{run_dir}/layout.json names no process ids (a job started by an older hpc-hsdp)")
    return targets


def node_argv(
    job_id: str, targets: Sequence[dict], *, native: bool, this_node_only: bool, py_spy: bool = True
) -> list[str]:
    """What runs on each node: this module with the job's ranks (all, or only the node's own)."""
    argv = [
        sys.executable,
        "-m",
        "hpc_hsdp.submit_host.live_stacks",
        "--job",
        str(job_id),
        "--targets",
        json.dumps(targets),
    ]
    if native:
        argv.append("--native")
    if not py_spy:
        argv.append("--no-py-spy")
    if this_node_only:
        argv.append("--this-node-only")
    return argv


LINE_CHUNK = 512
"""Characters of a node's answer per output line: srun forwards the tasks' output in pieces and
interleaves the nodes' pieces, splitting a longer line (a node's whole answer, tens of KiB)."""


def answer_lines(answer: dict) -> list[str]:
    """A node's answer as lines ``MARKER ID I N CHUNK`` of at most :data:`LINE_CHUNK` characters of
    its JSON each, which :func:`parse_node_output` puts back together whatever their order."""
    text = json.dumps(answer)
    token = secrets.token_hex(8)
    chunks = [text[at : at + LINE_CHUNK] for at in range(0, len(text), LINE_CHUNK)] or [""]
    return [f"{MARKER}{token} {i} {len(chunks)} {chunk}" for i, chunk in enumerate(chunks)]


def parse_node_output(text: str) -> list[dict]:
    """The stacks of every node's answer in the combined output of the nodes (:func:`answer_lines`);
    an answer with a piece missing or torn is left out."""
    pieces: dict[str, dict[int, str]] = {}
    counts: dict[str, int] = {}
    for line in text.splitlines():
        at = line.find(MARKER)
        if at < 0:
            continue
        parts = line[at + len(MARKER) :].split(" ", 3)
        if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit():
            continue
        token, index, count, chunk = parts[0], int(parts[1]), int(parts[2]), parts[3]
        if counts.setdefault(token, count) != count or index >= count:
            continue
        pieces.setdefault(token, {})[index] = chunk
    stacks: list[dict] = []
    for token, got in pieces.items():
        if len(got) != counts[token]:
            continue
        try:
            answer = json.loads("".join(got[i] for i in range(counts[token])))
        except ValueError:
            continue
        if isinstance(answer, dict) and isinstance(answer.get("stacks"), list):
            stacks.extend(s for s in answer["stacks"] if isinstance(s, dict) and isinstance(s.get("rank"), int))
    return stacks


def collect_stacks(
    handle, *, native: bool = True, py_spy: bool = True, timeout_s: float = 60.0
) -> tuple[list[dict], int | None]:
    """Every rank's stack of the running job of ``handle`` (a :class:`~hpc_hsdp.submit_host.handle.JobHandle`)
    and the job's world size; HsdpError when the job does not run or its nodes did not answer.
    ``py_spy=False``: the Python stacks the ranks print on ``kill -QUIT`` only."""
    record = handle.record
    state = handle.status()
    if state.finished:
        raise HsdpError(
            f"job {record.job_id} is not running ({state.state}); "
            f"`hpc-hsdp status {record.run_dir}` shows the stacks its watchdog took, if it took any"
        )
    targets = stack_targets(record.run_dir)
    world = len(rank_entries(record.run_dir) or ())
    backend = handle.backend
    nodes = sorted({t["node"] for t in targets})
    argv = node_argv(record.job_id, targets, native=native, this_node_only=backend.separate_machines, py_spy=py_spy)
    out, said = backend.run_on_nodes(record, nodes, argv, timeout_s=timeout_s)
    stacks = parse_node_output(out)
    if not stacks:
        raise HsdpError(
            f"no node of job {record.job_id} answered with stacks: {' '.join(said.split())[:300] or 'no output'}"
        )
    return stacks, world


# ---------------------------------------------------------------------- on a node


def _environment(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        data = f.read(1 << 20)
    out = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def check_process(pid: int, job_id: str) -> str | None:
    """Why ``pid`` is not a rank of job ``job_id`` run by this user (None: it is)."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return f"process {pid} belongs to another user: only the job's user may take its stacks"
        env = _environment(pid)
    except FileNotFoundError:
        return f"process {pid} has ended (the rank exited, or the job restarted since layout.json was written)"
    except OSError as exc:
        return f"process {pid} cannot be read ({exc.strerror or exc})"
    if job_id not in (env.get("SLURM_JOB_ID"), env.get("SLURM_JOBID")):
        return f"process {pid} is not a task of job {job_id} (its process id was reused)"
    return None


def py_spy_path() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which("py-spy")


def py_spy_stack(py_spy: str, pid: int, *, native: bool) -> tuple[list[dict] | None, str, str]:
    """(threads, how, why not) by ``py-spy dump``; native first, then without where that failed."""
    said = ""
    for with_native in (True, False) if native else (False,):
        argv = [py_spy, "dump", "--json", "--pid", str(pid)] + (["--native"] if with_native else [])
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            said = f"py-spy did not answer within {PY_SPY_TIMEOUT_S:.0f} s"
            continue
        except OSError as exc:
            return None, "", f"py-spy cannot run ({exc.strerror or exc})"
        if proc.returncode == 0:
            try:
                return (
                    threads_from_py_spy(json.loads(proc.stdout), pid),
                    "py-spy --native" if with_native else "py-spy",
                    "",
                )
            except ValueError as exc:
                said = f"py-spy's answer unreadable ({exc})"
                continue
        said = " ".join((proc.stderr or proc.stdout).split())[:300] or f"py-spy exited with {proc.returncode}"
    return None, "", said


def faulthandler_stack(pid: int) -> tuple[list[dict] | None, str]:
    """(threads, why not) from the stacks the rank prints to its stderr on ``kill -QUIT``."""
    try:
        log = os.readlink(f"/proc/{pid}/fd/2")
    except OSError as exc:
        return None, f"its stderr cannot be found ({exc.strerror or exc})"
    if not log.startswith("/") or not os.path.isfile(log):
        return None, f"its stderr is {log}, not a file to read its Python stacks from"
    start = os.path.getsize(log)
    os.kill(pid, signal.SIGQUIT)
    deadline, size, still_since = time.monotonic() + FAULTHANDLER_WAIT_S, start, None
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = os.path.getsize(log)
        if now != size:
            size, still_since = now, time.monotonic()
        elif still_since is not None and time.monotonic() - still_since > 0.2:
            break
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read(min(MAX_STDERR_READ, max(0, size - start))).decode(errors="replace")
    threads = threads_from_faulthandler(text)
    return (threads, "") if threads else (None, "no stacks appeared in its stderr after kill -QUIT")


def rank_stack(target: Mapping, job_id: str, *, native: bool, py_spy: str | None) -> dict:
    """One rank's stack on this node (see the module docstring)."""
    pid = int(target["pid"])
    stack = {"rank": target["rank"], "node": target.get("node"), "pid": pid, "how": None, "threads": [], "error": None}
    refused = check_process(pid, job_id)
    if refused:
        stack["error"] = refused
        return stack
    why = "not installed (pip install 'hpc-hsdp[debug]')" if py_spy is None else ""
    if py_spy is not None:
        threads, how, why = py_spy_stack(py_spy, pid, native=native)
        if threads is not None:
            stack.update(threads=threads, how=how)
            return stack
    threads, why_not = faulthandler_stack(pid)
    if threads is not None:
        stack.update(threads=threads, how="faulthandler", note=f"py-spy: {why}")
    else:
        stack["error"] = f"py-spy: {why}; kill -QUIT: {why_not}"
    return stack


def node_stacks(
    targets: Sequence[Mapping], job_id: str, *, native: bool, node: str | None, use_py_spy: bool = True
) -> list[dict]:
    mine = [t for t in targets if node is None or t.get("node") == node]
    py_spy = py_spy_path() if use_py_spy else None
    with ThreadPoolExecutor(max_workers=max(1, min(PARALLEL, len(mine)))) as pool:
        taken = list(pool.map(lambda t: rank_stack(t, job_id, native=native, py_spy=py_spy), mine))
    if not use_py_spy:
        for stack in taken:
            stack.pop("note", None)
    return taken


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_hsdp.submit_host.live_stacks")
    parser.add_argument("--job", required=True)
    parser.add_argument("--targets", required=True, help="JSON: [{rank, node, pid}, ...]")
    parser.add_argument("--native", action="store_true")
    parser.add_argument("--no-py-spy", action="store_true", help="kill -QUIT's Python stacks only")
    parser.add_argument("--this-node-only", action="store_true", help="only the ranks of SLURMD_NODENAME")
    args = parser.parse_args(argv)
    try:
        targets = json.loads(args.targets)
        if not isinstance(targets, list) or not all(
            isinstance(t, dict) and isinstance(t.get("rank"), int) and isinstance(t.get("pid"), int) for t in targets
        ):
            raise ValueError("not a list of {rank, node, pid}")
    except ValueError as exc:
        print(f"--targets: {exc}", file=sys.stderr)
        return 2
    node = os.environ.get("SLURMD_NODENAME") if args.this_node_only else None
    stacks = node_stacks(targets, args.job, native=args.native, node=node, use_py_spy=not args.no_py_spy)
    print("\n".join(answer_lines({"node": node, "stacks": stacks})), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
