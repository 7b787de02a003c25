"""A watchdog on every rank: a job whose ranks stop making progress ends instead of burning
its allocation until the time limit.

A rank that hangs (stuck in a data read, a deadlock, a GPU that stopped answering) leaves
the others waiting in the next collective until the process-group timeout, often 30 minutes
or more. :class:`Watchdog` is a thread per rank. The loop calls ``step_done(step)`` after
every step; when no step completes within the hang timeout (``--hang-timeout``; 0: 20 times
the median step time seen so far, at least ``HANG_TIMEOUT_FLOOR_S``), every rank, from its
watchdog thread:

1. writes the Python stacks of all its threads to its log (faulthandler), and sends them to rank 0
   in its report (below), which writes every rank's, grouped, to ``<run_dir>/hang/stacks.json``
   (:mod:`hpc_hsdp.rundir.observation.stacks`: ``status`` shows the groups, the odd ones out first); on GPU also the
   NCCL flight recorder's trace to ``<run_dir>/hang/nccl-trace-rank<N>.pkl``: ``init``
   turns the recorder on for NCCL groups unless the job sets ``TORCH_FR_BUFFER_SIZE``);
2. publishes where it is through the job's TCP store (which works while every collective
   hangs): last step completed, collectives entered by the main thread (counted by a listener
   on :mod:`hpc_hsdp.task.observation.collectives`, the one wrapper of each torch.distributed collective);
3. rank 0 collects them and prints ONE line: the step, the ranks waiting in collective #N and
   the ranks that never reached it, and on NCCL what the flight recorder's dumps say
   (:func:`hpc_hsdp.rundir.observation.flight_recorder.hang_words`: the op, the mesh axis, the sequence
   number, the ranks waiting in it and the ranks that never entered it); it records the hang in ``<run_dir>/restarts.jsonl``
   (cause of the restart) and, inside SLURM and within ``--max-restarts``, requeues the job
   (``scontrol requeue``), which resumes from the newest complete checkpoint;
4. every rank exits with :data:`EXIT_HUNG` (its main thread is stuck; nothing else can end it).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from hpc_hsdp.errors import HsdpError
from hpc_hsdp.files import write_atomically
from hpc_hsdp.job.training_sections import ResilienceSection
from hpc_hsdp.rundir.observation.flight_recorder import HANG_DIR, TRACE_PREFIX, hang_words
from hpc_hsdp.rundir.observation.stacks import frame, write_hang_stacks
from hpc_hsdp.scheduler.backends import task_environment
from hpc_hsdp.scheduler.restart_policy import RestartPolicy
from hpc_hsdp.task.observation.collectives import COLLECTIVES, Listening, listen
from hpc_hsdp.task.observation.log import note
from hpc_hsdp.task.resilience.node_failure import handle_lost_peers

HANG_TIMEOUT_FLOOR_S = 120.0
HANG_TIMEOUT_STEP_FACTOR = 20
EXIT_HUNG = 86
"""Exit status of every task of a job its watchdog ended."""
GATHER_S = 10.0
"""How long rank 0 waits for the other ranks' reports after its own timer fired."""

ENDING = threading.Event()
"""Set when this process's watchdog decided to end the job: an error the main thread gets
meanwhile (a peer that already exited) must not end the task before the watchdog does."""


class CollectiveCounter:
    """Counts the collectives the main thread enters (another thread's, e.g. a background
    checkpoint's, would not be in the same order on every rank)."""

    def __init__(self) -> None:
        self.entered = 0
        self.last_kind: str | None = None
        self._main = threading.main_thread().ident
        self._listening: Listening | None = None

    def install(self) -> CollectiveCounter:
        if self._listening is None:
            self._listening = listen(self._entered, names=COLLECTIVES)
        return self

    def _entered(self, name: str, args: tuple, kwargs: dict) -> None:
        if threading.get_ident() == self._main:
            self.entered += 1
            self.last_kind = name

    def uninstall(self) -> None:
        if self._listening is not None:
            self._listening.close()
            self._listening = None


