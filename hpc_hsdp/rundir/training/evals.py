"""The eval jobs of a run (``--eval-job COMMAND``), read and written without torch.

Layout, under ``<run_dir>/evals/``:

- ``step-N.json``: the submission record of step N, created with ``O_EXCL`` by rank 0 before it
  submits (so that one step is submitted once across requeues and resubmits), then rewritten
  with the outcome: ``{"step", "state": "submitted" | "submit-failed", "job_id" | "reason", "time"}``
  (``"submitting"`` while rank 0 is at it, and forever where it died in between: never twice);
- ``step-N.out``: what the eval job printed (``sbatch --output``, or the detached process's);
- ``step-N.result.json``: written by the wrapper (:mod:`hpc_hsdp.batch_shell.eval_job`): ``"running"``
  when it starts, ``"done"`` or ``"failed"`` with ``exit_code`` and ``metrics`` at its end;

and ``<run_dir>/evals.jsonl``, one line per finished eval job ``{step, job_id, exit_code, state, metrics}``.

Everything here reads those files as hostile (:mod:`hpc_hsdp.files`: capped, regular files only,
garbage skipped), so that ``status`` and ``report`` never fail on them.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import UnreadableFile, open_for_writing, parse_json, read_json, write_atomically
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.rundir.status_section import RunView, StatusSection

EVALS_DIR = "evals"
EVALS_LOG = "evals.jsonl"
PLACEHOLDERS = ("checkpoint", "step", "run_dir", "result")
"""``{checkpoint}`` (the step's checkpoint directory), ``{step}``, ``{run_dir}``, ``{result}`` (a
file the command may write its JSON result to instead of printing it)."""
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_BRACED_NAME = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""``{name}`` not written as the shell's ``${name}``: a placeholder, or a misspelt one."""
_RECORD = re.compile(r"^step-(\d{1,12})\.json$")
MAX_RECORD_BYTES = 64 << 10
"""A submission or result record larger than this was not written by hpc-hsdp."""
MAX_EVALS_SHOWN = 10_000
"""At most this many steps' records are read (the newest)."""
MAX_RESULT_BYTES = 1 << 20
"""The ``{result}`` file and the command's output are read up to this (output: its last bytes)."""
MAX_COMMAND_CHARS = 8192
EVALS_SHOWN = 10
"""``status`` lists the last this many steps' eval jobs (after a count of them all)."""

SUBMITTING, SUBMITTED, SUBMIT_FAILED = "submitting", "submitted", "submit-failed"
RUNNING, DONE, FAILED = "running", "done", "failed"


def check_eval_command(command: str | None) -> None:
    """SpecError (one line, the fix) for an ``--eval-job`` that cannot be run."""
    if command is None:
        return
    if not command.strip():
        raise SpecError(
            "--eval-job is empty; give the command to run on each checkpoint, e.g. 'python eval.py {checkpoint}'"
        )
    if "\0" in command or len(command) > MAX_COMMAND_CHARS:
        raise SpecError(f"--eval-job must be one shell command of at most {MAX_COMMAND_CHARS} characters, without NUL")
    unknown = [name for name in _BRACED_NAME.findall(command) if name not in PLACEHOLDERS]
    if unknown:
        import difflib  # noqa: PLC0415 - only for a misspelt placeholder

        close = difflib.get_close_matches(unknown[0], PLACEHOLDERS, n=1, cutoff=0.6)
        raise SpecError(
            f"--eval-job: {{{unknown[0]}}} is not a placeholder"
            + (f" (did you mean {{{close[0]}}}?)" if close else "")
            + f"; the placeholders are {', '.join('{' + name + '}' for name in PLACEHOLDERS)} "
            f"(write ${{{unknown[0]}}} for the shell's variable)"
        )


def substitute(command: str, *, checkpoint: str, step: int, run_dir: str, result: str) -> str:
    """``command`` with its placeholders replaced by the shell-quoted values (other braces, such as
    ``${HOME}``, are left to the shell)."""
    values = {"checkpoint": checkpoint, "step": str(step), "run_dir": run_dir, "result": result}
    return _PLACEHOLDER.sub(lambda m: shlex.quote(values[m.group(1)]), command)


def evals_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / EVALS_DIR


def record_path(run_dir, step: int) -> Path:
    return evals_dir(run_dir) / f"step-{step}.json"


def result_path(run_dir, step: int) -> Path:
    return evals_dir(run_dir) / f"step-{step}.result.json"


def output_path(run_dir, step: int) -> Path:
    return evals_dir(run_dir) / f"step-{step}.out"


def metrics_file_path(run_dir, step: int) -> Path:
    """What ``{result}`` names: where the command may write its JSON object."""
    return evals_dir(run_dir) / f"step-{step}.metrics.json"


def steps_to_submit(checkpoint_steps, recorded_steps, *, every: int, last: int) -> list[int]:
    """The steps whose checkpoint is complete and that have no submission record yet, oldest first
    (a step with a record, whatever its state, is never submitted again). Only the steps of the
    run's cadence are evaluated: every ``every`` (``--checkpoint-every``; 0: none) and the last
    one; a checkpoint saved on a stop signal (preemption, a time limit) at another step is not."""
    recorded = set(recorded_steps)
    due = (s for s in set(checkpoint_steps) if s == last or (every and s % every == 0))
    return sorted(s for s in due if s not in recorded)


