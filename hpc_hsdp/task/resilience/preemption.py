"""Preemption, time limits and requeue: every rank saves, one rank requeues, nobody hangs.

SLURM talks to a running job with signals only:

``--signal=USR2@120`` (the job's warning signal, :data:`WARNING_SIGNAL_ENV` names it on the task)
    the time limit (or a preemption with a grace time) is near; the job still runs.
    ``scancel --signal=USR2 <job>`` sends the same to every task (``--full`` adds the
    batch shell, whose script traps it).
``SIGTERM``
    SLURM is ending the job *now* (``scancel``, ``scontrol requeue``, preemption, time
    limit); ``SIGKILL`` follows after ``KillWait`` seconds.

What happens on each task (:class:`Preemption`):

1. ``install()`` replaces the handlers of both signals (also submitit's, which would make
   only global rank 0 checkpoint and requeue). The handler only records the signal.
2. Every step the ranks agree on it in a collective: the built-in loop adds the codes (0
   nothing, 1 warning, 2 SIGTERM; SIGTERM wins) to the step's own fused all_reduce of loss
   and gradient norm and records the result with ``agree()``; a custom loop calls
   ``should_stop()`` (one all_reduce(MAX)) at its step boundaries. All ranks stop after the
   same step.
3. The caller (the built-in payload: :func:`hpc_hsdp.task.training.loop.train`) then writes
   the distributed checkpoint on every rank, as it does at the end.
4. ``finish()``: on the warning signal rank 0 requeues the job (``scontrol requeue``,
   through the job's :class:`~hpc_hsdp.scheduler.restart_policy.RestartPolicy`) and tells the others the outcome; on
   SIGTERM nothing is asked of SLURM, which is already ending or requeueing the job. Outside SLURM (the local emulator,
   tests) the requeue is skipped with a log line.
5. The task exits: :func:`exit_code` is 0 when the job goes on elsewhere (requeued) or is
   being ended by SLURM, :data:`EXIT_STOPPED_NOT_REQUEUED` when it stopped and nothing will
   restart it (resubmit with the same ``--run-dir`` to resume).

On restart (``SLURM_RESTART_COUNT``) the payload resumes from the newest complete checkpoint.
Imports no torch at module level: the handlers go in before torch is imported.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any

from hpc_hsdp.scheduler.backends import task_environment
from hpc_hsdp.scheduler.backends.slurm_task import REQUEST_FIELDS_VARIABLE
from hpc_hsdp.scheduler.restart_policy import RestartPolicy
from hpc_hsdp.task.observation.log import note

if TYPE_CHECKING:
    import torch

SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
"""What ``signal.signal`` takes and gives back: a function, ``SIG_DFL``/``SIG_IGN``, or None (not set from Python)."""

WARNING_SIGNAL_ENV = "HPC_HSDP_WARNING_SIGNAL"
"""Name of the job's warning signal (``USR2``); the rendered script exports it from ``--signal``."""
DEFAULT_WARNING_SIGNAL = "USR2"

NONE, WARNING, TERMINATE = 0, 1, 2
"""Stop codes agreed with all_reduce(MAX): SIGTERM outranks the warning."""
STOP_CODE_SPAN = 4
"""A stop code above the signals' carries a request of ``hpc-hsdp debug`` agreed at the same
boundary: ``signal + STOP_CODE_SPAN * (debugged rank + 1)``, sent by rank 0 alone
(:mod:`hpc_hsdp.task.observation.debugger`)."""


def split_stop_code(code: int) -> tuple[int, int]:
    """(the signals' code, the debugger's: 0, or the rank to stop + 1) of an agreed stop code."""
    code = int(code)
    return code % STOP_CODE_SPAN, code // STOP_CODE_SPAN


def join_stop_code(signal_code: int, debug_code: int) -> int:
    return signal_code + STOP_CODE_SPAN * debug_code


EXIT_STOPPED_NOT_REQUEUED = 75
"""Exit status of a task that saved and stopped on the warning signal but could not requeue
(outside SLURM, or ``scontrol requeue`` refused): EX_TEMPFAIL, "try again"."""


def warning_signal_from(env: Mapping[str, str]) -> signal.Signals:
    """The warning signal of the job: ``[R:|B:]SIG[@SECONDS]`` or a bare name/number in
    :data:`WARNING_SIGNAL_ENV`; USR2 when unset or unusable."""
    text = (env.get(WARNING_SIGNAL_ENV) or DEFAULT_WARNING_SIGNAL).strip().upper()
    text = text.rsplit(":", 1)[-1].split("@", 1)[0]
    text = text.removeprefix("SIG")
    try:
        sig = signal.Signals(int(text)) if text.isdigit() else signal.Signals["SIG" + text]
    except (KeyError, ValueError):
        return signal.Signals["SIG" + DEFAULT_WARNING_SIGNAL]
    if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):
        return signal.Signals["SIG" + DEFAULT_WARNING_SIGNAL]
    return sig