def describe_hang(reports: Mapping[int, dict], world_size: int, *, timeout_s: float) -> str:
    """The one line for a hang, from the ranks' reports (pure). A report: ``step`` (last
    completed), ``collectives`` (entered by the main thread), ``kind`` (the last one's name),
    ``waiting`` (the main thread is inside torch.distributed) and ``where`` (its innermost
    frame). A rank without a report did not answer (dead, or frozen with the interpreter)."""
    silent = sorted(set(range(world_size)) - set(reports))
    if not reports:
        return f"hang: no step completed within {timeout_s:.0f} s and no rank reported"
    step = min(r["step"] for r in reports.values()) + 1
    waiting = sorted(rank for rank, r in reports.items() if r.get("waiting", True))
    elsewhere = sorted(rank for rank, r in reports.items() if not r.get("waiting", True))
    line = f"hang at step {step}: no step completed within {timeout_s:.0f} s; "
    if waiting:
        furthest = max(reports[rank]["collectives"] for rank in waiting)
        kind = next((reports[rank].get("kind") for rank in waiting if reports[rank]["collectives"] == furthest), None)
        line += (
            f"ranks {_ranks(waiting)} wait in a collective (furthest: #{furthest}" + (f" {kind}" if kind else "") + ")"
        )
    parts = []
    if elsewhere:
        where = "; ".join(
            f"rank {rank} at {reports[rank]['where']}" for rank in elsewhere[:4] if reports[rank].get("where")
        )
        parts.append(f"ranks {_ranks(elsewhere)} never reached it" + (f" ({where})" if where else ""))
    if silent:
        parts.append(f"ranks {_ranks(silent)} did not answer (dead or frozen)")
    if parts:
        line += ("; " if waiting else "") + "; ".join(parts)
    else:
        line += " (every rank: a collective that never completes, a network or GPU fault)"
    return line


def _ranks(ranks: list[int]) -> str:
    """``0-2,5`` for [0, 1, 2, 5]."""
    out, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            out.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(out)


def main_thread_position() -> tuple[bool, str | None]:
    """Whether the main thread is inside torch.distributed (waiting in a collective, or in
    FSDP's wait for one), and its innermost frame as ``file.py:LINE in function``."""
    main = threading.main_thread().ident
    frame = sys._current_frames().get(main) if main is not None else None
    if frame is None:
        return False, None
    where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"
    waiting = False
    while frame is not None:
        if f"{os.sep}torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename:
            waiting = True
            break
        frame = frame.f_back
    return waiting, where


def python_threads() -> list[dict]:
    """Every thread's Python stack in this process, innermost frame first, the main thread marked
    (the format of :mod:`hpc_hsdp.rundir.observation.stacks`)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    main = threading.main_thread().ident
    threads: list[dict] = []
    for ident, top in sys._current_frames().items():
        frames: list[dict] = []
        current: FrameType | None = top
        while current is not None:
            code = current.f_code
            frames.append(frame(getattr(code, "co_qualname", code.co_name), code.co_filename, current.f_lineno))
            current = current.f_back
        threads.append({"name": names.get(ident, str(ident)), "main": ident == main, "frames": frames})
    return threads


def hang_timeout(configured: float, step_times: list[float]) -> float:
    """The timeout in effect: ``configured`` when > 0, else 20x the median step time so far,
    at least the floor. Until the run's first step completed (start-up, warm-up, the first
    batches) the floor applies to a smaller ``configured`` too."""
    if configured > 0:
        return configured if step_times else max(configured, HANG_TIMEOUT_FLOOR_S)
    typical = statistics.median(step_times) if step_times else 0.0
    return max(HANG_TIMEOUT_FLOOR_S, HANG_TIMEOUT_STEP_FACTOR * typical)


def wait_if_ending(limit_s: float = 3 * GATHER_S + 30) -> None:
    """Called by the task on an error: when the watchdog is ending the job, let it finish (it
    exits the process with EXIT_HUNG) instead of ending the task with a peer's disappearance."""
    if ENDING.is_set():
        time.sleep(limit_s)


def check_restart_budget(ctx, *, max_restarts: int, env: Mapping[str, str]) -> None:
    """Collective. Raise HsdpError on every rank when this job's restarts after failures
    (restarts.jsonl: hang, node failure, killed, error) exceed ``max_restarts``."""
    verdict: list[str | None] = [None]
    if ctx.rank == 0:
        verdict[0] = RestartPolicy(task_environment(env), run_dir=ctx.run_dir, max_restarts=max_restarts).exceeded()
    if dist.is_initialized() and ctx.world_size > 1:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise HsdpError(verdict[0])


