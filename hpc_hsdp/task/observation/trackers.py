"""The run's trackers (``--tracker tensorboard,wandb,mlflow``), on rank 0, behind one interface.

Each tracker is a module with ``open_tracker(start: TrackerStart) -> Tracker | None`` that
imports its package (only here, on rank 0: wandb and mlflow take a second each) and gives
an object with two methods::

    through                         # the step after which its run goes on (rows up to it are there)
    log(step, scalars, wall_time)   # one metrics row: {tag: value} (rundir.training.scalars, the tags TensorBoard has)
    close(outcome)                  # "completed", "stopped" (to be resumed) or "error"

:class:`Trackers` runs them all in one background thread: the step only hands the row
over (a queue), so neither a tracker's import, its start, a slow file system nor a network
costs the step anything, and the rows reach every tracker in step order. A tracker that
fails (its package missing at run time, a store that cannot be written, an exception in a
log call) is one warning line through the runtime's logger, and is off for the rest of
the attempt; training never fails for it.

One tracker run per run directory: each tracker keeps its run's id in
``<run-dir>/trackers.json`` (:mod:`hpc_hsdp.rundir.observation.tracker_runs`) and continues that run when the
job resumes, after the step its run is known to hold (``logged_through``, recorded every few
seconds: an attempt cancelled or killed before a tracker took its rows leaves it behind the
checkpoint) or the checkpoint's step, whichever is earlier: the rows in between come from
``metrics.jsonl`` first. The steps the run may hold already that it gets again (after a crash
resumed from an older checkpoint: up to the last step ``metrics.jsonl`` had) are handled by
each tracker as it can: TensorBoard purges them, W&B rewinds the run to that step, MLflow
(which cannot overwrite a value) logs them again marked with the ``attempt`` metric and the
``hpc_hsdp.redone_steps`` tag. A tracker opens with ``through``, the step after which it logs.
"""

from __future__ import annotations

import importlib
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_hsdp.job.options import TRACKER_PACKAGES, default
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.rundir.observation.tracker_runs import clear_off, record_off, record_progress
from hpc_hsdp.rundir.training.metrics import metrics_path
from hpc_hsdp.rundir.training.scalars import record_scalars
from hpc_hsdp.task.observation.log import note

MODULES = {
    "tensorboard": "hpc_hsdp.task.observation.tensorboard_tracker",
    "wandb": "hpc_hsdp.task.observation.wandb_tracker",
    "mlflow": "hpc_hsdp.task.observation.mlflow_tracker",
}
"""tracker name -> the module that opens it."""
CLOSE_TIMEOUT_S = 120.0
"""How long the end of an attempt waits for the trackers to take the last rows and close."""
PROGRESS_EVERY_S = 5.0
"""How often the tracker thread records each tracker's ``logged_through`` (and at the end)."""


@dataclass(frozen=True, kw_only=True)
class TrackerStart:
    """What a tracker is opened with, on rank 0, at the start of an attempt."""

    run_dir: Path
    start_step: int
    """The step this attempt resumes from (0: a fresh start); it logs from the next one."""
    last_logged: int | None
    """The last step metrics.jsonl held before this attempt (None: nothing logged yet)."""
    total_steps: int
    config: dict
    """The job's options (flat: name -> str, number, bool or None): the run's config / params."""

    @property
    def name(self) -> str:
        """The run's display name: the run directory's."""
        return self.run_dir.name

    def continues_after(self, entry: dict | None) -> int:
        """The step after which a tracker's run goes on, given its ``trackers.json`` entry: the
        checkpoint's step, or an earlier one where the run is known to hold fewer rows (an
        attempt that ended before the tracker took its rows); 0 for a new run."""
        known = (entry or {}).get("logged_through", 0)
        return max(0, min(known if isinstance(known, int) else 0, self.start_step))

    def redone_after(self, through: int) -> range:
        """The steps the run may hold already that it gets again, continuing after ``through``
        (after a crash resumed from an older checkpoint; empty after a clean stop)."""
        return range(through + 1, (self.last_logged or 0) + 1)


def run_config(ctx, training) -> dict:
    """The job's options as a tracker run's config: every training option, then the mesh and
    the run's own (entry, device, timeout, comm stats)."""
    config = training.options()
    plan = ctx.plan
    config.update(
        world_size=ctx.world_size,
        nodes=len(plan.tasks_per_node),
        shard_size=plan.shard_size,
        num_replicas=plan.num_replicas,
        device=ctx.device.type,
    )
    if ctx.spec is not None:
        config.update(entry=ctx.spec.entry, timeout_s=ctx.spec.timeout_s, comm_stats=ctx.spec.comm_stats)
    return {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v) for k, v in config.items()}


