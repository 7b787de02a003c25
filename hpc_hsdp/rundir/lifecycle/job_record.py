"""``<run-dir>/job.json``: the submitted job, enough to find it again from any shell.

``submit`` writes it (and a line in this machine's index of jobs, so that a job id alone
finds its run directory); ``status``, ``logs``, ``cancel``, ``runs`` and a resubmission read it.

The directory is the run: a record read from a directory describes that directory, wherever
it was written. ``logs_dir`` is written relative to the run directory (an older record's
absolute one inside its run directory is read as relative too), and ``run_dir`` is where the
job was submitted, a hint only: :meth:`JobRecord.load` gives the directory it was read from
(as given) and keeps the written one as :attr:`JobRecord.recorded_run_dir`. A copied or moved
run reads the same as the original.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import (
    UnreadableFile,
    is_time,
    private_dir,
    read_capped,
    read_json,
    user_state_dir,
    write_atomically,
)
from hpc_hsdp.plan.slurm_facts import check_job_id

JOB_RECORD = "job.json"


def job_record_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / JOB_RECORD


def jobs_index() -> Path:
    """This machine's index of submitted jobs: one file per job, holding its run directory."""
    return user_state_dir("jobs")


def _own_index() -> bool:
    """The index is this user's own directory (not a symlink, not another user's)."""
    try:
        info = os.lstat(jobs_index())
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    """What ``<run-dir>/job.json`` holds."""

    job_id: str
    cluster: str
    """``slurm`` or ``local``."""
    run_dir: str
    logs_dir: str
    job_name: str
    ntasks: int
    launcher: str
    submitted_at: float
    recorded_run_dir: str = field(default="", compare=False)
    """The run directory as ``job.json`` names it (where the job was submitted; '' before it
    was written or read); ``run_dir`` is the directory it was read from."""

    @property
    def moved(self) -> bool:
        """The directory read is not the one the job was submitted into (a copy, or moved)."""
        return bool(self.recorded_run_dir) and not same_dir(self.recorded_run_dir, self.run_dir)

    def save(self) -> None:
        """Write ``<run_dir>/job.json`` (``logs_dir`` relative to it when inside it; ``run_dir``
        absolute, as a hint) and this machine's index entry."""
        run_dir = Path(self.run_dir).absolute()
        data = {name: getattr(self, name) for name in _FIELD_TYPES}
        data["run_dir"] = str(run_dir)
        data["logs_dir"] = _relative_to(Path(self.logs_dir).absolute(), run_dir) or self.logs_dir
        write_atomically(job_record_path(self.run_dir), json.dumps(data, indent=1))
        index = jobs_index()
        try:
            private_dir(index)  # its entries name run directories: nobody else may add one
            (index / f"{self.cluster}-{self.job_id}").write_text(str(run_dir))
        except OSError:
            pass  # the run directory alone is enough

    def located(self, run_dir: str | Path) -> JobRecord:
        """This record, read from ``run_dir``: its paths resolved against that directory."""
        written = Path(self.run_dir)
        logs = Path(self.logs_dir)
        if logs.is_absolute():  # an older record's, inside its run directory (:meth:`check`)
            inside = _relative_to(logs, written) if written.is_absolute() else None
            logs = Path(run_dir) / inside if inside is not None else logs
        else:
            logs = Path(run_dir) / logs
        return replace(self, run_dir=str(run_dir), logs_dir=str(logs), recorded_run_dir=self.run_dir)

    @classmethod
    def load(cls, ref: str) -> JobRecord:
        """From a run directory, or a job id recorded on this machine."""
        path = job_record_path(ref)
        if not path.is_file():
            matches = sorted(jobs_index().glob(f"*-{ref}")) if ref.replace("_", "").isdigit() and _own_index() else []
            runs = [job_record_path(entry) for m in matches if (entry := _index_entry(m))]
            runs = [p for p in runs if p.is_file()]
            if not runs:
                raise SpecError(
                    f"{ref!r} is neither a run directory with a {JOB_RECORD} nor a job id submitted from this "
                    f"machine; pass the run directory (--run-dir of the submission)"
                )
            path = runs[-1]
        return cls.from_file(path).located(path.parent)

    @classmethod
    def from_file(cls, path: Path) -> JobRecord:
        """A ``job.json`` read as data that may be hostile: at most 64 KiB, every field of its
        type, the job id in one of SLURM's forms (it reaches squeue and scancel, and names files)."""
        try:
            data = read_json(path, max_bytes=_MAX_RECORD_BYTES)
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
            record = cls(**data)
        except OSError as exc:
            raise SpecError(f"cannot read {path} ({exc.strerror}); check its permissions") from None
        except UnreadableFile as exc:
            raise SpecError(f"{exc}; pass the run directory of a submission") from None
        except (ValueError, TypeError) as exc:
            reason = " ".join(str(exc).split())[:120]
            raise SpecError(f"{path} is not a job record written by hpc-hsdp ({reason})") from None
        record.check(path)
        return record

    def check(self, path: Path) -> None:
        """Types and forms of the fields (SpecError naming ``path`` and the field)."""
        for name, kinds in _FIELD_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise SpecError(
                    f"{path} is not a job record written by hpc-hsdp ({name} is {type(value).__name__}); "
                    f"pass the run directory of a submission"
                )
        if self.cluster not in ("slurm", "local"):
            raise SpecError(
                f"{path}: cluster {self.cluster[:40]!r} is neither slurm nor local; pass another run directory"
            )
        if not is_time(self.submitted_at) or not 0 < self.ntasks < 1 << 31:
            raise SpecError(
                f"{path} is not a job record written by hpc-hsdp (submitted_at or ntasks out of range); "
                f"pass the run directory of a submission"
            )
        check_job_id(self.job_id, where=f"{path}: job_id")
        logs = Path(self.logs_dir)
        outside = _relative_to(logs, Path(self.run_dir)) is None if logs.is_absolute() else ".." in logs.parts
        if outside or not self.logs_dir or ".." in logs.parts:
            raise SpecError(
                f"{path}: logs_dir {self.logs_dir[:80]!r} leaves the run directory; pass another run directory"
            )


def _index_entry(path: Path) -> str:
    """The run directory an entry of the jobs index names ('' when it cannot be read as one)."""
    try:
        return read_capped(path, max_bytes=1 << 16).decode("utf-8")
    except (OSError, ValueError):
        return ""


def _relative_to(path: Path, base: Path) -> str | None:
    """``path`` relative to ``base`` (both absolute, compared as written), None when outside it."""
    try:
        return str(path.relative_to(base))
    except ValueError:
        return None


def same_dir(a: str | Path, b: str | Path) -> bool:
    """Whether ``a`` and ``b`` are one directory (a path that does not exist is no other's)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


_MAX_RECORD_BYTES = 64 * 1024
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "job_id": str,
    "cluster": str,
    "run_dir": str,
    "logs_dir": str,
    "job_name": str,
    "ntasks": int,
    "launcher": str,
    "submitted_at": (int, float),
}
