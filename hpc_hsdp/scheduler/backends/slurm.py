"""SLURM: its answers about jobs (one ``squeue`` and one ``sacct`` for many), its time limits
and restarts, the nodes a job may get, cancel, requeue, and submission through submitit
(:mod:`~hpc_hsdp.scheduler.backends.submitit_hooks`).

Every command goes through one runner, the bounded
:func:`~hpc_hsdp.scheduler.backends.slurm_command.run_slurm` unless a test hands :class:`SlurmBackend`
another (canned answers).
"""

from __future__ import annotations

import re
import shlex
import shutil
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from hpc_hsdp.errors import HsdpError, SchedulerError
from hpc_hsdp.plan.float8_support import NodeGpus, fp8_slurm_refusal
from hpc_hsdp.plan.slurm_facts import SINFO_NODE_FORMAT, check_job_id, parse_sinfo_nodes, satisfies_constraint
from hpc_hsdp.plan.topology import expand_nodelist
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.scheduler.backends.base import Backend, start_detached
from hpc_hsdp.scheduler.backends.slurm_command import Runner, SchedulerTimeout, ping_controller, run_slurm
from hpc_hsdp.scheduler.backends.slurm_task import SlurmJobEnvironment, requeue_job
from hpc_hsdp.scheduler.status import JobStatus, SchedulerAnswers, status_from


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


def ask_slurm(job_ids: list[str], *, runner: Runner = run_slurm) -> SchedulerAnswers:
    """One ``squeue`` for every job id, then one ``sacct`` for those not in the queue (all of
    them when the controller did not answer); each bounded by :func:`run_slurm`."""
    job_ids = [check_job_id(job_id) for job_id in job_ids]  # they reach squeue and sacct as arguments
    queued: dict[str, tuple[str, str | None]] = {}
    controller = None
    try:
        shown = runner(["squeue", "-h", "-r", "-j", ",".join(job_ids), "-o", "%i|%T|%r"])
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
            acct = runner(["sacct", "-X", "-n", "-P", "-j", ",".join(rest), "-o", "JobID,State,ExitCode"])
        except SchedulerError as exc:
            accounting = str(exc)
        else:
            if acct.returncode == 0:
                accounted = parse_sacct_rows(acct.stdout)
            else:
                accounting = f"sacct failed: {' '.join(acct.stderr.split())[:200] or f'exit code {acct.returncode}'}"
    return SchedulerAnswers(
        queued=queued, controller=controller, accounted=accounted, accounting=accounting, accounting_asked=bool(rest)
    )


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


def time_limits(job_id: str, *, runner: Runner = run_slurm) -> tuple[float | None, float | None] | None:
    """(time left, time limit) of a queued or running job: ``squeue -h -j ID -o %L|%l``."""
    job_id = check_job_id(job_id)
    try:
        shown = runner(["squeue", "-h", "-j", job_id, "-o", "%L|%l"])
    except SchedulerError:
        return None
    rows = [r for r in shown.stdout.splitlines() if "|" in r]
    if shown.returncode != 0 or not rows:
        return None
    left, _, limit = rows[0].partition("|")
    return parse_slurm_duration(left), parse_slurm_duration(limit)


def controller_restart_count(job_id: str, *, runner: Runner = run_slurm) -> int:
    """A job's restart count (:attr:`~hpc_hsdp.scheduler.backends.job_environment.JobEnvironment.restart_count`)
    asked of SLURM from outside the job: ``Restarts=`` of ``scontrol show job`` while the
    controller knows it, else the REQUEUED rows of ``sacct -D`` (22.05's sacct has no Restarts)."""
    shown = runner(["scontrol", "-o", "show", "job", job_id])
    for field in shown.stdout.split():
        if field.startswith("Restarts="):
            return int(field.split("=", 1)[1])
    acct = runner(["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o", "State"])
    return sum(1 for row in acct.stdout.splitlines() if row.strip().startswith("REQUEUED"))


def slurm_gpu_nodes(spec, *, runner: Runner = run_slurm) -> tuple[list[NodeGpus], str] | None:
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
        shown = runner([*argv, f"--partition={partition}"] if partition else argv)
    except SchedulerError:
        return None
    if shown.returncode != 0:
        return None  # an unknown partition: check_partition says so
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


