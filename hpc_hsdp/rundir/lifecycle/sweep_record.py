"""``<sweep-dir>/sweep.json``: a sweep, enough to find its points again from any shell.

``submit --sweep`` writes it once the job array was submitted; ``status``, ``runs``, ``report``
and ``cancel`` of the sweep's directory read it. Each point is a run directory of its own
(``<sweep-dir>/<name>``, named relative to the sweep's directory, which may be moved), with its
own ``job.json`` naming its array task (``<array job id>_<task id>``). A sweep whose points
differ in their ``#SBATCH`` header is one job array per distinct header: ``job_ids`` lists them,
each point names its own array task (``job_id``).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import read_json, write_atomically
from hpc_hsdp.plan.slurm_facts import check_job_id

SWEEP_RECORD = "sweep.json"
_MAX_BYTES = 16 << 20
MAX_POINTS = 10_000
"""The most points a sweep may have: each is a run directory and a job of its own (SLURM's
default MaxArraySize is 1001); a sweep is counted against it before it is expanded, and a
``sweep.json`` before its points are read."""


def sweep_record_path(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / SWEEP_RECORD


def is_sweep_dir(path: str | Path) -> bool:
    return sweep_record_path(path).is_file()


@dataclass(frozen=True, kw_only=True)
class SweepPoint:
    index: int
    name: str
    values: tuple[tuple[str, str], ...]
    """(option key, value as given)."""
    job_id: str | None = None
    """Its array task as submitted (``<array>_<task>``); None in a record older than this field
    (then ``<the array>_<index>``), or for a point not submitted (it completed before)."""


@dataclass(frozen=True, kw_only=True)
class SweepRecord:
    sweep_dir: str
    job_ids: tuple[str, ...]
    """The job arrays' ids (SLURM's, or the emulator's): one per distinct ``#SBATCH`` header of the
    points submitted (one, where they share it)."""
    cluster: str
    mode: str
    parallelism: int | None
    """``--array-parallelism``: at most this many points of each job array at once."""
    sweep: tuple[str, ...]
    """The ``--sweep`` texts as given."""
    points: tuple[SweepPoint, ...]
    submitted_at: float = 0.0

    @property
    def job_id(self) -> str:
        """The job arrays, comma-separated as ``squeue -j`` and ``sacct -j`` take them (one id where
        the points share one header)."""
        return ",".join(self.job_ids)

    def point_dir(self, point: SweepPoint) -> Path:
        return Path(self.sweep_dir) / point.name

    def task_id(self, point: SweepPoint) -> str:
        return point.job_id or f"{self.job_ids[0]}_{point.index}"

    def save(self) -> None:
        data = {
            "job_id": self.job_ids[0],  # the first array's, as a record of one array has it
            "job_ids": list(self.job_ids),
            "cluster": self.cluster,
            "mode": self.mode,
            "parallelism": self.parallelism,
            "sweep": list(self.sweep),
            "points": [
                {"index": p.index, "name": p.name, "values": [list(v) for v in p.values], "job_id": p.job_id}
                for p in self.points
            ],
            "submitted_at": self.submitted_at or time.time(),
        }
        write_atomically(sweep_record_path(self.sweep_dir), json.dumps(data, indent=1))

    @classmethod
    def load(cls, sweep_dir: str | Path) -> SweepRecord:
        """The record in ``sweep_dir``; SpecError (one line) when there is none or it is not one of ours."""
        path = sweep_record_path(sweep_dir)
        try:
            data: Any = read_json(path, max_bytes=_MAX_BYTES)  # of another shape: the TypeError or KeyError below
        except FileNotFoundError:
            raise SpecError(f"{sweep_dir} holds no {SWEEP_RECORD}; give the directory submit --sweep printed") from None
        except (OSError, ValueError) as exc:
            raise SpecError(f"{path} cannot be read ({type(exc).__name__}); it is not a sweep's record") from None
        try:
            if len(data["points"]) > MAX_POINTS:  # counted before each is read
                raise ValueError(f"{len(data['points'])} points, more than {MAX_POINTS}")
            points = tuple(
                SweepPoint(
                    index=_index(p["index"]),
                    name=_safe_name(p["name"]),
                    values=tuple((str(k), str(v)) for k, v in p["values"]),
                    job_id=None
                    if p.get("job_id") is None
                    else check_job_id(p["job_id"], where=f"{path}: a point's job_id"),
                )
                for p in data["points"]
            )
            job_ids = data.get("job_ids") or [data["job_id"]]
            return cls(
                sweep_dir=str(sweep_dir),
                job_ids=tuple(check_job_id(j, where=f"{path}: job_ids") for j in job_ids),
                cluster=str(data["cluster"]),
                mode=str(data["mode"]),
                parallelism=None if data.get("parallelism") is None else int(data["parallelism"]),
                sweep=tuple(str(s) for s in data.get("sweep", ())),
                points=points,
                submitted_at=float(data.get("submitted_at") or 0.0),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise SpecError(f"{path} is not a sweep's record ({type(exc).__name__}: {exc})"[:300]) from None


def _index(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_POINTS:
        raise ValueError(f"point index {str(value)[:20]} is not one of 0-{MAX_POINTS - 1}")
    return value


def _safe_name(name: object) -> str:
    """A point's directory name as submit writes it (letters, digits and ``._=,+@-``): one component
    below the sweep's directory, never a path out of it, nothing a terminal would obey."""
    text = str(name)
    if text in (".", "..") or not re.fullmatch(r"[A-Za-z0-9._=,+@-]{1,200}", text):
        raise ValueError(f"point name {text[:60]!r} is not a directory name submit writes")
    return text
