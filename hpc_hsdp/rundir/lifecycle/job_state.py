"""``<run-dir>/job_state.json``: the job's state as SLURM last told it, and when.

Written by ``status``, ``runs`` and ``submit --wait`` each time the scheduler answered; read
when it does not (a frozen or unreachable controller), so that they can say which state is the
last known one and how old it is instead of waiting or guessing.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from hpc_hsdp.files import is_time, read_json, write_atomically

JOB_STATE = "job_state.json"
REFRESH_S = 10.0
"""An unchanged state is written again only this long after the last write (``runs`` over
many directories writes few files); so its age is at most this much older than the last answer."""


STATE_FORM = re.compile(r"[A-Z][A-Z_]{0,31}( [ -~]{0,200})?")
"""A job's state as a scheduler says it: a word of capitals (``RUNNING``, ``OUT_OF_MEMORY``),
perhaps followed by printable words (``CANCELLED by 1000``)."""


def is_job_state(value: object) -> bool:
    """``value`` is a job state (:data:`STATE_FORM`): what a record from a run directory must hold
    before it is shown or compared as one (``""`` or ``" "`` had no first word, and broke ``status``)."""
    return isinstance(value, str) and STATE_FORM.fullmatch(value) is not None


def job_state_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / JOB_STATE


def load_job_state(run_dir: str | Path, job_id: str) -> dict | None:
    """The last known state of job ``job_id`` (``state``, ``exit_code``, ``restarts``, ``reason``,
    ``at``: when SLURM said it, epoch seconds); None when none was recorded for this job."""
    try:
        data = read_json(job_state_path(run_dir), max_bytes=1 << 16)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or str(data.get("job_id")) != str(job_id) or not is_job_state(data.get("state")):
        return None
    at, restarts = data.get("at"), data.get("restarts", 0)
    if not is_time(at) or isinstance(restarts, bool) or not isinstance(restarts, int) or not 0 <= restarts < 1 << 31:
        return None
    return data


def save_job_state(
    run_dir: str | Path,
    job_id: str,
    *,
    state: str,
    exit_code: str | None = None,
    restarts: int = 0,
    reason: str | None = None,
    now: float | None = None,
    previous: dict | None = None,
) -> None:
    """Record what SLURM just said about ``job_id``; silently nothing where the run directory is
    not writable (someone else's runs). ``previous``: the record read already, if any."""
    now = time.time() if now is None else now
    record = {"job_id": str(job_id), "state": state, "exit_code": exit_code, "restarts": restarts, "reason": reason}
    if previous is not None:
        same = all(previous.get(key) == value for key, value in record.items())
        if same and now - float(previous.get("at") or 0) < REFRESH_S:
            return
    try:
        write_atomically(job_state_path(run_dir), json.dumps({**record, "at": now}))
    except OSError:
        pass