def claim(run_dir, step: int, *, now: float | None = None) -> bool:
    """Create step N's submission record (``O_EXCL``): True when this caller now owns its
    submission, False when it exists (submitted before: by an earlier attempt or a resubmit)."""
    path = record_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        f = open_for_writing(path, exclusive=True, mode=0o644)
    except FileExistsError:
        return False
    with f:
        f.write(
            (
                json.dumps({"step": step, "state": SUBMITTING, "time": time.time() if now is None else now}) + "\n"
            ).encode()
        )
    return True


def record_submission(run_dir, step: int, *, job_id: str | None, reason: str | None = None) -> dict:
    """Rewrite step N's record with the outcome: submitted (``job_id``) or submit-failed (``reason``)."""
    record = {"step": step, "state": SUBMITTED if job_id else SUBMIT_FAILED, "time": time.time()}
    if job_id:
        record["job_id"] = job_id
    else:
        record["reason"] = reason or "unknown"
    write_atomically(record_path(run_dir, step), json.dumps(record) + "\n")
    return record


def recorded_steps(run_dir) -> list[int]:
    """The steps that have a submission record (whatever it holds)."""
    try:
        names = os.listdir(evals_dir(run_dir))
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_RECORD.match, names) if m)


def last_json_object(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object (the eval command's result), else None."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            value = parse_json(line, where="the line")
        except UnreadableFile:
            continue
        if isinstance(value, dict):
            return value
    return None


def numeric_metrics(metrics) -> dict[str, float]:
    """The metrics that can be plotted: numbers (not bools) under names of printable text."""
    if not isinstance(metrics, dict):
        return {}
    return {
        str(k)[:80]: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300
    }


@dataclass(frozen=True)
class EvalEntry:
    """One step's eval job as its files tell."""

    step: int
    state: str
    """submitting, submitted, submit-failed, running, done, failed or unreadable."""
    job_id: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def words(self) -> str:
        """``step 10: done (job 123) accuracy=0.51 loss=2.3``, one line."""
        job = f" (job {self.job_id})" if self.job_id else ""
        text = f"step {self.step}: {self.state}{job}"
        if self.state == FAILED and self.exit_code is not None:
            text += f", exit code {self.exit_code}"
        if self.reason:
            text += f": {self.reason}"
        if self.metrics:
            text += " " + " ".join(f"{k}={v:.4g}" for k, v in sorted(self.metrics.items()))
        return " ".join(text.split())[:400]


def _text(value, limit: int = 200) -> str | None:
    return (
        " ".join(str(value).split())[:limit] if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    )


def read_entry(run_dir, step: int) -> EvalEntry:
    """Step N's eval job: its result's state where the wrapper has written one, else the submission's."""
    try:
        record = read_json(record_path(run_dir, step), max_bytes=MAX_RECORD_BYTES)
    except (OSError, UnreadableFile):
        return EvalEntry(step=step, state="unreadable")
    if not isinstance(record, dict) or record.get("state") not in (SUBMITTING, SUBMITTED, SUBMIT_FAILED):
        return EvalEntry(step=step, state="unreadable")
    job_id = _text(record.get("job_id"), 40)
    try:
        result = read_json(result_path(run_dir, step), max_bytes=MAX_RECORD_BYTES)
    except (OSError, UnreadableFile):
        result = None
    if isinstance(result, dict) and result.get("state") in (RUNNING, DONE, FAILED):
        code = result.get("exit_code")
        return EvalEntry(
            step=step,
            state=result["state"],
            job_id=_text(result.get("job_id"), 40) or job_id,
            exit_code=code if isinstance(code, int) and not isinstance(code, bool) and -1000 < code < 1000 else None,
            reason=_text(result.get("reason")),
            metrics=numeric_metrics(result.get("metrics")),
        )
    return EvalEntry(step=step, state=record["state"], job_id=job_id, reason=_text(record.get("reason")))


def read_evals(run_dir) -> list[EvalEntry]:
    """Every step's eval job of the run, oldest first (the newest :data:`MAX_EVALS_SHOWN`); none without ``evals/``."""
    return [read_entry(run_dir, step) for step in recorded_steps(run_dir)[-MAX_EVALS_SHOWN:]]


def evals_summary(entries) -> str:
    """``3 eval jobs: 2 done, 1 failed`` (empty without any)."""
    if not entries:
        return ""
    counts: dict[str, int] = {}
    for entry in entries:
        counts[entry.state] = counts.get(entry.state, 0) + 1
    return f"{len(entries)} eval job{'s' if len(entries) != 1 else ''}: " + ", ".join(
        f"{n} {state}" for state, n in counts.items()
    )


def _evals_lines(entries: list[EvalEntry]) -> list[str]:
    if not entries:
        return []
    more = f" (the last {EVALS_SHOWN}:)" if len(entries) > EVALS_SHOWN else ""
    return [evals_summary(entries) + more] + [terminal_safe(f"  {entry.words()}") for entry in entries[-EVALS_SHOWN:]]


EVALS_SECTION: StatusSection[RunView, list[EvalEntry]] = StatusSection(
    name="evals",
    read=lambda view: read_evals(view.run_dir),
    lines=_evals_lines,
    fields=lambda entries: {"evals": [asdict(entry) for entry in entries]},
)
