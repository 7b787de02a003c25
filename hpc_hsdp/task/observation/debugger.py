"""``hpc-hsdp debug RUN_DIR --rank K [--at-step N]`` on the ranks: rank K stops at a step boundary
in pdb, reachable from the login node, while every other rank waits at the same boundary.

The request reaches the job through the step boundary's existing stop agreement: rank 0 takes
``<run_dir>/debug/request.json`` (:mod:`hpc_hsdp.rundir.observation.debug_session`; looked for at most once
a second) and, at the requested step, adds ``K + 1`` to its stop code
(:data:`~hpc_hsdp.task.resilience.preemption.STOP_CODE_SPAN`), which the built-in step's fused all_reduce
and an own loop's ``agree_stop`` carry to every rank. At that boundary (:meth:`DebugPoint.pause`),
with the hang watchdog paused on every rank:

- rank K listens on a Unix socket in a directory of its node that only the job's user reaches
  (``<tmp>/hpc-hsdp-debug-<uid>/``), writes where to ``debug/session.json`` and serves one pdb
  session on it (``hpc-hsdp debug`` connects through ``srun --overlap`` or, on the emulator,
  directly); ``c`` (continue) resumes, ``q`` (quit, or the connection's end) ends the job;
- the others wait for its outcome in the job's TCP store (no collective: a session may last
  longer than the process group's timeout);
- every rank then goes on with the same state: continuing gives the losses of a run without
  the debugger; quitting stops every rank after that step as a requested stop does (a
  checkpoint, then a clean end).
"""

from __future__ import annotations

import bdb
import json
import os
import pdb
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from torch.distributed.distributed_c10d import _get_default_store

from hpc_hsdp.files import private_dir
from hpc_hsdp.rundir.observation.debug_session import socket_dir_name, take_request, write_session
from hpc_hsdp.task.observation.log import note

CHECK_EVERY_S = 1.0
"""How often rank 0 looks for a request (one stat of the run directory)."""
ATTACH_WAIT_S = 600.0
"""How long the stopped rank waits for ``hpc-hsdp debug`` to connect before it goes on."""
QUIT = "quit"
CONTINUE = "continue"


class DebugPoint:
    """The ranks' side of ``hpc-hsdp debug`` (see the module docstring); one per engine."""

    def __init__(self, ctx, *, env=None) -> None:
        self.ctx = ctx
        env = os.environ if env is None else env
        self._prefix = f"hpc-hsdp/debug/{env.get('SLURM_JOB_ID', 'job')}/{env.get('SLURM_RESTART_COUNT', '0')}/"
        self._pending: dict | None = None
        self._looked = 0.0
        self.sessions = 0

    # ------------------------------------------------------------------ rank 0, before the agreement

    def request_code(self, step: int) -> int:
        """Rank 0, in step ``step`` before its agreement: K + 1 when rank K is to stop after this
        step, else 0 (every other rank: 0)."""
        if self.ctx.rank != 0 or self.ctx.run_dir is None:
            return 0
        now = time.monotonic()
        if self._pending is None and now - self._looked >= CHECK_EVERY_S:
            self._looked = now
            self._pending = take_request(self.ctx.run_dir, world_size=self.ctx.world_size)
        pending = self._pending
        if pending is None or (pending["at_step"] is not None and step < pending["at_step"]):
            return 0
        return pending["rank"] + 1

    # ------------------------------------------------------------------ every rank, at the boundary

    def pause(self, step: int, rank: int, watchdog=None) -> str:
        """Collective in effect (through the store): rank ``rank`` debugs, the others wait;
        :data:`CONTINUE` or :data:`QUIT` on every rank."""
        store = _get_default_store()
        key = f"{self._prefix}{step}/"
        if watchdog is not None:
            watchdog.paused = True
        try:
            if self.ctx.rank == 0:
                request, self._pending = self._pending or {"id": "", "rank": rank, "at_step": None}, None
                store.set(key + "request", json.dumps(request))
            if self.ctx.rank == rank:
                request = json.loads(store.get(key + "request"))
                outcome = self._serve(step, request)
                store.set(key + "outcome", outcome)
            else:
                while not store.check([key + "outcome"]):
                    time.sleep(0.2)
                outcome = store.get(key + "outcome").decode()
        finally:
            if watchdog is not None:
                watchdog.step_done(step)  # the time in the debugger is no hang
                watchdog.paused = False
        self.sessions += 1
        if self.ctx.rank == 0:
            note(
                f"debugger of rank {rank} after step {step}: {outcome}"
                + ("; every rank stops" if outcome == QUIT else "")
            )
        return outcome

    def _serve(self, step: int, request: dict) -> str:
        run_dir, rank = self.ctx.run_dir, self.ctx.rank
        directory = private_dir(Path(tempfile.gettempdir()) / socket_dir_name(os.getuid()))
        path = directory / f"{os.getpid()}-rank{rank}.sock"
        path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        node = getattr(self.ctx.layout, "node", None) or socket.gethostname()
        session = {"id": request.get("id", ""), "rank": rank, "node": node, "socket": str(path), "step": step}
        try:
            server.bind(str(path))
            os.chmod(path, 0o600)
            server.listen(1)
            server.settimeout(ATTACH_WAIT_S)
            write_session(run_dir, {**session, "state": "waiting"})
            note(
                f"debugger: rank {rank} stopped after step {step}; pdb on {path} (node {node}): hpc-hsdp debug attaches"
            )
            try:
                connection, _ = server.accept()
            except TimeoutError:
                note(f"debugger: nobody attached within {ATTACH_WAIT_S:.0f} s; every rank goes on")
                write_session(run_dir, {**session, "state": CONTINUE})
                return CONTINUE
            write_session(run_dir, {**session, "state": "attached"})
            with connection:
                outcome = run_pdb(connection, rank=rank, world=self.ctx.world_size, step=step)
            write_session(run_dir, {**session, "state": outcome})
            return outcome
        finally:
            server.close()
            path.unlink(missing_ok=True)


def run_pdb(connection: socket.socket, *, rank: int, world: int, step: int) -> str:
    """One pdb session on ``connection``, in the caller's frames (``up`` reaches the loop):
    :data:`CONTINUE` after ``c``, :data:`QUIT` after ``q`` or the connection's end."""
    # a reader and a writer of their own: one text file for both drops what it read ahead on each write
    reader = connection.makefile("r", encoding="utf-8", errors="replace", newline="\n")
    stream = connection.makefile("w", buffering=1, encoding="utf-8", errors="replace", newline="\n")
    debugger = pdb.Pdb(stdin=reader, stdout=stream, nosigint=True, readrc=False)
    debugger.use_rawinput = False
    debugger.prompt = f"(Pdb rank {rank}) "
    stream.write(
        f"rank {rank} of {world} stopped after step {step}; the other ranks wait at the same boundary.\n"
        "'up' reaches the training loop; 'c' resumes every rank, 'q' ends the job (every rank saves and stops).\n"
    )
    outcome = QUIT
    try:
        debugger.set_trace(sys._getframe())
        outcome = CONTINUE  # pdb stops here
    except bdb.BdbQuit:
        outcome = QUIT
    finally:
        sys.settrace(None)
        threading.settrace(None)
        for file in (stream, reader):  # the connection closes only once its files are closed too
            try:
                file.close()
            except OSError:
                pass
    return outcome
