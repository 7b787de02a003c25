"""``<run-dir>/job.json``: the submitted job, enough to find it again from any shell.

``submit`` writes it (and a line in this machine's index of jobs, so that a job id alone
finds its run directory); ``status``, ``logs``, ``cancel``, ``runs`` and a resubmission read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import write_atomically

JOB_RECORD = "job.json"


def job_record_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / JOB_RECORD


def jobs_index() -> Path:
    """This machine's index of submitted jobs: one file per job, holding its run directory."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "hpc-hsdp" / "jobs"


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

    def save(self) -> None:
        write_atomically(job_record_path(self.run_dir), json.dumps(asdict(self), indent=1))
        index = jobs_index()
        try:
            index.mkdir(parents=True, exist_ok=True)
            (index / f"{self.cluster}-{self.job_id}").write_text(self.run_dir)
        except OSError:
            pass  # the run directory alone is enough

    @classmethod
    def load(cls, ref: str) -> JobRecord:
        """From a run directory, or a job id recorded on this machine."""
        path = job_record_path(ref)
        if not path.is_file():
            matches = sorted(jobs_index().glob(f"*-{ref}")) if ref.replace("_", "").isdigit() else []
            runs = [job_record_path(m.read_text()) for m in matches]
            runs = [p for p in runs if p.is_file()]
            if not runs:
                raise SpecError(
                    f"{ref!r} is neither a run directory with a {JOB_RECORD} nor a job id submitted from this "
                    f"machine; pass the run directory (--run-dir of the submission)"
                )
            path = runs[-1]
        try:
            return cls(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as exc:
            raise SpecError(f"{path} is not a job record written by hpc-hsdp ({exc})") from None
