"""The one module that talks to the scheduler: submit, state, logs, cancel.

SLURM jobs go through submitit, whose sbatch text is replaced by the script ``render``
produces for the same spec: only the command each task runs differs (submitit's job
runner, ``python -u -m hpc_hsdp.runtime.submitit_job <folder>``, in place of
``python -m hpc_hsdp run``), so ``hpc-hsdp render`` shows what runs. Without SLURM the
local emulator (:mod:`hpc_hsdp.job.local`) runs that same script.

Every job leaves ``<run-dir>/job.json``; a handle is rebuilt from it (or from the job id,
through a small index in the user's state directory) in any new shell.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import HsdpError, SpecError
from hpc_hsdp.job.config import OPTION_KINDS, check_kind, command_line_layer, resolve_job_spec, running_venv
from hpc_hsdp.job.options import OPTIONS
from hpc_hsdp.job.preflight import check_job_inputs, check_trackers
from hpc_hsdp.job.requeue import REQUEUE_FILE_VARIABLE, requeue_job  # noqa: F401  (re-exported: the scheduler's API)
from hpc_hsdp.job.slurm_command import (  # noqa: F401  (SchedulerError re-exported: the scheduler's API)
    TIMED_OUT,
    SchedulerError,
    SchedulerTimeout,
    bounded_command,
    daemon_of,
    ping_controller,
    run_slurm,
    slurm_timeout_s,
)
from hpc_hsdp.job.task import RUN_TASK, RUN_TORCHRUN
from hpc_hsdp.plan.float8_support import NodeGpus, fp8_local_refusal, fp8_slurm_refusal
from hpc_hsdp.plan.slurm_facts import SINFO_NODE_FORMAT, check_job_id, parse_sinfo_nodes, satisfies_constraint
from hpc_hsdp.plan.topology import expand_nodelist
from hpc_hsdp.plan.units import duration
from hpc_hsdp.rundir import claim as claims
from hpc_hsdp.rundir.job_record import JobRecord, job_record_path, same_dir
from hpc_hsdp.rundir.job_state import load_job_state, save_job_state
from hpc_hsdp.rundir.layout import procid_of_rank, rank_of_task
from hpc_hsdp.rundir.metrics import last_metrics, recent_metrics

CLUSTERS = ("auto", "slurm", "local")
TERMINAL = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)


def resolve_cluster(choice: str, *, ping=ping_controller, which=shutil.which) -> tuple[str, str]:
    """``auto`` -> ``slurm`` when the controller answers; ``local`` only where no SLURM client is
    installed (no ``sbatch``) or configured (``scontrol`` finds no configuration). Where SLURM is
    configured, a controller that does not answer is a :class:`SchedulerError` (nothing is
    submitted, nothing runs here: a login node is no place to train). With a reason line."""
    if choice not in CLUSTERS:
        raise SpecError(f"--cluster {choice!r} is unknown; choose auto, slurm or local")
    if choice == "local":
        return "local", "running on the local emulator (--cluster local)"
    if which("sbatch") is None:
        if choice == "slurm":
            raise SchedulerError(
                "--cluster slurm but sbatch is not on PATH; load SLURM's client, or use --cluster local"
            )
        return "local", "running on the local emulator: no SLURM here (sbatch not found on PATH)"
    found = ping()
    if found.answered:
        return "slurm", f"submitting to SLURM ({found.controller} answers)"
    if not found.configured and choice == "auto":
        return "local", f"running on the local emulator: SLURM is installed but not configured here ({found.said})"
    if not found.configured:
        raise SchedulerError(
            f"--cluster slurm but SLURM is not configured here ({found.said}); set SLURM_CONF, or use --cluster local"
        )
    if "did not answer" in found.said:
        raise SchedulerTimeout(
            f"{found.said}; nothing submitted: try again, or --cluster local to run on this machine",
            command="scontrol ping",
            timeout_s=found.timeout_s,
        )
    raise SchedulerError(
        f"{found.controller} does not answer ({found.said}); nothing submitted: try again, or --cluster local "
        f"to run on this machine"
    )


# ----------------------------------------------------------------------------- what runs on each task


def task_function(spec) -> tuple[Callable, tuple]:
    """The callable (and its arguments) that submitit runs on every task of ``spec``."""
    if spec.launch.launcher == "torchrun":
        return RUN_TORCHRUN, (spec.run, spec.gpus_per_node)
    return RUN_TASK, (spec.run,)


def _submitit_command(logs_dir: Path) -> str:
    return " ".join([shlex.quote(sys.executable), "-u -m hpc_hsdp.runtime.submitit_job", shlex.quote(str(logs_dir))])


def submission_script(spec) -> str:
    """The exact text that ``submit`` hands to sbatch (and to the emulator) for ``spec``."""
    from hpc_hsdp.job.render import render_sbatch  # noqa: PLC0415  (jinja2: status, logs and cancel load this module and render nothing)

    return render_sbatch(spec, launch_command=_submitit_command(Path(spec.log_dir)))


# ----------------------------------------------------------------------------- records and handles


@dataclass(frozen=True, kw_only=True)
class JobStatus:
    state: str
    """The job's state: SLURM's answer; when it did not answer, the last known one (or a final
    state from the accounting), ``UNKNOWN`` without either."""
    exit_code: str | None = None
    restarts: int = 0
    reason: str | None = None
    controller_answered: bool | None = None
    """Whether the SLURM controller answered this query (None: not asked, a local job)."""
    accounting_answered: bool | None = None
    """Whether ``sacct`` answered (None: not asked; the queue said enough)."""
    note: str | None = None
    """In words, when the state is not SLURM's current answer: who did not answer, and what is shown instead."""
    last_known_state: str | None = None
    """The state SLURM last told (``<run-dir>/job_state.json``), when it did not answer now."""
    last_known_at: float | None = None
    """When SLURM told ``last_known_state`` (epoch seconds)."""

    @property
    def finished(self) -> bool:
        return self.state.split()[0] in TERMINAL

    @property
    def current(self) -> bool:
        """The state is what the scheduler just said (not a last known one)."""
        return self.note is None

    def last_known_age_s(self, now: float | None = None) -> float | None:
        if self.last_known_at is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.last_known_at)

    def to_dict(self, now: float | None = None) -> dict:
        age = self.last_known_age_s(now)
        return {
            "controller_answered": self.controller_answered,
            "accounting_answered": self.accounting_answered,
            "scheduler_note": self.note,
            "last_known_state": self.last_known_state,
            "last_known_age_s": None if age is None else round(age, 1),
        }