def check_node_name(node: str) -> str:
    """A node name read from a run directory, refused unless it is one (it becomes an argument of srun)."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", node or ""):
        raise SchedulerError(f"{node!r} is not a node name (layout.json damaged?)")
    return node


def point_logs(job_id: str, logs: Path) -> Path:
    """Where a sweep point (``job_id``: its array task) writes: its batch log is the sweep's
    (``<sweep-dir>/logs``, its array's one ``--output``), its own logs are in the point's run
    directory, which the sweep's record names."""
    if "_" not in job_id or not (logs.parent / "sweep.json").is_file():
        return logs
    from hpc_hsdp.rundir.lifecycle.sweep_record import SweepRecord  # noqa: PLC0415  (sweeps only)

    try:
        sweep = SweepRecord.load(logs.parent)
    except HsdpError:
        return logs
    for point in sweep.points:
        if sweep.task_id(point) == job_id:
            return sweep.point_dir(point) / "logs"
    return logs


def side_job_sbatch(argv: Sequence[str], *, name: str, job_env) -> list[str]:
    """The ``sbatch`` of a side job (:meth:`SlurmBackend.submit_side_job`): one task on one node,
    the partition and account of the job whose environment is ``job_env``, ``argv`` wrapped (it
    writes its own output)."""
    sbatch = ["sbatch", "--parsable", "--nodes=1", "--ntasks=1", f"--job-name={name}"]
    sbatch.append("--output=/dev/null")  # ``argv`` writes ``output`` itself: sbatch's would follow a symlink there
    for variable, flag in (("SLURM_JOB_PARTITION", "--partition"), ("SLURM_JOB_ACCOUNT", "--account")):
        if job_env.get(variable):
            sbatch.append(f"{flag}={job_env[variable]}")
    return [*sbatch, "--wrap", shlex.join(argv)]


class SlurmBackend(Backend):
    """SLURM, asked through ``runner`` (the bounded runner; canned answers in tests)."""

    name = "slurm"
    title = "SLURM"
    has_time_limits = True
    separate_machines = True
    requeues = True

    def __init__(self, *, runner: Runner = run_slurm) -> None:
        self.runner = runner

    def submit(self, spec, script, func, args, kwargs):
        from hpc_hsdp.scheduler.backends.submitit_hooks import submit_rendered  # noqa: PLC0415  (submitit, only when a job goes to SLURM)

        job = submit_rendered(spec, script, func, args, kwargs)
        return str(job.job_id), job

    def submit_array(self, specs, script, script_path, *, parallelism, indices):
        """``sbatch --parsable`` of the array's script, sent on its stdin: the text submit checked, not
        the file ``script_path``, which another user who can write the sweep's directory could
        swap before sbatch reads it (bounded, as every SLURM command is)."""
        done = self.runner(["sbatch", "--parsable"], input=script)
        said = " ".join((done.stderr or "").split())
        job_id = (done.stdout or "").strip().split(";")[0]
        if done.returncode != 0 or not job_id.isdigit():
            raise SchedulerError(f"sbatch refused the sweep's job array: {said[-400:] or done.stdout[-200:]}")
        return job_id

    def max_array_size(self) -> int | None:
        """``MaxArraySize`` of ``scontrol show config`` (SLURM's default, 1001, when it does not say)."""
        from hpc_hsdp.job.sweep import parse_max_array_size  # noqa: PLC0415  (sweeps only)

        shown = self.runner(["scontrol", "show", "config"])
        if shown.returncode != 0:
            raise SchedulerError(f"scontrol show config failed: {' '.join(shown.stderr.split())[:200]}")
        found = parse_max_array_size(shown.stdout)
        return 1001 if found is None else found

    def statuses(self, records: list[JobRecord]) -> dict[str, JobStatus]:
        """One ``squeue`` and one ``sacct`` for every job together (restarts: the last known ones)."""
        if not records:
            return {}
        answers = ask_slurm(sorted({record.job_id for record in records}), runner=self.runner)
        now = time.time()
        return {record.run_dir: status_from(record, answers, now=now) for record in records}

    def status(self, record: JobRecord) -> JobStatus:
        """``squeue`` while the controller knows the job (restarts from ``scontrol show job``), else
        ``sacct``; each call bounded. When the controller does not answer, no further call is made to it."""
        answers = ask_slurm([record.job_id], runner=self.runner)
        restarts = None
        if answers.controller is None:
            try:
                restarts = controller_restart_count(record.job_id, runner=self.runner)
            except SchedulerError:
                restarts = None
        return status_from(record, answers, restarts=restarts, now=time.time())

    def cancel(self, record: JobRecord) -> None:
        try:
            done = self.runner(["scancel", check_job_id(record.job_id)])
        except SchedulerTimeout as exc:
            raise SchedulerError(
                f"{exc}: job {record.job_id} may not be cancelled; see hpc-hsdp status {record.run_dir}, and try again"
            ) from None
        if done.returncode != 0:
            raise SchedulerError(f"scancel {record.job_id} failed: {' '.join(done.stderr.split())}")

    def cancel_array(self, job_id: str, records: list[JobRecord]) -> None:
        """One ``scancel`` of the whole array."""
        self.cancel(replace(records[0], job_id=job_id))

    def works_in(self, record: JobRecord) -> Path | None:
        """The directory of the job's batch log: ``StdOut`` of ``scontrol show job`` (in ``<run-dir>/logs``)."""
        try:
            shown = self.runner(["scontrol", "-o", "show", "job", check_job_id(record.job_id)])
        except SchedulerError:
            return None
        for item in shown.stdout.split():
            if item.startswith("StdOut=") and item[len("StdOut=") :].startswith("/"):
                return point_logs(record.job_id, Path(item[len("StdOut=") :]).parent)
        return None

    def time_limits(self, record: JobRecord) -> tuple[float | None, float | None] | None:
        return time_limits(record.job_id, runner=self.runner)

    def environment(self, env) -> SlurmJobEnvironment:
        return SlurmJobEnvironment(self, env)

    def requeue(self, job_id: str) -> tuple[bool, str]:
        return requeue_job(job_id)

    def submit_side_job(self, argv, *, name, output, env, job_env):
        """``sbatch --parsable --wrap`` of one task on one node, in the job's partition and account
        (from its environment); outside a SLURM job (``hpc-hsdp run`` by hand), a detached process."""
        if not job_env.get("SLURM_JOB_ID") or shutil.which("sbatch", path=job_env.get("PATH")) is None:
            return start_detached(argv, output=output, env=env)
        try:
            done = self.runner(side_job_sbatch(argv, name=name, job_env=job_env), env=env)
        except SchedulerError as exc:
            return None, " ".join(str(exc).split())[:300]
        said = " ".join((done.stdout + done.stderr).split())[:300]
        job_id = done.stdout.strip().split(";")[0].strip() if done.returncode == 0 else ""
        if not job_id.isdigit():
            return None, f"sbatch failed: {said or f'exit code {done.returncode}'}"
        return job_id, None

    def run_on_nodes(self, record: JobRecord, nodes, argv, *, timeout_s: float) -> tuple[str, str]:
        """One task per node of ``nodes`` in a step of the running job beside its tasks
        (``srun --overlap --jobid``, which SLURM allows the job's user and root only)."""
        nodes = [check_node_name(node) for node in nodes]
        done = self.runner(
            [
                "srun",
                "--overlap",
                f"--jobid={check_job_id(record.job_id)}",
                f"--nodelist={','.join(nodes)}",
                f"--nodes={len(nodes)}",
                f"--ntasks={len(nodes)}",
                "--ntasks-per-node=1",
                "--kill-on-bad-exit=0",
                "--quiet",
                *argv,
            ],
            timeout_s=timeout_s,
        )
        return done.stdout, done.stderr

    def on_node_command(self, record: JobRecord, node: str, argv) -> list[str]:
        """``srun --overlap --jobid=J --nodelist=NODE --unbuffered``: one task, its stdin and stdout
        passed through as they come."""
        return [
            "srun",
            "--overlap",
            f"--jobid={check_job_id(record.job_id)}",
            f"--nodelist={check_node_name(node)}",
            "--nodes=1",
            "--ntasks=1",
            "--unbuffered",
            "--quiet",
            *argv,
        ]

    def check_partition(self, spec) -> None:
        """``scontrol show partition``; where it does not know it, ``sinfo`` for the ones there are."""
        if not spec.scheduler.partition:
            return
        shown = self.runner(["scontrol", "show", "partition", spec.scheduler.partition])
        if shown.returncode != 0:
            known = self.runner(["sinfo", "-h", "-o", "%R"]).stdout.split()
            raise SchedulerError(
                f"--partition {spec.scheduler.partition!r} does not exist on this cluster; choose one of "
                f"{', '.join(sorted(set(known))) or '(none found)'}"
            )

    def fp8_refusal(self, spec) -> str | None:
        """Of the nodes of the job's partition (:func:`slurm_gpu_nodes`)."""
        found = slurm_gpu_nodes(spec, runner=self.runner)
        return None if found is None else fp8_slurm_refusal(found[0], where=found[1], gpus_per_node=spec.gpus_per_node)

    def reachable_here(self) -> bool:
        """SLURM's client is installed and configured here."""
        return shutil.which("sbatch") is not None and ping_controller(runner=self.runner).configured
