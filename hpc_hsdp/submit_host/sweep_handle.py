"""A submitted sweep, found again from its directory (``sweep.json``): its points' states, their
results ranked by their last eval loss (or loss), waiting for them, cancelling the sweep or a point."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.sweep import names_point
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord, job_record_path
from hpc_hsdp.rundir.lifecycle.sweep_record import SweepPoint, SweepRecord
from hpc_hsdp.rundir.training.metrics import last_metrics, latest_eval
from hpc_hsdp.scheduler.backends import backend
from hpc_hsdp.scheduler.status import JobStatus
from hpc_hsdp.submit_host.handle import JobHandle, job_statuses


@dataclass(frozen=True)
class PointResult:
    """One point: where it runs, its state, and its last step, loss and eval loss (None: none yet)."""

    index: int
    name: str
    values: tuple[tuple[str, str], ...]
    run_dir: str
    job_id: str
    state: str
    step: int | None
    loss: float | None
    eval_loss: float | None
    eval_step: int | None

    @property
    def score(self) -> float | None:
        """What the ranking compares: the last eval loss, else the last training loss."""
        value = self.eval_loss if self.eval_loss is not None else self.loss
        return value if value is not None and math.isfinite(value) else None

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "name": self.name,
            "values": dict(self.values),
            "run_dir": self.run_dir,
            "job_id": self.job_id,
            "state": self.state,
            "step": self.step,
            "loss": self.loss,
            "eval_loss": self.eval_loss,
            "eval_step": self.eval_step,
        }


def ranked(results: list[PointResult]) -> list[PointResult]:
    """Best first: by eval loss where every scored point has one, else by loss; unscored points last."""
    with_eval = all(r.eval_loss is not None for r in results if r.score is not None)

    def key(r: PointResult):
        value = (r.eval_loss if with_eval else r.loss) if r.score is not None else None
        return (value is None or not math.isfinite(value), value if value is not None else 0.0, r.index)

    return sorted(results, key=key)


def arrays_text(record: SweepRecord) -> str:
    """``job array 123 (slurm)``, or ``2 job arrays 123 124 (slurm, one per #SBATCH header)``."""
    if len(record.job_ids) == 1:
        return f"job array {record.job_ids[0]} ({record.cluster})"
    return f"{len(record.job_ids)} job arrays {' '.join(record.job_ids)} ({record.cluster}, one per #SBATCH header)"


def at_once_text(record: SweepRecord) -> str:
    """``, at most 2 at once`` (of each array, where there are several); '' without a bound."""
    if not record.parallelism:
        return ""
    return f", at most {record.parallelism} at once" + (" in each array" if len(record.job_ids) > 1 else "")


def _no_state(run_dir: str) -> str:
    """The state of a point without a job of the sweep's to ask about."""
    if not job_record_path(run_dir).is_file():
        return "UNKNOWN (no job.json)"
    return "UNKNOWN (its job.json is broken or names another job than the sweep's)"


class SweepHandle:
    """A sweep's points, each a job of its own (a task of its header's job array)."""

    def __init__(self, record: SweepRecord) -> None:
        self.record = record
        self.refused: list[str] = []
        """The points the last :meth:`cancel` left alone, each with why (its job runs elsewhere)."""

    @classmethod
    def find(cls, sweep_dir: str | Path) -> SweepHandle:
        return cls(SweepRecord.load(sweep_dir))

    @property
    def job_id(self) -> str:
        """The job arrays, comma-separated (one id where the points share one header)."""
        return self.record.job_id

    @property
    def job_ids(self) -> tuple[str, ...]:
        return self.record.job_ids

    def point(self, ref: str) -> SweepPoint:
        """A point by name, index or array task id (``123_4``)."""
        for point in self.record.points:
            if ref in (point.name, str(point.index), self.record.task_id(point)):
                return point
        for point in self.record.points:  # lr=1e-3 names the point lr=0.001 (a float as Python writes it)
            if names_point(ref, point.values):
                return point
        raise SpecError(f"the sweep in {self.record.sweep_dir} has no point {ref!r}; give a name, index or task id")

    def job_records(self) -> list[tuple[SweepPoint, JobRecord | None]]:
        """Each point with its ``job.json``; None where there is none, it is broken, or it names
        another job than the one the sweep submitted for that point (a point's directory may be
        writable by others: its record is not taken for the sweep's on its word alone)."""
        out = []
        for point in self.record.points:
            try:
                record = JobRecord.load(str(self.record.point_dir(point)))
            except SpecError:
                record = None
            out.append((point, record if record is None or record.job_id == self.record.task_id(point) else None))
        return out

    def statuses(self) -> dict[int, JobStatus | None]:
        """Every point's status, each scheduler asked once for all of them."""
        return self._statuses(self.job_records())

    @staticmethod
    def _statuses(pairs) -> dict[int, JobStatus | None]:
        found = job_statuses([record for _, record in pairs if record is not None])
        return {point.index: (found.get(record.run_dir) if record else None) for point, record in pairs}

    def results(self, *, states: bool = True) -> list[PointResult]:
        """Every point's state and last numbers, in the sweep's order (:func:`ranked` ranks them);
        ``states=False``: the run directories alone, the scheduler not asked (state ``-``)."""
        pairs = self.job_records()
        statuses = self._statuses(pairs) if states else {}
        jobs = {point.index: record.job_id for point, record in pairs if record is not None}
        out = []
        for point in self.record.points:
            run_dir = str(self.record.point_dir(point))
            st = statuses.get(point.index)
            last = last_metrics(run_dir) or {}
            found_eval = latest_eval(run_dir)
            loss = last.get("loss")
            out.append(
                PointResult(
                    index=point.index,
                    name=point.name,
                    values=point.values,
                    run_dir=run_dir,
                    job_id=jobs.get(point.index, self.record.task_id(point)),  # a point resubmitted alone: its own
                    state=st.state if st is not None else (_no_state(run_dir) if states else "-"),
                    step=last.get("step") if isinstance(last.get("step"), int) else None,
                    loss=float(loss) if isinstance(loss, (int, float)) else None,
                    eval_loss=float(found_eval[1]) if found_eval else None,
                    eval_step=found_eval[0] if found_eval else None,
                )
            )
        return out

    def done(self) -> bool:
        return all(st is None or st.finished for st in self.statuses().values())

    def wait(self, *, poll_s: float = 2.0, timeout_s: float | None = None) -> list[PointResult]:
        """Wait for every point to end; their results, best first (:func:`ranked`)."""
        start = time.monotonic()
        while not self.done():
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"sweep {self.job_id} still runs after {timeout_s:.0f} s")
            time.sleep(poll_s)
        return ranked(self.results())

    def cancel(self, point: str | None = None) -> list[str]:
        """Cancel the sweep (every point not ended: each job array of them at once), or one point;
        the task ids cancelled. Only jobs the scheduler says run in the point's own directory are
        cancelled (:meth:`JobHandle.check_runs_here`, as ``cancel RUN_DIR``); the points refused
        and why are :attr:`refused` (one point: SpecError)."""
        self.refused = []
        if point is not None:
            chosen = self.point(point)
            JobHandle(JobRecord.load(str(self.record.point_dir(chosen)))).cancel()
            return [self.record.task_id(chosen)]
        pairs = self.job_records()
        statuses = self._statuses(pairs)
        live = []
        for swept, record in pairs:
            status = statuses.get(swept.index)
            if record is None or status is None or status.finished:
                continue
            try:
                JobHandle(record).check_runs_here()
            except SpecError as exc:
                self.refused.append(f"{swept.name}: {exc}")
                continue
            live.append((swept, record))
        # by the job array each point's job.json names (a point submitted again alone: its own job)
        arrays: dict[tuple[str, str], list[JobRecord]] = {}
        for _, record in live:
            arrays.setdefault((record.cluster, record.job_id.partition("_")[0]), []).append(record)
        for (cluster, array_id), records in arrays.items():
            backend(cluster).cancel_array(array_id, records)
        return [record.job_id for _, record in live]

    @staticmethod
    def lines(results: list[PointResult], *, ranked_by: bool = True) -> list[str]:
        """A table, one line per point: rank (or index), point, state (where known), step, loss, eval loss, job."""
        with_state = any(r.state != "-" for r in results)
        # unranked: the point's place in the sweep (its array task is the JOB column's: where the points
        # differ in their #SBATCH header, each array counts its own tasks)
        rows = [["RANK" if ranked_by else "#", "POINT", "STATE", "STEP", "LOSS", "EVAL LOSS", "JOB"]]
        for i, r in enumerate(results, 1):
            rows.append(
                [
                    str(i) if ranked_by else str(r.index),
                    terminal_safe(r.name),
                    terminal_safe(r.state),
                    "-" if r.step is None else str(r.step),
                    "-" if r.loss is None else f"{r.loss:.4f}",
                    "-" if r.eval_loss is None else f"{r.eval_loss:.4f} (step {r.eval_step})",
                    r.job_id,
                ]
            )
        if not with_state:
            rows = [row[:2] + row[3:] for row in rows]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