class JobHandle:
    """State, logs and cancel of one submitted job, SLURM or local."""

    def __init__(self, record: JobRecord) -> None:
        self.record = record

    @classmethod
    def find(cls, ref: str) -> JobHandle:
        return cls(JobRecord.load(ref))

    @property
    def job_id(self) -> str:
        return self.record.job_id

    def status(self) -> JobStatus:
        if self.record.cluster == "local":
            from hpc_hsdp.job.local import LocalJob  # noqa: PLC0415  (the emulator (~25 ms), only for a job it runs)

            info = LocalJob(logs_dir=Path(self.record.logs_dir), job_id=self.job_id).info()
            code = info.get("exit_code")
            status = JobStatus(state=info["state"], exit_code=None if code is None else str(code))
            if status.finished:
                claims.release_claim(self.record.run_dir, self.job_id, ended=status.state)
            return status
        return _slurm_status(self.record)

    def works_in(self) -> Path | None:
        """The logs directory the job writes, as the scheduler itself records it: SLURM's
        ``StdOut`` of ``scontrol show job`` (the batch log, in ``<run-dir>/logs``), the emulator's
        state file (the run directory it was launched for). None when it does not say (the job
        left the queue, an older state file)."""
        if self.record.cluster == "local":
            from hpc_hsdp.job.local import LocalJob  # noqa: PLC0415  (the emulator (~25 ms), only for a job it runs)

            info = LocalJob(logs_dir=Path(self.record.logs_dir), job_id=self.job_id).info()
            logs = info.get("logs_dir")
            if not isinstance(logs, str) or not logs:  # a state file of before: its script lies in the logs
                logs = str(Path(info["script"]).parent) if isinstance(info.get("script"), str) else None
            return Path(logs) if logs else None
        try:
            shown = run_slurm(["scontrol", "-o", "show", "job", check_job_id(self.job_id)])
        except SchedulerError:
            return None
        for item in shown.stdout.split():
            if item.startswith("StdOut=") and item[len("StdOut=") :].startswith("/"):
                return Path(item[len("StdOut=") :]).parent
        return None

    def runs_elsewhere(self) -> Path | None:
        """Where the job writes, when the scheduler says that is not this run directory (this
        one is a copy, or was moved); None when it is this one, or the scheduler does not say."""
        logs = self.works_in()
        if logs is None or same_dir(logs, self.record.logs_dir):
            return None
        return logs.parent if logs.name == "logs" else logs

    def cancel(self) -> None:
        """Cancel the job (check :meth:`runs_elsewhere` first: the record may be a copy's)."""
        if self.record.cluster == "local":
            from hpc_hsdp.job.local import LocalJob  # noqa: PLC0415  (the emulator (~25 ms), only for a job it runs)

            LocalJob(logs_dir=Path(self.record.logs_dir), job_id=self.job_id).cancel()
            return
        try:
            done = run_slurm(["scancel", check_job_id(self.job_id)])
        except SchedulerTimeout as exc:
            raise SchedulerError(
                f"{exc}: job {self.job_id} may not be cancelled; see hpc-hsdp status {self.record.run_dir}, "
                f"and try again"
            ) from None
        if done.returncode != 0:
            raise SchedulerError(f"scancel {self.job_id} failed: {' '.join(done.stderr.split())}")

    def last_metrics(self) -> dict | None:
        """The latest record of ``<run-dir>/metrics.jsonl`` (step, loss, tokens_per_s, ...)."""
        return last_metrics(self.record.run_dir)

    def recent_metrics(self, max_bytes: int = 262_144) -> list[dict]:
        """The records in the last ``max_bytes`` of ``<run-dir>/metrics.jsonl`` (a torn line is skipped)."""
        return recent_metrics(self.record.run_dir, max_bytes)

    def time_limits(self) -> tuple[float | None, float | None] | None:
        """(seconds left, time limit per run) of the running job from SLURM; None for the
        local emulator and when SLURM does not say (pending, ended, UNLIMITED)."""
        if self.record.cluster != "slurm":
            return None
        return time_limits(self.job_id)

    def procid_of_rank(self, rank: int) -> int:
        """SLURM's task id of a node-major rank, from layout.json (the rank itself before there is one)."""
        procid = procid_of_rank(self.record.run_dir, rank)
        return rank if procid is None else procid

    def log_paths(self, rank: int | None = None) -> list[Path]:
        logs = Path(self.record.logs_dir)
        if rank is None:
            return sorted(logs.glob(f"{self.job_id}_*_log.out"), key=_task_index) + sorted(
                logs.glob(f"{self.job_id}_*_log.err"), key=_task_index
            )
        if not 0 <= rank < self.record.ntasks:
            raise SpecError(f"--rank {rank} is outside this job's ranks 0-{self.record.ntasks - 1}")
        procid = self.procid_of_rank(rank)
        return [logs / f"{self.job_id}_{procid}_log.out", logs / f"{self.job_id}_{procid}_log.err"]

    def rank_of_task(self, task: int) -> int | None:
        """The node-major rank of SLURM task ``task`` (srun launcher), from layout.json."""
        if self.record.launcher != "srun":
            return None
        rank = rank_of_task(self.record.run_dir, task)
        return task if rank is None else rank

    def failure_summary(self, lines: int = 12) -> str:
        """Which rank failed first and how, with the last lines of its log.

        The cause is the first task srun reports as failed in the batch log of the latest
        run (``srun: error: n2: task 3: Killed`` for a SIGKILL, ``... Exited with exit code
        1`` for a raise; the emulator's ``srun (emulator): task 3 exited with code -9``);
        tasks srun terminated afterwards, and errors that only say a peer went away, are
        effects. Without such a line: the first task log with an error of its own."""
        logs = Path(self.record.logs_dir)
        batch = logs / f"{self.job_id}_0_log.err"
        cause = _first_failed_task(_latest_run(batch.read_text(errors="replace"))) if batch.is_file() else None
        if cause is not None:
            task, node, what = cause
            rank = self.rank_of_task(task)
            who = f"rank {rank} (task {task}{f' on {node}' if node else ''})" if rank is not None else f"task {task}"
            head = f"{who} failed first: {what}"
            path = logs / f"{self.job_id}_{task}_log.err"
            text = _latest_run(path.read_text(errors="replace")) if path.is_file() else ""
            if task == 0:  # task 0's stderr is the batch log: keep the task's own lines
                text = "\n".join(line for line in text.splitlines() if not line.startswith(("srun", "slurmstepd")))
            tail = "\n".join(text.rstrip().splitlines()[-lines:])
            return f"{head}\n--- {path.name} ---\n{tail}" if tail else head
        errs = sorted(logs.glob(f"{self.job_id}_*_log.err"), key=_task_index)
        markers = ("Traceback", "Error", "error:", "FAILED")
        scored = []
        for path in errs:
            text = _latest_run(path.read_text(errors="replace"))
            if any(m in text for m in markers):
                first = min(text.find(m) for m in markers if m in text)
                scored.append((first, path, text))
        if not scored:
            return ""
        # the task whose log shows an error of its own, not one about a peer or srun terminating it, is the cause
        causes = [s for s in scored if not any(m in s[2] for m in _EFFECT_MARKERS) and "terminat" not in s[2].lower()]
        _, path, text = (causes or scored)[0]
        tail = "\n".join(text.rstrip().splitlines()[-lines:])
        return f"--- {path.name} (task {_task_index(path)}) ---\n{tail}"