def off_note(name: str, reason: str) -> str:
    return f"warning: tracker {name} is off for this attempt: {reason}; training goes on without it"


def _open(name: str, start: TrackerStart, *, verbose: bool):
    module, extra = TRACKER_PACKAGES[name]
    try:
        tracker = importlib.import_module(MODULES[name]).open_tracker(start)
        try:
            clear_off(start.run_dir, name)
        except OSError:
            pass
        return tracker
    except ImportError as exc:
        if name != default("tracker") or verbose:  # the default without its package: said unless quiet
            note(off_note(name, f"{exc}; pip install 'hpc-hsdp[{extra}]' (or {module}) to use it"))
    except Exception as exc:  # noqa: BLE001 - a tracker never ends the training
        reason = f"it could not start: {type(exc).__name__}: {_brief(exc)}"
        note(off_note(name, reason))
        try:
            record_off(start.run_dir, name, reason)
        except OSError:
            pass
    return None


def _brief(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


class Trackers:
    """The trackers of one attempt on rank 0, fed from the loop and run in one background thread."""

    def __init__(self, names: tuple[str, ...], start: TrackerStart, *, verbose: bool = True) -> None:
        self.names = names
        self.opened: list[str] = []
        """The trackers that started (filled by the background thread)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._work, args=(start, verbose), name="hpc-hsdp-trackers", daemon=True)
        self._thread.start()

    def log(self, record: dict) -> None:
        """Hand one finished metrics record over (its scalars, taken now)."""
        if not self._closed:
            self._queue.put((int(record["step"]), record_scalars(record), record.get("wall_time")))

    def close(self, outcome: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Let every tracker take the rows handed over, then close it; waits at most ``timeout_s``."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(outcome)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            note(f"warning: the trackers did not finish within {timeout_s:g} s; the last rows may be missing from them")

    def _work(self, start: TrackerStart, verbose: bool) -> None:
        active, progress = [], {}
        for name in self.names:
            tracker = _open(name, start, verbose=verbose)
            if tracker is not None:
                active.append((name, tracker))
                self.opened.append(name)
                progress[name] = tracker.through
        # rows an earlier attempt trained that a tracker never took (its run continues after an
        # older step than the checkpoint's): from metrics.jsonl, where every finished step is
        behind = min((tracker.through for _, tracker in active), default=start.start_step)
        if behind < start.start_step:
            for row in read_jsonl(metrics_path(start.run_dir)):
                step = row.get("step")
                if isinstance(step, int) and behind < step <= start.start_step:
                    item = (step, record_scalars(row), row.get("wall_time"))
                    self._deliver([e for e in active if e[1].through < step], item, active, progress)
        # a tracker whose rows are on disk when log() returns counts them as it goes; one that buffers
        # them elsewhere (W&B's service process) only once its run closed: a killed attempt loses those
        durable = {name for name, tracker in active if getattr(tracker, "durable", True)}
        saved = time.monotonic()
        while True:
            item = self._queue.get()
            if isinstance(item, str):
                closed = set()
                for name, tracker in active:
                    try:
                        tracker.close(item)
                        closed.add(name)
                    except Exception as exc:  # noqa: BLE001 - a tracker never ends the training
                        note(f"warning: tracker {name} could not close its run: {type(exc).__name__}: {_brief(exc)}")
                self._save(start, {n: s for n, s in progress.items() if n in durable or n in closed})
                return
            self._deliver(list(active), item, active, progress)
            if time.monotonic() - saved > PROGRESS_EVERY_S:
                self._save(start, {n: s for n, s in progress.items() if n in durable})
                saved = time.monotonic()

    def _deliver(self, targets: list, item: tuple, active: list, progress: dict) -> None:
        for entry in targets:
            name, tracker = entry
            try:
                tracker.log(*item)
                progress[name] = item[0]
            except Exception as exc:  # noqa: BLE001 - a tracker never ends the training
                note(off_note(name, f"logging step {item[0]} failed: {type(exc).__name__}: {_brief(exc)}"))
                active.remove(entry)
                try:
                    tracker.close("error")
                except Exception:  # noqa: BLE001, S110 - it failed already; said once
                    pass

    @staticmethod
    def _save(start: TrackerStart, progress: dict) -> None:
        if progress:
            try:
                record_progress(start.run_dir, progress)
            except OSError as exc:
                note(f"warning: could not record the trackers' progress in the run directory ({exc})")
