"""How fast a run goes and whether it ends before its allocation does (pure, no torch).

``status`` and ``submit --wait`` feed it the latest metrics records, the run's total
steps (attempt.json) and SLURM's time left and time limit (:func:`hpc_hsdp.scheduler.backends.slurm.time_limits`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hpc_hsdp.plan.units import duration

RATE_WINDOW = 20
"""Steps/s is measured over at most this many of the latest steps of the current attempt."""


def steps_per_second(records: Sequence[dict], *, since_step: int = 0) -> float | None:
    """Over the latest :data:`RATE_WINDOW` records after ``since_step`` (the current attempt's
    start: a requeue's pause is not speed), from their wall times; None with fewer than two."""
    recent = [r for r in records if isinstance(r.get("wall_time"), (int, float)) and r.get("step", 0) > since_step]
    recent = recent[-RATE_WINDOW:]
    if len(recent) < 2:
        return None
    elapsed = recent[-1]["wall_time"] - recent[0]["wall_time"]
    steps = recent[-1]["step"] - recent[0]["step"]
    return steps / elapsed if elapsed > 0 and steps > 0 else None


def requeues_needed(*, remaining_s: float, time_left_s: float, time_limit_s: float | None) -> int | None:
    """Further runs of the job after this allocation to train ``remaining_s`` more (0: it
    fits); None when the limit per run is unknown."""
    if remaining_s <= time_left_s:
        return 0
    if not time_limit_s or time_limit_s <= 0:
        return None
    return math.ceil((remaining_s - time_left_s) / time_limit_s)


@dataclass(frozen=True, kw_only=True)
class Progress:
    step: int | None
    total_steps: int | None
    steps_per_s: float | None
    eta_s: float | None
    """Seconds until the last step at the current speed."""
    time_left_s: float | None
    """Left in the current allocation (SLURM); None: no limit known (local emulator, UNLIMITED)."""
    time_limit_s: float | None
    requeues: int | None

    def words(self) -> str:
        """``2.31 steps/s, all steps done in 3m12s; 12m00s left in the allocation: finishes in time``."""
        parts = []
        if self.steps_per_s is not None:
            speed = f"{self.steps_per_s:.3g} steps/s"
            if self.eta_s is not None:
                speed += f", all steps done in {duration(self.eta_s)}" if self.eta_s > 0 else ", at the last step"
            parts.append(speed)
        if self.time_left_s is not None:
            left = f"{duration(self.time_left_s)} left in the allocation"
            if self.eta_s is not None:
                if self.requeues == 0:
                    left += ": finishes before the time limit"
                elif self.requeues is None:
                    left += ": will not finish in this allocation"
                else:
                    left += (
                        f": needs {self.requeues} requeue{'s' if self.requeues > 1 else ''} "
                        f"(limit {duration(self.time_limit_s)} per run)"
                    )
            parts.append(left)
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def progress_of(
    records: Sequence[dict],
    *,
    total_steps: int | None,
    attempt_start_step: int = 0,
    time_left_s: float | None = None,
    time_limit_s: float | None = None,
) -> Progress:
    step = records[-1].get("step") if records else None
    rate = steps_per_second(records, since_step=attempt_start_step)
    eta = (total_steps - step) / rate if rate and total_steps and step is not None else None
    requeues = None
    if eta is not None and time_left_s is not None:
        requeues = requeues_needed(remaining_s=eta, time_left_s=time_left_s, time_limit_s=time_limit_s)
    return Progress(
        step=step,
        total_steps=total_steps,
        steps_per_s=rate,
        eta_s=eta,
        time_left_s=time_left_s,
        time_limit_s=time_limit_s,
        requeues=requeues,
    )