_EFFECT_MARKERS = (
    "SIGTERM",
    "Connection closed by peer",
    "Connection reset by peer",
    "remote process exited",
    "Broken pipe",
    "DistNetworkError",
)
_RUN_START = "hpc-hsdp: job "  # the batch script's first stderr line of each run: "hpc-hsdp: job N starts (restart R)"
_TASK_START = "[hpc-hsdp] rank "  # a task's first line of each run (runtime.dist.init)
_SRUN_TASK_FAILED = re.compile(
    r"^srun: error: (?P<node>[^:\s]+): task (?P<task>\d+): (?P<what>.+)$"
    r"|^srun \(emulator\): task (?P<etask>\d+) exited with code (?P<code>-?\d+)",
    re.MULTILINE,
)


def _latest_run(text: str) -> str:
    """The part of an appended log written by the latest run of a (requeued) job."""
    for marker in (_RUN_START, _TASK_START):
        at = text.rfind("\n" + marker)
        if at >= 0 or text.startswith(marker):
            return text[at + 1 :] if at >= 0 else text
    return text


def _first_failed_task(batch_log: str) -> tuple[int, str | None, str] | None:
    """(task, node, what happened) of the first task srun reports as failed, not terminated by it."""
    for match in _SRUN_TASK_FAILED.finditer(batch_log):
        if match.group("task") is not None:
            what = match.group("what").strip()
            if what.startswith("Terminated"):
                continue  # srun ended it after another task failed
            if what == "Killed":
                what = "killed by SIGKILL (kill -9, the out-of-memory killer, or the node) | " + match.group(0)
            return int(match.group("task")), match.group("node"), what
        code = int(match.group("code"))
        what = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return int(match.group("etask")), None, what + " | " + match.group(0).split(";")[0]
    return None


def _task_index(path: Path) -> int:
    parts = path.name.split("_")
    return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else 0


