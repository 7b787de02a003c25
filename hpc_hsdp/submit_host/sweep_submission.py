"""Submission of a sweep: its points checked, their run directories claimed, its job arrays submitted.

Every point is checked as one submission of its own is (its spec, its inputs, its run
directory: a point that resumes says so), and nothing is written before all of them pass.
The points are one job array per distinct ``#SBATCH`` header (one, where they share it).
Then each point's run directory gets its script (``point.sbatch``, what ``render`` writes for
its options) and, once its array was submitted, its ``job.json`` (job id ``<array>_<task>``);
the sweep's directory gets each array's script (``sweep.sbatch``; ``sweep-1.sbatch``,
``sweep-2.sbatch`` ... where there are several) and ``sweep.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import HsdpError, SchedulerError, SpecError
from hpc_hsdp.files import write_atomically
from hpc_hsdp.job.sweep import (
    ArrayGroup,
    Point,
    check_array_size,
    check_no_array,
    expand,
    group_by_header,
    header_differences,
    parse_axes,
    point_specs,
)
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.rundir.lifecycle.sweep_record import SWEEP_RECORD, SweepPoint, SweepRecord
from hpc_hsdp.scheduler.backends import backend, resolve_cluster
from hpc_hsdp.submit_host.claims import check_run_dir, claimed
from hpc_hsdp.submit_host.preflight import (
    check_checkpoint_store,
    check_fp8_gpus,
    check_job_inputs,
    check_partition,
    check_stores_apart,
    check_tensor_parallel,
    check_trackers,
)
from hpc_hsdp.submit_host.provenance import (
    gather_provenance,
    record_submission,
    snapshot_code,
    snapshot_note,
    user_modules,
)
from hpc_hsdp.submit_host.render import POINT_SCRIPT, render_point, render_sweep, sbatch_options

SWEEP_SCRIPT = "sweep.sbatch"


def script_name(number: int, count: int) -> str:
    """The file of job array ``number`` (from 1) of ``count``: ``sweep.sbatch`` where there is one."""
    return SWEEP_SCRIPT if count == 1 else f"sweep-{number}.sbatch"


@dataclass(frozen=True)
class SweepPlan:
    """A sweep made and checked, nothing written: its points, their specs, their job arrays (one
    per distinct ``#SBATCH`` header) and each array's script."""

    sweep_dir: str
    mode: str
    sweep: tuple[str, ...]
    parallelism: int | None
    points: tuple[Point, ...]
    specs: tuple
    groups: tuple[ArrayGroup, ...]
    scripts: tuple[str, ...]
    """Each array's script, in the order of ``groups``."""

    def point_script(self, index: int = 0) -> str:
        return render_point(self.specs[index])

    @property
    def script(self) -> str:
        """The job array's script, where the points share one header (the only array)."""
        if len(self.scripts) != 1:
            raise ValueError(f"this sweep is {len(self.scripts)} job arrays; see scripts")
        return self.scripts[0]

    def task_of(self, position: int) -> tuple[int, int]:
        """(its array's place in ``groups``, its task id there) of the point at ``position``."""
        for number, group in enumerate(self.groups):
            if position in group.members:
                return number, group.members.index(position)
        raise ValueError(f"no point at {position}")

    def script_names(self) -> list[str]:
        return [script_name(number, len(self.groups)) for number in range(1, len(self.groups) + 1)]

    def render(self, number: int, positions=None, point_scripts: Mapping[int, str] | None = None) -> str:
        """The script of array ``number`` (its place in ``groups``), of its points at ``positions``
        (None: all of them; a sweep submitted again leaves out the completed ones); ``point_scripts``:
        the point scripts submit writes, by position (their SHA-256 goes into the array's script)."""
        group = self.groups[number]
        array = None
        if len(self.groups) > 1:
            differs = header_differences(self.groups)[number]
            array = {"number": number + 1, "count": len(self.groups), "total": len(self.points), "differs": differs}
        members = list(group.members)
        return render_sweep(
            [self.specs[i] for i in members],
            [self.points[i] for i in members],
            sweep_dir=self.sweep_dir,
            mode=self.mode,
            sweep=self.sweep,
            parallelism=self.parallelism,
            tasks=range(len(members)),
            indices=None if positions is None else [members.index(i) for i in positions],
            array=array,
            point_scripts=None if point_scripts is None else [point_scripts[i] for i in members],
        )


def plan_sweep(
    given: Mapping[str, Any],
    *,
    resolve: Callable[[Mapping[str, Any], bool], Any],
    sweep: Sequence[str] | Mapping[str, Sequence[Any]] | None = None,
    new_run_dir: bool = True,
) -> SweepPlan:
    """The sweep of the command line's options ``given`` (by key): its ``--sweep``, ``--sweep-mode``
    and ``--array-parallelism`` as the command line, a config file or its profile set them (or
    ``sweep``, the API's ``{key: [values]}``); ``resolve(options, new_run_dir)`` makes one JobSpec as
    the command does. The sweep's directory is the ``--run-dir`` given, else a new one as a job's would be
    (``new_run_dir``: submit's; render's is the job name's)."""
    base = resolve(dict(given), new_run_dir)  # the options that are not swept, checked once; the sweep's directory
    sweep = base.sweep if sweep is None else sweep
    mode, parallelism = base.sweep_mode, base.array_parallelism
    axes = parse_axes(sweep)
    points = expand(axes, mode)
    sweep_dir = str(base.run.run_dir)
    unswept = {**given, "sweep": (), "sweep_mode": None, "array_parallelism": None}  # each point is one job
    specs = point_specs(points, unswept, sweep_dir, lambda options: resolve(options, False))
    check_no_array(points, [spec.scheduler.extra for spec in specs])  # the command line's are every point's
    groups = tuple(group_by_header([sbatch_options(spec) for spec in specs]))
    texts = tuple(sweep) if not isinstance(sweep, Mapping) else tuple(f"{a.key}={','.join(a.texts)}" for a in axes)
    made = SweepPlan(sweep_dir, mode, texts, parallelism, tuple(points), tuple(specs), groups, ())
    return replace(made, scripts=tuple(made.render(number) for number in range(len(groups))))


def dry_run_text(plan: SweepPlan) -> str:
    """What ``submit --sweep --dry-run`` (and ``render --sweep``) prints: the job array's script,
    which lists every point, its values and its run directory (each point's own script is what
    ``hpc-hsdp render`` prints for the point's options). Where the points differ in their
    ``#SBATCH`` header: which arrays, then each array's script under its file's name."""
    if len(plan.scripts) == 1:
        return plan.scripts[0]
    at_once = (
        f"at most {plan.parallelism} points of each array at once" if plan.parallelism else "as many as fit at once"
    )
    lines = [
        f"# hpc-hsdp submit --sweep: {len(plan.points)} points in {len(plan.groups)} job arrays, one per distinct "
        f"#SBATCH header ({at_once})"
    ]
    for name, group, differs in zip(plan.script_names(), plan.groups, header_differences(plan.groups)):
        names = ", ".join(plan.points[i].name for i in group.members)
        lines.append(f"#   {name}: {differs}: {len(group.members)} point(s): {names}")
    out = "\n".join(lines) + "\n"
    for name, script in zip(plan.script_names(), plan.scripts):
        out += f"\n# ==================== {name}\n{script}"
    return out


def submit_sweep(plan: SweepPlan, *, cluster: str | None = None) -> tuple[SweepRecord, str]:
    """Submit ``plan``: one job array per distinct ``#SBATCH`` header (one, where the points share
    it); its record and what to say first (resumed points, why this cluster). Every array is
    checked before any is submitted; when the scheduler refuses a later one, those already
    submitted are cancelled and nothing is recorded."""
    from hpc_hsdp.rundir.checkpointing.state import run_dir_state  # noqa: PLC0415  (read on a submission only)

    for spec in plan.specs:
        if spec.launch.container_image is not None:
            raise SpecError("submit --sweep --container-image: render each point's script and sbatch it instead")
        check_tensor_parallel(spec, own_function=False)
        check_trackers(spec.run.training.observation)
    check_stores_apart(plan.specs)
    for spec in plan.specs:
        check_checkpoint_store(spec)
    target, reason = resolve_cluster(cluster or plan.specs[0].cluster)  # every point names the same: not swept
    scheduler = backend(target)
    most = scheduler.max_array_size()
    several = len(plan.groups) > 1
    for number, (group, differs) in enumerate(zip(plan.groups, header_differences(plan.groups)), 1):
        check_array_size(len(group.members), most, array=f"{number} ({differs})" if several else "")
    for group in plan.groups:  # each header's partition, its GPUs and --gpus-per-node
        check_partition(plan.specs[group.members[0]], scheduler)
        check_fp8_gpus(plan.specs[group.members[0]], scheduler)
    _room_for_locks(len(plan.points))
    said = [reason]
    # a sweep submitted again into its directory: the points whose run completed are not submitted again
    states = [run_dir_state(spec.run.run_dir) for spec in plan.specs]
    done = {i for i, (spec, state) in enumerate(zip(plan.specs, states)) if _completed(spec, state)}
    todo = [i for i in range(len(plan.points)) if i not in done]
    if not todo:
        raise SpecError(
            f"every point of the sweep in {plan.sweep_dir} already completed its --steps; nothing submitted: "
            f"extend them with --steps N, or choose a new --run-dir"
        )
    if done:
        completed = ", ".join(plan.points[i].name for i in sorted(done))
        said.append(f"{len(done)} point(s) already completed, not submitted again: {completed}")
    # the arrays to submit: (place in plan.groups, the positions of its points to submit)
    arrays = [(n, [i for i in g.members if i not in done]) for n, g in enumerate(plan.groups)]
    arrays = [(n, positions) for n, positions in arrays if positions]
    with ExitStack() as stack:
        recorders = {}
        for i in todo:
            spec, point = plan.specs[i], plan.points[i]
            takeover, claim_job = stack.enter_context(claimed(spec.run.run_dir, cluster=target))
            state = run_dir_state(spec.run.run_dir)
            resumes = check_run_dir(spec, own_function=False, state=state, writers=False)
            note = check_job_inputs(spec, own_function=False, state=state)
            said += [f"{point.name}: {line}" for line in (takeover, resumes, note) if line]
            recorders[i] = claim_job
        sweep_dir = Path(plan.sweep_dir)
        (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
        provenances = dict(zip(todo, _provenances([plan.specs[i] for i in todo])))  # the code as it is now
        notes = [(plan.points[i].name, snapshot_note(provenances[i].get("snapshot"))) for i in todo]
        said += [f"{name}: {note}" for name, note in notes if note]
        # each point's script, with the SHA-256 of its --snapshot-code copy where it has one
        point_scripts = {
            i: render_point(spec, (provenances.get(i, {}).get("snapshot") or {}).get("sha256"))
            for i, spec in enumerate(plan.specs)
        }
        for i in todo:
            spec = plan.specs[i]
            Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
            # 0600, never through a symlink planted there; the array's script carries its SHA-256
            write_atomically(Path(spec.run.run_dir) / POINT_SCRIPT, point_scripts[i], private=True)
        job_of: dict[int, str] = {}  # position -> its array task
        submitted: list[tuple[str, list[int]]] = []
        names = plan.script_names()
        for number, positions in arrays:
            script = plan.render(number, positions if done else None, point_scripts)
            script_path = sweep_dir / names[number]
            write_atomically(script_path, script, private=True)
            members = plan.groups[number].members
            try:
                array_id = scheduler.submit_array(
                    [plan.specs[i] for i in positions],
                    script,
                    script_path,
                    parallelism=plan.parallelism,
                    indices=[members.index(i) for i in positions],
                )
            except HsdpError as exc:
                if not submitted:
                    raise
                raise SchedulerError(_withdrawn(scheduler, submitted, plan, exc)) from None
            submitted.append((array_id, positions))
            job_of.update({i: f"{array_id}_{members.index(i)}" for i in positions})
        now = time.time()
        for i in todo:
            spec = plan.specs[i]
            record = JobRecord(
                job_id=job_of[i],
                cluster=scheduler.name,
                run_dir=str(spec.run.run_dir),
                logs_dir=str(spec.log_dir),
                job_name=spec.scheduler.job_name,
                ntasks=spec.world_size,
                launcher=spec.launch.launcher,
                submitted_at=now,
            )
            recorders[i](record)
            record.save()
            record_submission(
                spec.run.run_dir,
                provenances[i],
                job_id=record.job_id,
                script=point_scripts[i],
                logs_dir=Path(spec.log_dir),
            )
        for i in done:  # a completed point keeps the job that ran it
            ran = _recorded_job(plan.specs[i].run.run_dir)
            if ran is not None:
                job_of[i] = ran
        sweep_record = SweepRecord(
            sweep_dir=plan.sweep_dir,
            job_ids=tuple(array_id for array_id, _ in submitted),
            cluster=scheduler.name,
            mode=plan.mode,
            parallelism=plan.parallelism,
            sweep=plan.sweep,
            points=tuple(
                SweepPoint(index=p.index, name=p.name, values=p.texts, job_id=job_of.get(i))
                for i, p in enumerate(plan.points)
            ),
            submitted_at=now,
        )
        sweep_record.save()
    return sweep_record, "\n".join(line for line in said if line)


def _withdrawn(scheduler, submitted: list[tuple[str, list[int]]], plan: SweepPlan, exc: Exception) -> str:
    """The scheduler refused a later array of the sweep: cancel those already submitted (their
    points never ran: nothing was recorded), and say so with the refusal."""
    left = []
    for array_id, positions in submitted:
        records = [
            JobRecord(
                job_id=f"{array_id}_{n}",
                cluster=scheduler.name,
                run_dir=str(plan.specs[i].run.run_dir),
                logs_dir=str(plan.specs[i].log_dir),
                job_name=plan.specs[i].scheduler.job_name,
                ntasks=plan.specs[i].world_size,
                launcher=plan.specs[i].launch.launcher,
                submitted_at=0.0,
            )
            for n, i in enumerate(positions)
        ]
        try:
            scheduler.cancel_array(array_id, records)
        except HsdpError:
            left.append(array_id)
    ids = ", ".join(array_id for array_id, _ in submitted)
    if left:
        return f"{exc}; job array(s) {ids} of the sweep were submitted, and {', '.join(left)} could not be cancelled: scancel it"
    return f"{exc}; the sweep's job array(s) submitted before it ({ids}) were cancelled: nothing of the sweep runs"


def _recorded_job(run_dir: str) -> str | None:
    """The job ``<run-dir>/job.json`` names (None: none readable)."""
    try:
        return JobRecord.load(run_dir).job_id
    except HsdpError:
        return None


def _provenances(specs) -> list[dict]:
    """What produced each point (:func:`~hpc_hsdp.submit_host.provenance.gather_provenance`), asked once per
    distinct code (the points differ in their code only when --entry or --model is swept), and with
    ``--snapshot-code`` the copy of that code in each point's run directory, which its script runs."""
    gathered: dict[tuple, dict] = {}
    out = []
    for spec in specs:
        key = tuple(user_modules(spec))
        if key not in gathered:
            gathered[key] = gather_provenance(spec)
        provenance = dict(gathered[key])
        if spec.environment.snapshot_code:
            provenance["snapshot"] = snapshot_code(spec.run.run_dir, spec)
        out.append(provenance)
    return out


def _completed(spec, state) -> bool:
    """The point's run directory holds a checkpoint at its last step (or past it)."""
    return state.resume_step is not None and state.resume_step >= spec.run.training.optimizer.steps


def _room_for_locks(count: int) -> None:
    """Every point's claim lock is held until the array is submitted: one descriptor each, which a
    sweep of a thousand points (SLURM's default MaxArraySize) would take past the usual soft limit
    of 1024. Raised towards the hard limit; SpecError where even that is too few."""
    import resource  # noqa: PLC0415

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = count + 256
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise SpecError(
                f"a sweep of {count} points holds {count} run directories' locks while it is submitted, more "
                f"than this shell's open-file limit ({hard}); raise it (ulimit -n) or sweep fewer points"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


__all__ = ["SWEEP_RECORD", "SweepPlan", "dry_run_text", "plan_sweep", "submit_sweep"]