class Watchdog:
    """See the module docstring. ``start()`` after the process group exists, ``step_done(step)``
    after every step, ``stop()`` before anything that may legitimately take long (the final
    save) and at the end."""

    def __init__(
        self,
        ctx,
        *,
        timeout_s: float = 0.0,
        max_restarts: int = 0,
        env: Mapping[str, str] | None = None,
        exit_fn=os._exit,
    ) -> None:
        self.ctx = ctx
        self.configured = float(timeout_s)
        self.max_restarts = max_restarts
        self.env = dict(os.environ if env is None else env)
        self.exit_fn = exit_fn
        self.counter = CollectiveCounter()
        self.last_step = 0
        self.last_progress = time.monotonic()
        self.step_times: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.Store | None = None
        self._prefix = ""
        self.paused = False
        """True while every rank waits at a boundary on purpose (``hpc-hsdp debug``): no hang."""
        self.busy: Callable[[], bool] | None = None
        """While this answers True the rank is legitimately busy (``--compile``'s compiler
        running): no hang, and the time does not count toward the timeout."""

    # ------------------------------------------------------------------ the loop's side

    @classmethod
    def for_run(
        cls, ctx, resilience: ResilienceSection, *, step: int = 0, env: Mapping[str, str] | None = None
    ) -> Watchdog:
        """Collective: record why this run is a restart when nobody did, refuse to train past
        ``--max-restarts`` failure restarts, and start the watchdog at ``step``."""
        env = dict(os.environ if env is None else env)
        check_restart_budget(ctx, max_restarts=resilience.max_restarts, env=env)
        return cls(ctx, timeout_s=resilience.hang_timeout, max_restarts=resilience.max_restarts, env=env).start(
            step=step
        )

    def start(self, *, step: int = 0) -> Watchdog:
        self.last_step = step
        self.last_progress = time.monotonic()
        environment = task_environment(self.env)
        self._prefix = f"hpc-hsdp/watchdog/{environment.job_id or 'job'}/{environment.restart_count}/"
        try:
            self._store = _get_default_store()
        except (RuntimeError, ValueError):
            self._store = None
        self.counter.install()
        self._thread = threading.Thread(target=self._watch, name="hpc-hsdp-watchdog", daemon=True)
        self._thread.start()
        return self

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        if step > self.last_step:
            self.step_times.append(now - self.last_progress)
            del self.step_times[:-50]
        self.last_step = step
        self.last_progress = now

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.counter.uninstall()

    @property
    def timeout_s(self) -> float:
        return hang_timeout(self.configured, self.step_times)

    # ------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, max(0.05, self.timeout_s / 10))):
            busy = self.busy
            if self.paused or (busy is not None and busy()):
                self.last_progress = max(self.last_progress, time.monotonic())
                continue
            if time.monotonic() - self.last_progress > self.timeout_s:
                self._hung()
                return

    def _report(self) -> dict:
        waiting, where = main_thread_position()
        return {
            "step": self.last_step,
            "collectives": self.counter.entered,
            "kind": self.counter.last_kind,
            "waiting": waiting,
            "where": where,
            "node": getattr(self.ctx.layout, "node", None),
            "pid": os.getpid(),
            "threads": python_threads(),
        }

    def _hung(self) -> None:
        ENDING.set()
        rank, world = self.ctx.rank, self.ctx.world_size
        timeout = self.timeout_s
        note(
            f"watchdog: rank {rank}: no step completed for {time.monotonic() - self.last_progress:.0f} s "
            f"(timeout {timeout:.0f} s) after step {self.last_step}; Python stacks of every thread follow"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        self._dump_nccl_trace(rank)
        reports = {rank: self._report()}
        store = self._store
        if store is not None:
            try:
                store.set(self._prefix + f"rank{rank}", json.dumps(reports[rank]))
            except Exception as exc:  # noqa: BLE001 - the store may be gone with rank 0
                note(f"watchdog: rank {rank}: cannot reach the job's store ({exc})")
                store = None
        verdict = None
        if rank == 0:
            reports.update(self._collect(store, world, rank))  # a rank reports after it wrote its NCCL trace
            self._record_stacks(reports, world)
            verdict = describe_hang(reports, world, timeout_s=timeout)
            recorded = self._flight_recorder_finding()
            if recorded:
                verdict = f"{verdict}; {recorded}"
            lost = self._lost_peers(verdict) if len(reports) < world else None
            if lost is not None:  # a node died with the silent ranks: requeued without it
                verdict = lost
            else:
                verdict = f"{verdict}; {self._requeue_and_record(verdict)}"
                note(f"{verdict}")
            if store is not None:
                try:
                    store.set(self._prefix + "verdict", verdict)
                    # rank 0's process holds the job's store: stay until the others have read the verdict
                    self._collect(store, world, rank, key="read")
                except Exception:  # noqa: BLE001
                    pass
        elif store is not None:
            verdict = self._wait_verdict(store)
            note(f"watchdog: rank {rank}: stacks above; " + (verdict or "rank 0 did not answer"))
            if verdict is None:  # rank 0 is gone: perhaps with its node
                self._lost_peers(f"hang after step {self.last_step}: rank 0 did not answer the watchdog")
            with contextlib.suppress(Exception):
                store.set(self._prefix + f"read{rank}", "1")
        else:
            self._lost_peers(f"hang after step {self.last_step}: the job's store is unreachable")
        self.exit_fn(EXIT_HUNG)

    def _collect(self, store, world: int, me: int, *, key: str = "rank") -> dict[int, dict]:
        """The other ranks' ``<key><rank>`` entries that appear within GATHER_S."""
        found: dict[int, dict] = {}
        if store is None:
            return found
        deadline = time.monotonic() + GATHER_S
        while time.monotonic() < deadline and len(found) < world - 1:
            for other in range(world):
                if other == me or other in found:
                    continue
                name = self._prefix + f"{key}{other}"
                try:
                    if store.check([name]):
                        found[other] = json.loads(store.get(name))
                except Exception:  # noqa: BLE001
                    return found
            time.sleep(0.2)
        return found

    def _record_stacks(self, reports: Mapping[int, dict], world: int) -> None:
        """Every reporting rank's stack, grouped, in ``<run_dir>/hang/stacks.json`` (for ``status``)."""
        if self.ctx.run_dir is None:
            return
        stacks = [
            {"rank": rank, "node": r.get("node"), "pid": r.get("pid"), "how": "watchdog", "threads": r.get("threads")}
            for rank, r in reports.items()
            if r.get("threads")
        ]
        try:
            write_hang_stacks(self.ctx.run_dir, stacks, world_size=world, step=self.last_step)
        except Exception as exc:  # noqa: BLE001 - the watchdog must still end the job
            note(f"watchdog: the ranks' stacks could not be written ({exc})")

    def _wait_verdict(self, store) -> str | None:
        deadline = time.monotonic() + GATHER_S + 10
        key = self._prefix + "verdict"
        while time.monotonic() < deadline:
            try:
                if store.check([key]):
                    return store.get(key).decode()
            except Exception:  # noqa: BLE001
                return None
            time.sleep(0.2)
        return None

    def _lost_peers(self, reason: str) -> str | None:
        try:
            return handle_lost_peers(self.ctx, max_restarts=self.max_restarts, env=self.env, reason=reason)
        except Exception as exc:  # noqa: BLE001 - the watchdog must still end the job
            note(f"watchdog: could not check the job's nodes ({exc})")
            return None

    def _flight_recorder_finding(self) -> str | None:
        """The NCCL flight recorder's dumps of this hang, in one line (None on gloo: no dumps)."""
        if self.ctx.run_dir is None:
            return None
        try:
            return hang_words(self.ctx.run_dir)
        except Exception as exc:  # noqa: BLE001 - the watchdog must still end the job
            return f"NCCL flight recorder dumps unreadable ({exc})"

    def _dump_nccl_trace(self, rank: int) -> None:
        dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
        run_dir = self.ctx.run_dir
        if dump is None or run_dir is None or not torch.cuda.is_available():
            return
        try:
            trace = dump()
        except Exception as exc:  # noqa: BLE001 - not recording (TORCH_NCCL_TRACE_BUFFER_SIZE unset) or failed
            note(f"watchdog: rank {rank}: no NCCL flight recorder trace ({exc})")
            return
        path = Path(run_dir) / HANG_DIR / f"{TRACE_PREFIX}{rank}.pkl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, trace)
        note(f"watchdog: rank {rank}: NCCL flight recorder trace in {path}")

    def _requeue_and_record(self, verdict: str) -> str:
        policy = RestartPolicy(task_environment(self.env), run_dir=self.ctx.run_dir, max_restarts=self.max_restarts)
        if not policy.environment.requeues:
            outcome = "not in a SLURM job: not requeued; resubmit with the same --run-dir to resume"
        elif (spent := policy.spent()) is not None:
            outcome = spent
        else:
            budget = policy.next_restart()
            ok, said = policy.requeue()
            outcome = f"requeued job {policy.environment.job_id} ({budget})" if ok else policy.refused(said)
        policy.record(
            reason="hang", cause=verdict, step=self.last_step
        )  # this attempt's end, for the next one and status
        return outcome