@dataclass
class StopOutcome:
    """What ``finish()`` did: the agreed reason and whether the job was requeued."""

    reason: str
    """``"USR2"`` (the warning signal's name) or ``"TERM"``."""
    step: int | None
    requeued: bool
    message: str


class Preemption:
    """Signal flags of one task and their agreement across ranks (see the module docstring)."""

    def __init__(self, env: Mapping[str, str] | None = None, *, warning_signal: signal.Signals | None = None) -> None:
        self.env = dict(os.environ if env is None else env)
        self.warning_signal = warning_signal or warning_signal_from(self.env)
        self.environment = task_environment(self.env)
        """The job this task runs in, as its scheduler tells it."""
        self.received: dict[str, float] = {}
        """Signal name -> wall time when it first arrived on this task."""
        self._local = NONE
        self.agreed = NONE
        self.agreed_step: int | None = None
        self.agreed_debug = 0
        """The debugger's part of the last agreed code: 0, or the rank to stop + 1."""
        self.outcome: StopOutcome | None = None
        self._previous: dict[signal.Signals, SignalHandler] = {}
        self._tensor: torch.Tensor | None = None

    # ------------------------------------------------------------------ signals (this task)

    @property
    def signals(self) -> tuple[signal.Signals, signal.Signals]:
        return (self.warning_signal, signal.SIGTERM)

    def install(self) -> Preemption:
        """Replace the handlers of the warning signal and SIGTERM (main thread only)."""
        for sig in self.signals:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Put back the previous handlers, except submitit's: a warning arriving after the
        work is done must not make submitit requeue a finished job (ours stay: flag only)."""
        for sig, previous in list(self._previous.items()):
            owner = getattr(getattr(previous, "__self__", None), "__class__", None)
            if owner is not None and owner.__module__.startswith("submitit"):
                continue
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            del self._previous[sig]

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        # Only record: no I/O, no collectives, no exceptions in a signal handler.
        name = signal.Signals(signum).name.removeprefix("SIG")
        self.received.setdefault(name, time.time())
        self._local = max(self._local, TERMINATE if signum == signal.SIGTERM else WARNING)

    def request(self, code: int = WARNING) -> None:
        """Set the flag as the signal would (for tests and for callers with their own triggers)."""
        self._local = max(self._local, code)

    @property
    def local_code(self) -> int:
        return self._local

    # ------------------------------------------------------------------ agreement (all ranks)

    def agree(self, code: int, step: int | None = None) -> bool:
        """Record the code the ranks agreed on in a collective (the highest any rank had; its
        debugger part in :attr:`agreed_debug`); ``step``: the last completed step. True when it
        says stop."""
        code, self.agreed_debug = split_stop_code(code)
        if code > self.agreed:
            self.agreed = code
            self.agreed_step = step
        return code != NONE

    def should_stop(self, step: int | None = None, *, device=None, group=None, debug_code: int = 0) -> bool:
        """Collective, at a step boundary: True on every rank when any rank got a signal.
        ``step``: the last completed step (for the log and ``finish``); ``group``: the
        process group to agree in (default: the world), e.g. a gloo group on GPU runs so
        that the agreement costs no device sync (then ``device`` is the CPU). ``debug_code``:
        rank 0's request of ``hpc-hsdp debug`` (:data:`STOP_CODE_SPAN`), agreed in the same
        all_reduce (another rank's signal then counts at the next boundary); the agreed one in
        :attr:`agreed_debug`."""
        import torch  # noqa: PLC0415 - the handlers go in before torch loads (module docstring)
        import torch.distributed as dist  # noqa: PLC0415 - as torch

        if not (dist.is_available() and dist.is_initialized()):
            code = self._local
        else:
            if self._tensor is None or (device is not None and self._tensor.device != torch.device(device)):
                if device is None:
                    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
                self._tensor = torch.zeros((), dtype=torch.int32, device=device)
            self._tensor.fill_(join_stop_code(self._local, debug_code))
            dist.all_reduce(self._tensor, op=dist.ReduceOp.MAX, group=group)
            code = int(self._tensor.item())
        return self.agree(code, step)

    @property
    def stop_reason(self) -> str | None:
        """Name of the agreed reason (``"USR2"``, ``"TERM"``), None when no stop was agreed."""
        if self.agreed == TERMINATE:
            return "TERM"
        if self.agreed == WARNING:
            return self.warning_signal.name.removeprefix("SIG")
        return None

    def finish(self, *, rank: int, run_dir=None) -> StopOutcome | None:
        """Collective, after every rank saved: rank 0 requeues on the warning signal; all ranks
        learn the outcome. None when no stop was agreed."""
        reason = self.stop_reason
        if reason is None:
            return None
        requeued, message = False, ""
        if reason == "TERM":
            message = "SIGTERM: SLURM is ending or requeueing the job; saved, exiting"
        elif rank == 0:
            requeued, message = self._requeue()
        import torch.distributed as dist  # noqa: PLC0415 - the handlers go in before torch loads

        if dist.is_available() and dist.is_initialized() and reason != "TERM":
            shared = [(requeued, message)]
            dist.broadcast_object_list(shared, src=0)
            requeued, message = shared[0]
        self.outcome = StopOutcome(reason=reason, step=self.agreed_step, requeued=requeued, message=message)
        if rank == 0:
            note(f"stopped after step {self.agreed_step} on {reason}: {message}")
        return self.outcome

    @property
    def restart_count(self) -> int:
        return self.environment.restart_count

    def _requeue(self) -> tuple[bool, str]:
        job_id = self.environment.job_id
        if not self.environment.requeues:
            return False, (
                "requeue skipped: not in a SLURM job (local emulator or test); "
                "resubmit with the same --run-dir to resume"
            )
        policy = RestartPolicy(self.environment)  # a requeue on the warning signal is no failure: not bounded
        ok, said = policy.requeue()
        if not ok:
            return False, f"{policy.refused(said)}; resubmit with the same --run-dir to resume"
        how = self.environment.requeue_words()
        return True, f"requeued job {job_id} ({how}{f'; {said}' if said else ''}); it resumes from this checkpoint"

    def exit_code(self) -> int | None:
        """The task's exit status after a stop (None: it did not stop on a signal)."""
        if self.outcome is None:
            return None
        if self.outcome.reason == "TERM" or self.outcome.requeued:
            return 0
        return EXIT_STOPPED_NOT_REQUEUED


class NodeRangeKeeper:
    """For a flexible allocation (``HPC_HSDP_REQUEUE_REQUEST``): when SLURM requeues the job itself
    (a node died, the job was preempted) it pins it to the nodes it had; on the SIGTERM that comes
    with that requeue, put the range back on the pending job (the job environment's ``restore_node_range``).

    A thread does it, woken by the signal's byte on a wakeup fd (``signal.set_wakeup_fd``), which
    the interpreter writes at once even while the main thread is stuck in a collective with a dead
    peer (the Python-level handler, which only records, would run only once that call returns: too
    late, SLURM kills the task KillWait after the SIGTERM). One task per node keeps it (local rank
    0), so that it is done whichever nodes survive; the batch shell does the same where it lives."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.environment = task_environment(env)
        self.said: str | None = None
        """What the restore said, once done (None: not asked)."""
        self._fds: tuple[int, int] | None = None
        self._previous_fd = -1

    def wanted(self) -> bool:
        local = self.env.get("LOCAL_RANK", self.env.get("SLURM_LOCALID", "0")).strip()
        return self.environment.keeps_node_range() and local == "0"

    def install(self) -> NodeRangeKeeper:
        """Main thread only, after the SIGTERM handler is installed (only signals with a Python
        handler are written to the wakeup fd). Does nothing where another wakeup fd is in use."""
        if self._fds is not None or not self.wanted() or threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (an event loop): leave it to them
            signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return self
        self._fds = (read_fd, write_fd)
        threading.Thread(target=self._watch, args=(read_fd,), name="hpc-hsdp-node-range", daemon=True).start()
        return self

    def _watch(self, read_fd: int) -> None:
        while True:
            data = os.read(read_fd, 64)
            if not data:  # uninstalled: the write end closed
                os.close(read_fd)
                return
            if signal.SIGTERM.value in data:
                job_id = self.environment.job_id
                restored, said = self.environment.restore_node_range()
                self.said = said
                if restored:
                    note(
                        f"job {job_id} requeued by SLURM: node range restored ({self.env.get(REQUEST_FIELDS_VARIABLE)})"
                    )
                elif said and not said.startswith("not requeued"):
                    note(f"job {job_id}: node range not restored: {said}")

    def uninstall(self) -> None:
        if self._fds is None:
            return
        signal.set_wakeup_fd(-1)
        os.close(self._fds[1])  # the thread reads the end of the pipe, closes its end and returns
        self._fds = None
