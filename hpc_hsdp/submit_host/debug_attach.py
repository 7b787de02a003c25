"""``hpc-hsdp debug``: ask a running job to stop one rank in a debugger, and attach to it.

The login side (:func:`request_debugger`) writes ``<run_dir>/debug/request.json``, which the
job's rank 0 takes at its next step boundary (:mod:`hpc_hsdp.task.observation.debugger`), and waits for
the stopped rank's ``debug/session.json``: the node and the Unix socket its pdb listens on. The
terminal is then joined to that socket on the node, through the job's backend
(:meth:`~hpc_hsdp.scheduler.backends.base.Backend.on_node_command`: ``srun --overlap --jobid=J
--nodelist=NODE`` on SLURM, directly on the emulator), by this module run there
(``python -m hpc_hsdp.submit_host.debug_attach SOCKET``): stdin to the socket, the socket to stdout.

Only the job's user attaches: the socket lies in a directory of the node that only they reach
(0700, checked here before connecting, as is the socket's owner), and SLURM runs the
``--overlap`` step for the job's user alone.
"""

from __future__ import annotations

import os
import select
import socket
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hpc_hsdp.errors import HsdpError, SpecError
from hpc_hsdp.rundir.layout import rank_entries
from hpc_hsdp.rundir.observation.debug_session import read_session, request_path, socket_dir_name, write_request
from hpc_hsdp.rundir.training.metrics import last_metrics

STATUS_EVERY_S = 5.0


def attach_argv(socket_path: str) -> list[str]:
    return [sys.executable, "-m", "hpc_hsdp.submit_host.debug_attach", socket_path]


def request_debugger(
    handle,
    *,
    rank: int,
    at_step: int | None,
    timeout_s: float | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """Ask the running job of ``handle`` to stop ``rank`` after step ``at_step`` (None: the next
    boundary); the session once the rank listens (``node``, ``socket``, ``step``)."""
    record = handle.record
    state = handle.status()
    if state.finished:
        raise HsdpError(f"job {record.job_id} is not running ({state.state}); nothing to debug")
    world = len(rank_entries(record.run_dir) or ())
    if world == 0:
        raise HsdpError(f"job {record.job_id} has not started its ranks yet (no layout.json); try again in a moment")
    if not 0 <= rank < world:
        raise SpecError(f"--rank {rank} is not a rank of job {record.job_id}; give 0 to {world - 1}")
    last = (last_metrics(record.run_dir) or {}).get("step")
    if at_step is not None and isinstance(last, int) and at_step <= last:
        raise SpecError(f"--at-step {at_step}: job {record.job_id} has done step {last} already; give a later step")
    request_id = write_request(record.run_dir, rank=rank, at_step=at_step)
    say(
        f"asked job {record.job_id}: rank {rank} stops after step {at_step if at_step is not None else last or 0}"
        + ("" if at_step is not None else " or the next one")
        + "; waiting for it (Ctrl-C: withdraw)"
    )
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    checked = time.monotonic()
    try:
        while True:
            session = read_session(record.run_dir, request_id)
            if session is not None and session["state"] == "waiting":
                return session
            if session is not None:
                raise HsdpError(f"the debugger of rank {rank} is no longer waiting ({session['state']})")
            if deadline is not None and time.monotonic() > deadline:
                raise HsdpError(f"rank {rank} did not stop within {timeout_s:.0f} s; the request is withdrawn")
            if time.monotonic() - checked > STATUS_EVERY_S:
                checked = time.monotonic()
                if handle.status().finished:
                    raise HsdpError(f"job {record.job_id} ended before rank {rank} stopped")
            time.sleep(0.2)
    except BaseException:
        request_path(record.run_dir).unlink(missing_ok=True)  # not taken yet: withdrawn
        raise


# ---------------------------------------------------------------------- on the node


def check_socket(path: str) -> str | None:
    """Why ``path`` is not a debugger socket of this user (None: it is)."""
    socket_path = Path(path)
    uid = os.getuid()
    if socket_path.parent.name != socket_dir_name(uid):
        return f"{path} is not in a directory {socket_dir_name(uid)} of this user"
    try:
        folder, found = os.lstat(socket_path.parent), os.lstat(socket_path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc} (the session ended?)"
    if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != uid or stat.S_IMODE(folder.st_mode) & 0o077:
        return f"{socket_path.parent} is not a directory of this user that only they reach"
    if not stat.S_ISSOCK(found.st_mode) or found.st_uid != uid:
        return f"{path} is not a socket of this user"
    return None


def pump(connection: socket.socket, stdin_fd: int, stdout_fd: int) -> None:
    """Copy ``stdin_fd`` to the connection and the connection to ``stdout_fd`` until the rank
    closes it. The end of stdin only half-closes it: what was typed is still answered."""
    reading: list[socket.socket | int] = [connection, stdin_fd]
    while True:
        ready, _, _ = select.select(reading, [], [])
        if connection in ready:
            data = connection.recv(65536)
            if not data:
                return
            os.write(stdout_fd, data)
        if stdin_fd in ready:
            data = os.read(stdin_fd, 65536)
            if data:
                connection.sendall(data)
            else:
                reading.remove(stdin_fd)
                connection.shutdown(socket.SHUT_WR)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m hpc_hsdp.submit_host.debug_attach SOCKET", file=sys.stderr)
        return 2
    refused = check_socket(args[0])
    if refused:
        print(f"hpc-hsdp debug: {refused}", file=sys.stderr)
        return 2
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        try:
            connection.connect(args[0])
        except OSError as exc:
            print(f"hpc-hsdp debug: cannot connect to {args[0]} ({exc.strerror or exc})", file=sys.stderr)
            return 1
        pump(connection, sys.stdin.fileno(), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
