"""What the training loop tells the outside world beyond metrics.jsonl, as one component.

- ``attempt.json`` / ``restarts.jsonl`` (:mod:`hpc_hsdp.rundir.lifecycle.attempts`): each restart with its cause;
- every finished record to the run's trackers, ``--tracker`` (:mod:`hpc_hsdp.task.observation.trackers`:
  TensorBoard by default, W&B, MLflow), fed from rank 0 in a background thread;
- the stragglers entry every ``--straggler-every`` steps (:mod:`hpc_hsdp.task.observation.straggler_probe`).

The loop's hooks, every rank::

    observer = RunObserver.start(ctx, training, start_step=start_step)  # before metrics.jsonl is cut back
    observer.step_begins(step)                 # right after the step's clock starts
    observer.step_ends(step, record)           # after comm_stats.take(), before evaluation: adds "stragglers"
    observer.write(record)                     # the finished record: the trackers (rank 0)
    observer.finish(stop_reason, last_step)    # after the loop

Only rank 0 writes files; ``step_begins``/``step_ends`` are collective on probed steps.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hpc_hsdp.rundir.lifecycle import attempts
from hpc_hsdp.rundir.training.metrics import last_step_written
from hpc_hsdp.scheduler.backends import task_environment
from hpc_hsdp.task.observation.straggler_probe import StragglerProbe
from hpc_hsdp.task.observation.trackers import Trackers, TrackerStart, run_config
from hpc_hsdp.task.resilience import injected_faults


class RunObserver:
    def __init__(
        self, ctx, *, probe: StragglerProbe | None, trackers: Trackers | None = None, total_steps: int = 0
    ) -> None:
        self.ctx = ctx
        self.probe = probe
        self.run_dir = ctx.run_dir if ctx.is_rank0 else None
        self.trackers = trackers
        """Rank 0's trackers (None elsewhere, without a run directory, or with ``--tracker none``)."""
        self.total_steps = total_steps

    @classmethod
    def start(cls, ctx, training, *, start_step: int, verbose: bool = True) -> RunObserver:
        every = training.observation.straggler_every
        probe = StragglerProbe.for_context(ctx, every) if every and ctx.world_size > 1 else None
        trackers = None
        if ctx.is_rank0 and ctx.run_dir is not None:
            last_logged = last_step_written(ctx.run_dir)  # before this attempt cuts metrics.jsonl back
            restart = (ctx.preemption or task_environment(os.environ)).restart_count
            attempts.begin_attempt(
                ctx.run_dir,
                restart=restart,
                job_id=ctx.layout.job_id,
                start_step=start_step,
                total_steps=training.optimizer.steps,
            )
            if training.observation.trackers:
                start = TrackerStart(
                    run_dir=Path(ctx.run_dir),
                    start_step=start_step,
                    last_logged=last_logged,
                    total_steps=training.optimizer.steps,
                    config=run_config(ctx, training),
                )
                trackers = Trackers(training.observation.trackers, start, verbose=verbose)
        return cls(ctx, probe=probe, trackers=trackers, total_steps=training.optimizer.steps)

    def step_begins(self, step: int) -> None:
        if self.probe is not None:
            self.probe.begin(step)
        injected_faults.in_step(self.ctx.rank)  # test hook HPC_HSDP_FAULT_SLOW_RANK; no-op otherwise

    def step_ends(self, step: int, record: dict) -> dict:
        if self.probe is not None:
            entry = self.probe.end(step, record["step_time_s"])
            if entry is not None:
                record["stragglers"] = entry
        return record

    def write(self, record: dict) -> None:
        if self.trackers is not None:
            self.trackers.log(record)

    def finish(self, stop_reason: str | None, last_step: int) -> None:
        if self.probe is not None:
            self.probe.close()
        if self.trackers is not None:
            done = stop_reason is None and last_step >= self.total_steps
            self.trackers.close("completed" if done else "stopped")
        if self.run_dir is not None:
            attempts.end_attempt(
                self.run_dir, reason=attempts.stop_reason_code(stop_reason), step=last_step, now=time.time()
            )

    def close_on_error(self, exc: BaseException, step: int | None) -> None:
        """After an exception in the loop: put the collectives back, record the error."""
        if self.probe is not None:
            self.probe.close()
        if self.trackers is not None:
            self.trackers.close("error")
        if self.run_dir is not None:
            attempts.end_attempt(self.run_dir, reason="error", step=step, detail=f"{type(exc).__name__}: {exc}")