def parse_squeue_rows(text: str) -> dict[str, tuple[str, str | None]]:
    """``squeue -h -o %i|%T|%r`` -> {job id: (state, reason or None)}."""
    rows: dict[str, tuple[str, str | None]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or not parts[0] or not parts[1]:
            continue
        job_id, state, reason = parts
        rows.setdefault(job_id, (state, None if reason in ("None", "") else reason))
    return rows


def parse_sacct_rows(text: str) -> dict[str, tuple[str, str]]:
    """``sacct -X -n -P -o JobID,State,ExitCode`` -> {job id: (state, exit code)}, each job's last
    row (its newest record); ``CANCELLED by 0`` -> ``CANCELLED``."""
    rows: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or not parts[0] or not parts[1].strip():
            continue
        job_id, state, code = parts
        rows[job_id] = (state.split()[0], code)
    return rows


@dataclass(frozen=True, kw_only=True)
class _Answers:
    """What one round of queries (one squeue, one sacct) said about some jobs."""

    queued: dict[str, tuple[str, str | None]]
    controller: str | None
    """Why the controller did not answer (None: it answered)."""
    accounted: dict[str, tuple[str, str]]
    accounting: str | None
    """Why the accounting did not answer (None: it answered, or was not asked)."""
    accounting_asked: bool


def _ask(job_ids: list[str]) -> _Answers:
    """One ``squeue`` for every job id, then one ``sacct`` for those not in the queue (all of
    them when the controller did not answer); each bounded by :func:`run_slurm`."""
    job_ids = [check_job_id(job_id) for job_id in job_ids]  # they reach squeue and sacct as arguments
    queued: dict[str, tuple[str, str | None]] = {}
    controller = None
    try:
        shown = run_slurm(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i|%T|%r"])
    except SchedulerError as exc:
        controller = str(exc)
    else:
        said = " ".join(shown.stderr.split())
        if shown.returncode == 0:
            queued = parse_squeue_rows(shown.stdout)
        elif "Invalid job id" not in said:  # SLURM's answer for one id it no longer knows
            controller = f"squeue failed: {said or f'exit code {shown.returncode}'}"
    rest = [job_id for job_id in job_ids if job_id not in queued]
    accounted: dict[str, tuple[str, str]] = {}
    accounting = None
    if rest:
        try:
            acct = run_slurm(["sacct", "-X", "-n", "-P", "-j", ",".join(rest), "-o", "JobID,State,ExitCode"])
        except SchedulerError as exc:
            accounting = str(exc)
        else:
            if acct.returncode == 0:
                accounted = parse_sacct_rows(acct.stdout)
            else:
                accounting = f"sacct failed: {' '.join(acct.stderr.split())[:200] or f'exit code {acct.returncode}'}"
    return _Answers(
        queued=queued, controller=controller, accounted=accounted, accounting=accounting, accounting_asked=bool(rest)
    )


def _status_from(record: JobRecord, answers: _Answers, *, restarts: int | None = None, now: float) -> JobStatus:
    """One job's status from a round of answers; recorded as its last known state when it is
    the scheduler's current one, and completed with the last known one when it is not."""
    job_id = record.job_id
    known = load_job_state(record.run_dir, job_id)
    known_restarts = int(known.get("restarts") or 0) if known else 0
    asked = {
        "controller_answered": answers.controller is None,
        "accounting_answered": None if not answers.accounting_asked else answers.accounting is None,
    }
    current: JobStatus | None = None
    if job_id in answers.queued:
        state, reason = answers.queued[job_id]
        current = JobStatus(
            state=state, reason=reason, restarts=known_restarts if restarts is None else restarts, **asked
        )
    elif job_id in answers.accounted and (answers.controller is None or answers.accounted[job_id][0] in TERMINAL):
        # out of the queue and in the accounting; or the accounting holds its end (final, whoever is silent)
        state, code = answers.accounted[job_id]
        current = JobStatus(
            state=state, exit_code=code, restarts=known_restarts if restarts is None else restarts, **asked
        )
    elif answers.controller is None and answers.accounting is None:
        return JobStatus(state="UNKNOWN", restarts=known_restarts, reason="no accounting record", **asked)
    if current is not None and (answers.controller is None or current.finished):
        save_job_state(
            record.run_dir,
            job_id,
            state=current.state,
            exit_code=current.exit_code,
            restarts=current.restarts,
            reason=current.reason,
            now=now,
            previous=known,
        )
        if current.finished:
            claims.release_claim(record.run_dir, job_id, ended=current.state)
        if answers.controller is None:
            return current
        return replace(current, note=f"{answers.controller}; the accounting has the job's end")
    # not SLURM's current answer: say who did not answer and show the last known state
    silent = answers.controller or answers.accounting
    accounting_state = answers.accounted.get(job_id, (None,))[0]
    # the controller answered that the job left the queue: it ended, but how is unknown
    state = "UNKNOWN" if answers.controller is None else (known or {}).get("state") or accounting_state or "UNKNOWN"
    if answers.controller is not None and answers.accounting is not None:
        silent += f"; {answers.accounting}"
    if known:
        shown = f"last known state {known['state']}, {_age_words(now - float(known.get('at') or now))} ago"
    elif accounting_state:
        shown = f"no state recorded before; the accounting says {accounting_state}, which may be behind"
    else:
        shown = "no state recorded before"
    return JobStatus(
        state=state,
        exit_code=(known or {}).get("exit_code"),
        restarts=known_restarts,
        reason=(known or {}).get("reason"),
        note=f"{silent} ({shown})",
        last_known_state=(known or {}).get("state"),
        last_known_at=float(known["at"]) if known and known.get("at") else None,
        **asked,
    )


def _age_words(seconds: float) -> str:
    return duration(max(0.0, seconds))


def _slurm_status(record: JobRecord) -> JobStatus:
    """The state of one SLURM job: ``squeue`` while the controller knows it (restarts from
    ``scontrol show job``), else ``sacct``; each call bounded. When the controller does not
    answer, no further call is made to it."""
    answers = _ask([record.job_id])
    restarts = None
    if answers.controller is None:
        try:
            restarts = _restart_count(record.job_id)
        except SchedulerError:
            restarts = None
    return _status_from(record, answers, restarts=restarts, now=time.time())


def job_statuses(records: list[JobRecord]) -> dict[str, JobStatus]:
    """The status of every job of ``records``, keyed by run directory: local jobs from their
    state files, every SLURM job from one ``squeue`` and one ``sacct`` call together (restarts:
    the last known ones)."""
    statuses: dict[str, JobStatus] = {}
    slurm = [record for record in records if record.cluster == "slurm"]
    for record in records:
        if record.cluster != "slurm":
            try:
                statuses[record.run_dir] = JobHandle(record).status()
            except (OSError, ValueError) as exc:  # a broken state file is shown, not fatal
                statuses[record.run_dir] = JobStatus(state="UNKNOWN", reason=f"{type(exc).__name__}: {exc}"[:200])
    if slurm:
        answers = _ask(sorted({record.job_id for record in slurm}))
        now = time.time()
        for record in slurm:
            statuses[record.run_dir] = _status_from(record, answers, now=now)
    return statuses


def parse_slurm_duration(text: str) -> float | None:
    """SLURM's ``[days-]hours:minutes:seconds`` / ``minutes:seconds`` / ``minutes`` -> seconds;
    None for ``UNLIMITED``, ``NOT_SET``, ``INVALID`` and anything else."""
    text = text.strip()
    days, has_days = 0, "-" in text
    if has_days:
        head, _, text = text.partition("-")
        if not head.isdigit():
            return None
        days = int(head)
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    numbers = [int(p) for p in parts]
    if has_days:  # days-hours[:minutes[:seconds]]
        numbers += [0] * (3 - len(numbers))
        seconds = numbers[0] * 3600 + numbers[1] * 60 + numbers[2]
    elif len(parts) == 1:  # minutes
        seconds = numbers[0] * 60
    elif len(parts) == 2:  # minutes:seconds
        seconds = numbers[0] * 60 + numbers[1]
    else:
        seconds = numbers[0] * 3600 + numbers[1] * 60 + numbers[2]
    return float(days * 86400 + seconds)


def time_limits(job_id: str) -> tuple[float | None, float | None] | None:
    """(time left, time limit) of a queued or running job: ``squeue -h -j ID -o %L|%l``."""
    job_id = check_job_id(job_id)
    try:
        shown = run_slurm(["squeue", "-h", "-j", job_id, "-o", "%L|%l"])
    except SchedulerError:
        return None
    rows = [r for r in shown.stdout.splitlines() if "|" in r]
    if shown.returncode != 0 or not rows:
        return None
    left, _, limit = rows[0].partition("|")
    return parse_slurm_duration(left), parse_slurm_duration(limit)


def _restart_count(job_id: str) -> int:
    """How often SLURM restarted the job: ``Restarts=`` of ``scontrol show job`` while the
    controller knows it, else the REQUEUED rows of ``sacct -D`` (22.05's sacct has no Restarts)."""
    shown = run_slurm(["scontrol", "-o", "show", "job", job_id])
    for field in shown.stdout.split():
        if field.startswith("Restarts="):
            return int(field.split("=", 1)[1])
    acct = run_slurm(["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "State"])
    return sum(1 for row in acct.stdout.splitlines() if row.strip().startswith("REQUEUED"))


# ----------------------------------------------------------------------------- submission


ACTIVE_STATES = (
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "RESIZING",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SIGNALING",
    "STAGE_OUT",
)


def check_run_dir(spec, *, own_function: bool = False, state=None, writers: bool = True) -> str | None:
    """Before submitting into ``spec``'s run directory: refuse when a job still runs there or
    its run already completed (SpecError, nothing submitted); else what to say first: that a
    stale claim is taken over (:func:`check_writer`), from which step the job resumes (None:
    nothing, a fresh start). ``state``: the directory's :func:`~hpc_hsdp.rundir.state.run_dir_state`,
    when read already. ``writers=False``: the writers were checked already (:func:`claimed`)."""
    from hpc_hsdp.rundir.state import resubmission_note  # noqa: PLC0415  (the run directory is read on a submission, not when status/logs/--help load this module)

    run_dir = Path(spec.run.run_dir)
    takeover = check_writer(run_dir) if writers else None
    resumes = None
    if spec.run.entry is None and not own_function:  # a function of the user's keeps its own state
        resumes = resubmission_note(run_dir, steps=spec.run.training.steps, state=state)
    return "\n".join(line for line in (takeover, resumes) if line) or None


def _writers(run_dir: Path) -> list[tuple[JobHandle, dict | None]]:
    """The jobs that may write ``run_dir``: the one its claim names, and the one its
    ``job.json`` names (a directory written before claims); with the claim, when it names the job."""
    found: list[tuple[JobHandle, dict | None]] = []
    claim = claims.read_claim(run_dir)
    if claim is not None and claim.get("job_id") and claim.get("cluster") in ("slurm", "local"):
        logs = claim.get("logs_dir") if isinstance(claim.get("logs_dir"), str) else "logs"
        try:
            record = JobRecord(
                job_id=check_job_id(claim["job_id"], where=f"{claims.claim_path(run_dir)}: job_id"),
                cluster=claim["cluster"],
                run_dir=str(run_dir),
                logs_dir=str(run_dir / logs) if ".." not in Path(logs).parts else str(run_dir / "logs"),
                job_name="",
                ntasks=1,
                launcher="srun",
                submitted_at=0.0,
            )
            found.append((JobHandle(record), claim))
        except HsdpError:
            pass  # a claim whose job id is not one: no job holds it
    if job_record_path(run_dir).is_file():
        try:
            handle = JobHandle.find(str(run_dir))
        except HsdpError:
            handle = None
        if handle is not None and all(h.job_id != handle.job_id for h, _ in found):
            found.append((handle, None))
    return found


def check_writer(
    run_dir: Path, *, own_job: str | None = None, refused: str = "nothing submitted", taker: str = "this submission"
) -> str | None:
    """Refuse (SpecError, one line naming it) when a job pending or running writes ``run_dir``
    (other than ``own_job``, the job asking: a requeued attempt of the claimant is the claimant),
    or an ``hpc-hsdp run`` outside any job still does; else the line to say when a claim was
    left by a job (or run) that ended without releasing it, or by a job that writes another
    directory (this one is a copy of it, or was moved) (None: nothing to say). ``refused``:
    what the refusal says was not done; ``taker``: who takes the claim over."""
    said = _check_bare_run(run_dir, refused, taker)
    for handle, claim in _writers(run_dir):
        if own_job is not None and handle.job_id == own_job:
            continue
        try:
            status = handle.status()
            job_state, silent = status.state.split()[0], status.controller_answered is False
        except (HsdpError, OSError, subprocess.SubprocessError):
            job_state, silent = "UNKNOWN", False
        if job_state == "UNKNOWN" and silent and handle.record.cluster == "slurm":
            if shutil.which("sbatch") is not None and ping_controller().configured:  # it may well still run
                raise SpecError(
                    f"SLURM did not answer about job {handle.job_id}, which claims run directory {run_dir}: "
                    f"{refused}; try again"
                )
            job_state = "UNKNOWN (no SLURM here to ask)"  # a run copied off the cluster, say
        if job_state in ACTIVE_STATES:
            elsewhere = handle.runs_elsewhere()
            if elsewhere is None:
                raise SpecError(
                    f"job {handle.job_id} is still {job_state} in run directory {run_dir}: {refused}; wait "
                    f"for it, cancel it (hpc-hsdp cancel {run_dir}) or choose a new --run-dir"
                )
            said = (
                f"run directory {run_dir} is a copy of {elsewhere}, where job {handle.job_id} is still {job_state}: "
                f"{taker} claims the copy"
            )
        elif claim is not None and claim.get("state") == claims.CLAIMED:
            said = (
                f"run directory {run_dir} was claimed by job {handle.job_id}, which is {job_state}: {taker} takes "
                f"the claim over"
            )
    claim = claims.read_claim(run_dir)
    if said is None and claim is not None and claim.get("state") == claims.SUBMITTING:  # no job id: none to ask about
        said = (
            f"run directory {run_dir} was claimed by a submission (pid {claim.get('pid')} on {claim.get('host')}) "
            f"that did not finish: {taker} takes the claim over"
        )
    return said


def _check_bare_run(run_dir: Path, refused: str, taker: str) -> str | None:
    """A claim of ``hpc-hsdp run`` started outside any job (its pid and host, no job id):
    refused while that process lives, taken over (and said) once it is gone."""
    claim = claims.read_claim(run_dir)
    if claim is None or claim.get("state") != claims.CLAIMED or claim.get("job_id") is not None:
        return None
    pid, host = claim.get("pid"), claim.get("host")
    if host != claims.who()["host"]:
        raise SpecError(
            f"hpc-hsdp run (pid {pid} on {host}) claims run directory {run_dir}, and its end cannot be seen from "
            f"this host: {refused}; if it has ended, remove {claims.claim_path(run_dir)}"
        )
    from hpc_hsdp.job.local import process_start_time  # noqa: PLC0415  (the emulator's process check, only for such a claim)

    started = process_start_time(pid) if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None
    if started is not None and claim.get("pid_started") in (None, started):
        raise SpecError(
            f"hpc-hsdp run (pid {pid} on {host}) still writes run directory {run_dir}: {refused}; wait for "
            f"it, stop it, or choose a new --run-dir"
        )
    return f"run directory {run_dir} was claimed by hpc-hsdp run (pid {pid} on {host}), which has ended: {taker} takes the claim over"


def claim_for_task(run_dir: str | Path, env: Mapping[str, str]) -> tuple[str | None, bool]:
    """``hpc-hsdp run`` on rank 0, before anything is written: take ``run_dir``'s claim for the
    job it belongs to (``SLURM_JOB_ID``: the emulator's or SLURM's; none: this process). A
    claim of this very job (the submission's, or an earlier attempt of a requeued job) is
    kept as it is; one of another job pending or running, or of a live run, refuses
    (SpecError, one line). Returns what to say of a claim taken over, and whether the claim
    is this process's own (to release with :func:`release_task_claim` when it ends)."""
    from hpc_hsdp.job.local import process_start_time  # noqa: PLC0415  (a process's identity, for a claim without a job)

    run_dir = Path(run_dir)
    _make_dirs(run_dir)
    job_id = env.get("SLURM_JOB_ID") or None
    with claims.claim_lock(run_dir, wait_s=CLAIM_WAIT_S + slurm_timeout_s()):
        claim = claims.read_claim(run_dir)
        if job_id is not None and claim is not None and claim.get("job_id") == job_id:
            if claim.get("state") != claims.CLAIMED:  # released when it was seen to end, and requeued since
                fields = {k: v for k, v in claim.items() if k in ("cluster", "logs_dir")}
                claims.write_claim(run_dir, claims.CLAIMED, job_id=job_id, **fields)
            return None, False
        said = check_writer(run_dir, own_job=job_id, refused="nothing started", taker="this run")
        if job_id is None:
            claims.write_claim(run_dir, claims.CLAIMED, job_id=None, pid_started=process_start_time(os.getpid()))
        else:
            cluster = "local" if env.get("HPC_HSDP_EMULATOR") == "1" else "slurm"
            claims.write_claim(run_dir, claims.CLAIMED, job_id=check_job_id(job_id), cluster=cluster, logs_dir="logs")
        return said, job_id is None


def release_task_claim(run_dir: str | Path) -> None:
    """The end of an ``hpc-hsdp run`` outside any job: its claim (this pid's) released."""
    run_dir = Path(run_dir)
    try:
        with claims.claim_lock(run_dir, wait_s=5.0):
            claim = claims.read_claim(run_dir)
            mine = claim is not None and claim.get("pid") == os.getpid() and claim.get("host") == claims.who()["host"]
            if mine and claim.get("state") == claims.CLAIMED and claim.get("job_id") is None:
                claims.write_claim(run_dir, claims.RELEASED, job_id=None)
    except (OSError, HsdpError):
        pass


CLAIM_WAIT_S = 120.0
"""How long a submission waits for another one into the same run directory to record its job
(on top of sbatch's own bound)."""


@contextmanager
def claimed(run_dir: str | Path, *, cluster: str) -> Iterator[tuple[str | None, Callable[[JobRecord], None]]]:
    """Hold ``run_dir``'s claim for a submission to ``cluster``: the lock, the check that no job
    pending or running writes it (:func:`check_writer`, which refuses), then a ``submitting``
    claim, before anything of the job is written. Yields what to say of a claim taken over and
    the function that records the job (``claimed``, its id) once it was submitted. When the
    submission fails, the claim left before is put back and what was created for it (the
    directory itself) is removed."""
    run_dir = Path(run_dir)
    created = _make_dirs(run_dir)

    def record(job: JobRecord) -> None:
        logs = Path(job.logs_dir)
        relative = logs.relative_to(run_dir) if logs.is_relative_to(run_dir) else logs
        claims.write_claim(run_dir, claims.CLAIMED, job_id=job.job_id, cluster=job.cluster, logs_dir=str(relative))

    try:
        with claims.claim_lock(run_dir, wait_s=CLAIM_WAIT_S + slurm_timeout_s()):
            try:
                before = claims.claim_path(run_dir).read_bytes()
            except FileNotFoundError:
                before = None
            takeover = check_writer(run_dir)
            try:
                claims.write_claim(run_dir, claims.SUBMITTING, cluster=cluster)
                yield takeover, record
            except BaseException:
                _put_back(run_dir, before)
                raise
    except BaseException:
        if created:  # the directory was made for this submission: leave nothing of it
            for name in (claims.CLAIM, claims.CLAIM_LOCK):
                try:
                    (run_dir / name).unlink()
                except OSError:
                    pass
            for folder in reversed(created):
                try:
                    folder.rmdir()
                except OSError:
                    break
        raise


def _put_back(run_dir: Path, before: bytes | None) -> None:
    path = claims.claim_path(run_dir)
    try:
        if before is None:
            path.unlink()
        else:
            path.write_bytes(before)
    except OSError:
        pass


def _make_dirs(path: Path) -> list[Path]:
    """Create ``path`` and its missing parents; the ones this call created (not another
    process at the same moment), outermost first."""
    missing = []
    for folder in [path, *path.parents]:
        if folder.exists():
            break
        missing.append(folder)
    created = []
    for folder in reversed(missing):
        try:
            folder.mkdir()
            created.append(folder)
        except FileExistsError:
            if not folder.is_dir():
                raise
    return created


def submit_spec(spec, *, cluster: str = "auto", fn: Callable | None = None) -> tuple[JobHandle, Any, str]:
    """Submit ``spec``; returns the handle, the submitit-style job object and what to say
    before the job's own line: from which step it resumes (when it does), then why this
    cluster. Nothing is submitted when the spec or cluster is invalid, when a job still runs
    in its run directory, the run there already completed, the tasks could not use the
    job's inputs (:func:`~hpc_hsdp.job.preflight.check_job_inputs`) or a ``--tracker`` is
    not installed (:func:`~hpc_hsdp.job.preflight.check_trackers`)."""
    from hpc_hsdp.rundir.state import run_dir_state  # noqa: PLC0415  (the run directory is read on a submission, not when status/logs/--help load this module)

    if spec.launch.container_image is not None:
        raise SpecError(
            f"submit --container-image {spec.launch.container_image!r}: submit runs this machine's interpreter "
            f"({sys.executable}) with submitit inside the image, which it does not have; render the script and "
            f"sbatch it (hpc-hsdp render ... -o job.sbatch; docs/gpu-cluster.md, Containers)"
        )
    if fn is not None and spec.launch.launcher != "srun":
        raise SpecError(
            "a Python function runs on every task only with --launcher srun; drop fn or the torchrun launcher"
        )
    check_trackers(spec.run.training)  # a tracker asked for and not installed: nothing submitted
    # first where it goes: a SLURM controller that does not answer refuses the job before anything is read or written
    target, reason = resolve_cluster(cluster)
    check_fp8_gpus(spec, target)  # --precision fp8 where the job's GPUs are known to lack it: nothing written
    # one writer per run directory: the claim is taken (or refused) before anything of the job is written
    with claimed(spec.run.run_dir, cluster=target) as (takeover, claim_job):
        state = run_dir_state(spec.run.run_dir)  # read once: the resume note and the data position both come from it
        resumes = check_run_dir(spec, own_function=fn is not None, state=state, writers=False)
        mixture_note = check_job_inputs(spec, own_function=fn is not None, state=state)
        func, args = task_function(spec)
        kwargs = {"fn": fn} if fn is not None else {}
        logs_dir = Path(spec.log_dir)
        logs_dir.mkdir(parents=True, exist_ok=True)
        if target == "slurm":
            _check_partition(spec)
            job = _submit_slurm(spec, func, args, kwargs)
            job_id = str(job.job_id)
        else:
            job = _submit_local(spec, func, args, kwargs)
            job_id = job.job_id
        record = JobRecord(
            job_id=job_id,
            cluster=target,
            run_dir=str(spec.run.run_dir),
            logs_dir=str(logs_dir),
            job_name=spec.scheduler.job_name,
            ntasks=spec.world_size,
            launcher=spec.launch.launcher,
            submitted_at=time.time(),
        )
        claim_job(record)
        record.save()
    return JobHandle(record), job, "\n".join(line for line in (takeover, resumes, mixture_note, reason) if line)


def check_fp8_gpus(spec, target: str) -> None:
    """``--precision fp8`` refused (:class:`SpecError`, one line) when the GPUs the job's tasks
    will get are known to lack Float8: the local emulator's are this machine's
    (:func:`~hpc_hsdp.job.local.local_gpus`); a SLURM job's are those of its partition's nodes
    (:func:`slurm_gpu_nodes`). Known-new or unknown GPU types go on: each task checks its own
    GPU at its start (:func:`~hpc_hsdp.runtime.device.check_training_device`)."""
    if spec.run.training.precision != "fp8" or spec.run.device == "cpu":  # with --device cpu the spec refused it
        return
    if target == "local":
        from hpc_hsdp.job.local import local_gpus  # noqa: PLC0415  (the emulator (~25 ms), only for a job it runs)

        refusal = fp8_local_refusal(local_gpus())
    else:
        found = slurm_gpu_nodes(spec)
        refusal = (
            None if found is None else fp8_slurm_refusal(found[0], where=found[1], gpus_per_node=spec.gpus_per_node)
        )
    if refusal is not None:
        raise SpecError(refusal)


def slurm_gpu_nodes(spec) -> tuple[list[NodeGpus], str] | None:
    """The nodes SLURM may give ``spec`` (its ``--partition``, else the default partition; only
    those that can satisfy its ``--constraint``, ``--sbatch nodelist=`` and ``exclude=``) with
    their GPUs, and those nodes in words; one ``sinfo``. None where they cannot be told here:
    a ``--template`` of the site's (its own #SBATCH lines may ask for other GPUs), ``--sbatch
    clusters=`` (another cluster), or sinfo did not answer."""
    extra = dict(spec.scheduler.extra)
    if spec.template is not None or {"clusters", "cluster"} & extra.keys():
        return None
    partition = spec.scheduler.partition
    argv = ["sinfo", "-h", "-N", "-o", SINFO_NODE_FORMAT]
    try:
        shown = run_slurm([*argv, f"--partition={partition}"] if partition else argv)
    except SchedulerError:
        return None
    if shown.returncode != 0:
        return None  # an unknown partition: _check_partition says so
    rows = parse_sinfo_nodes(shown.stdout)
    wanted = set(partition.split(",")) if partition else {row.partition for row in rows if row.default}
    rows = [row for row in rows if row.partition in wanted]
    where = f"partition {partition!r}" if partition else f"the default partition {', '.join(sorted(wanted))!r}"
    constraint = spec.scheduler.constraint
    if constraint:
        rows = [row for row in rows if satisfies_constraint(constraint, row.features) is not False]
        where += f" with --constraint {constraint!r}"
    for key, keep in (("nodelist", True), ("exclude", False)):
        if extra.get(key):
            try:
                named = set(expand_nodelist(extra[key]))
            except HsdpError:
                return None  # sbatch says what is wrong with it
            rows = [row for row in rows if (row.node in named) == keep]
            where += f" ({key} {extra[key]})"
    return [NodeGpus(row.node, row.gpus, row.features) for row in rows], where


def _check_partition(spec) -> None:
    if not spec.scheduler.partition:
        return
    shown = run_slurm(["scontrol", "show", "partition", spec.scheduler.partition])
    if shown.returncode != 0:
        known = run_slurm(["sinfo", "-h", "-o", "%R"]).stdout.split()
        raise SchedulerError(
            f"--partition {spec.scheduler.partition!r} does not exist on this cluster; choose one of "
            f"{', '.join(sorted(set(known))) or '(none found)'}"
        )


def _submit_slurm(spec, func, args, kwargs):
    import submitit  # noqa: PLC0415  (submitit, only when a job goes to SLURM)

    script = submission_script(spec)

    class RenderedScriptExecutor(submitit.SlurmExecutor):
        """submitit, sending the script ``render`` made for this spec."""

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return script

        def _num_tasks(self) -> int:
            return spec.world_size if spec.launch.launcher == "srun" else spec.nodes

        def _make_submission_command(self, submission_file_path: Path) -> list[str]:
            return bounded_command(super()._make_submission_command(submission_file_path), timeout_s=limit)

    if spec.flexible:  # SLURM may grant fewer nodes: results() are those of the tasks that ran
        from hpc_hsdp.job.flexible_job import FlexibleSlurmJob  # noqa: PLC0415  (imports submitit)

        RenderedScriptExecutor.job_class = FlexibleSlurmJob
    limit = slurm_timeout_s()
    executor = RenderedScriptExecutor(folder=spec.log_dir)
    try:
        job = executor.submit(functools.partial(func, **kwargs), *args)
        if spec.flexible:
            job.tasks_per_node, job.min_nodes = executor._num_tasks() // spec.nodes, spec.min_nodes
        return job
    except submitit.core.utils.FailedJobError as exc:  # sbatch's own stderr is inside
        if getattr(exc.__cause__, "returncode", None) == TIMED_OUT:
            raise SchedulerTimeout(
                f"{daemon_of('sbatch')} did not answer sbatch within {limit:g} s; the job may be queued all the "
                f"same: look with squeue --me before submitting again",
                command="sbatch",
                timeout_s=limit,
            ) from None
        message = " ".join(str(exc).split())
        raise SchedulerError(f"sbatch refused the job: {message[-400:]}") from None


def _submit_local(spec, func, args, kwargs):
    from submitit.core.utils import DelayedSubmission  # noqa: PLC0415  (submitit, only when a job goes to SLURM)

    from hpc_hsdp.job.local import allocation_for, launch_local, new_job_id  # noqa: PLC0415  (the emulator (~25 ms), only for a job it runs)

    job_id = new_job_id()
    DelayedSubmission(functools.partial(func, **kwargs), *args).dump(Path(spec.log_dir) / f"{job_id}_submitted.pkl")
    tasks_per_node = (1,) * spec.nodes if spec.launch.launcher == "torchrun" else spec.tasks_per_node
    tasks_per_node += (spec.gpus_per_node,) * spec.spare_nodes  # --fault-tolerance replica: spares wait
    alloc = allocation_for(
        tasks_per_node=tasks_per_node, gpus_per_node=spec.gpus_per_node, job_name=spec.scheduler.job_name
    )
    return launch_local(
        submission_script(spec), alloc=alloc, logs_dir=Path(spec.log_dir), job_id=job_id, run_dir=spec.run.run_dir
    )


def submit(fn: Callable | None = None, *, cluster: str = "auto", **options):
    """Python API: submit a job with the options of ``hpc-hsdp submit`` (as keyword
    arguments, ``nodes=2, shard=4, ...``); ``fn(ctx)``, when given, runs on every rank
    after the mesh is built. Returns submitit's Job (SLURM) or a LocalJob with the same
    ``job_id``, ``state``, ``done()``, ``wait()``, ``results()``, ``cancel()``."""
    spec = api_job_spec(options, environ=os.environ, cwd=os.getcwd(), default_venv=running_venv(), new_run_dir=True)
    _, job, _ = submit_spec(spec, cluster=cluster, fn=fn)
    return job


def api_job_spec(
    options: dict[str, Any],
    *,
    environ: Mapping[str, str],
    cwd: str | Path,
    default_venv: str | None,
    new_run_dir: bool = False,
):
    """The JobSpec of :func:`submit`'s keyword arguments, as ``hpc-hsdp submit`` makes it of the
    same options on its command line (config file, profile, precedence)."""
    given = api_options(options)
    return resolve_job_spec(
        command_line_layer(given),
        config_path=given.get("config"),
        profile_name=given.get("profile"),
        environ=environ,
        cwd=cwd,
        default_venv=default_venv,
        new_run_dir=new_run_dir,
    )


def api_options(options: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of :func:`submit`, named like the config-file keys (``shard``,
    ``gpus_per_node``, ``env`` and ``sbatch`` as dicts, ``setup`` a string or a list) ->
    the same options as ``hpc-hsdp submit``'s command line gives them (tables as ``KEY=VALUE``
    items). Values are checked as a config file's are."""
    known = {declared.key for declared in OPTIONS}
    converted: dict[str, Any] = {}
    for name, value in options.items():
        if name not in known:
            raise SpecError(f"submit() got an unknown option {name!r}; known options: {', '.join(sorted(known))}")
        kind = OPTION_KINDS.get(name, "path")  # config, profile: strings
        if value is not None:
            if kind == "table" and isinstance(value, dict):
                table = check_kind(name, value, kind, "submit()")  # true: a flag (sbatch), false: left out
                value = tuple(k if v is None else f"{k}={v}" for k, v in table.items() if v is not False)
            else:
                if kind in ("list", "table") and isinstance(value, (str, tuple)):
                    value = [value] if isinstance(value, str) else list(value)  # one line, or KEY=VALUE items
                value = check_kind(name, value, "list" if kind == "table" else kind, "submit()")
        converted[name] = value
    return converted
