"""Submission of a sweep: its points checked, their run directories claimed, one job array submitted.

Every point is checked as one submission of its own is (its spec, its inputs, its run
directory: a point that resumes says so), and nothing is written before all of them pass.
Then each point's run directory gets its script (``point.sbatch``, what ``render`` writes for
its options) and, once the array was submitted, its ``job.json`` (job id ``<array>_<index>``);
the sweep's directory gets ``sweep.sbatch`` (the array's script) and ``sweep.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.backends import backend, resolve_cluster
from hpc_hsdp.job.claims import check_run_dir, claimed
from hpc_hsdp.job.preflight import (
    check_fp8_gpus,
    check_job_inputs,
    check_partition,
    check_tensor_parallel,
    check_trackers,
)
from hpc_hsdp.job.provenance import gather_provenance, record_submission, snapshot_code, user_modules
from hpc_hsdp.job.render import POINT_SCRIPT, render_point, render_sweep, sbatch_options
from hpc_hsdp.job.sweep import Point, check_array_size, check_one_header, expand, parse_axes, point_specs
from hpc_hsdp.rundir.job_record import JobRecord
from hpc_hsdp.rundir.sweep_record import SWEEP_RECORD, SweepPoint, SweepRecord

SWEEP_SCRIPT = "sweep.sbatch"


@dataclass(frozen=True)
class SweepPlan:
    """A sweep made and checked, nothing written: its points, their specs and the array's script."""

    sweep_dir: str
    mode: str
    sweep: tuple[str, ...]
    parallelism: int | None
    points: tuple[Point, ...]
    specs: tuple
    script: str

    def point_script(self, index: int = 0) -> str:
        return render_point(self.specs[index])


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
    if any(key == "array" for key, _ in base.scheduler.extra):
        raise SpecError("--sbatch array=... and --sweep: the sweep makes the job array itself; drop --sbatch array")
    check_one_header(points, [sbatch_options(spec) for spec in specs])
    texts = tuple(sweep) if not isinstance(sweep, Mapping) else tuple(f"{a.key}={','.join(a.texts)}" for a in axes)
    script = render_sweep(specs, points, sweep_dir=sweep_dir, mode=mode, sweep=texts, parallelism=parallelism)
    return SweepPlan(sweep_dir, mode, texts, parallelism, tuple(points), tuple(specs), script)


def dry_run_text(plan: SweepPlan) -> str:
    """What ``submit --sweep --dry-run`` (and ``render --sweep``) prints: the job array's script,
    which lists every point, its values and its run directory (each point's own script is what
    ``hpc-hsdp render`` prints for the point's options)."""
    return plan.script


def submit_sweep(plan: SweepPlan, *, cluster: str = "auto") -> tuple[SweepRecord, str]:
    """Submit ``plan`` as one job array; its record and what to say first (resumed points, why this cluster)."""
    from hpc_hsdp.rundir.state import run_dir_state  # noqa: PLC0415  (read on a submission only)

    for spec in plan.specs:
        if spec.launch.container_image is not None:
            raise SpecError("submit --sweep --container-image: render each point's script and sbatch it instead")
        check_tensor_parallel(spec, own_function=False)
        check_trackers(spec.run.training)
    target, reason = resolve_cluster(cluster)
    scheduler = backend(target)
    check_array_size(len(plan.points), scheduler.max_array_size())
    check_partition(plan.specs[0], scheduler)  # every point's header is the same (check_one_header)
    check_fp8_gpus(plan.specs[0], scheduler)
    _room_for_locks(len(plan.points))
    said = [reason]
    # a sweep submitted again into its directory: the points whose run completed are not submitted again
    done = [p for p, spec in zip(plan.points, plan.specs) if _completed(spec, run_dir_state(spec.run.run_dir))]
    todo = [(p, spec) for p, spec in zip(plan.points, plan.specs) if p not in done]
    if not todo:
        raise SpecError(
            f"every point of the sweep in {plan.sweep_dir} already completed its --steps; nothing submitted: "
            f"extend them with --steps N, or choose a new --run-dir"
        )
    if done:
        said.append(f"{len(done)} point(s) already completed, not submitted again: {', '.join(p.name for p in done)}")
    script = plan.script
    if done:
        script = render_sweep(
            plan.specs,
            plan.points,
            sweep_dir=plan.sweep_dir,
            mode=plan.mode,
            sweep=plan.sweep,
            parallelism=plan.parallelism,
            indices=[p.index for p, _ in todo],
        )
    with ExitStack() as stack:
        recorders = []
        for point, spec in todo:
            takeover, claim_job = stack.enter_context(claimed(spec.run.run_dir, cluster=target))
            state = run_dir_state(spec.run.run_dir)
            resumes = check_run_dir(spec, own_function=False, state=state, writers=False)
            note = check_job_inputs(spec, own_function=False, state=state)
            said += [f"{point.name}: {line}" for line in (takeover, resumes, note) if line]
            recorders.append(claim_job)
        sweep_dir = Path(plan.sweep_dir)
        (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
        provenances = _provenances([spec for _, spec in todo])  # before the job exists: the code as it is now
        for _, spec in todo:
            Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(spec.run.run_dir) / POINT_SCRIPT).write_text(render_point(spec))
        script_path = sweep_dir / SWEEP_SCRIPT
        script_path.write_text(script)
        job_id = scheduler.submit_array(
            [spec for _, spec in todo],
            script,
            script_path,
            parallelism=plan.parallelism,
            indices=[point.index for point, _ in todo],
        )
        now = time.time()
        for (point, spec), claim_job, provenance in zip(todo, recorders, provenances):
            record = JobRecord(
                job_id=f"{job_id}_{point.index}",
                cluster=scheduler.name,
                run_dir=str(spec.run.run_dir),
                logs_dir=str(spec.log_dir),
                job_name=spec.scheduler.job_name,
                ntasks=spec.world_size,
                launcher=spec.launch.launcher,
                submitted_at=now,
            )
            claim_job(record)
            record.save()
            record_submission(
                spec.run.run_dir,
                provenance,
                job_id=record.job_id,
                script=render_point(spec),
                logs_dir=Path(spec.log_dir),
            )
        sweep_record = SweepRecord(
            sweep_dir=plan.sweep_dir,
            job_id=job_id,
            cluster=scheduler.name,
            mode=plan.mode,
            parallelism=plan.parallelism,
            sweep=plan.sweep,
            points=tuple(SweepPoint(index=p.index, name=p.name, values=p.texts) for p in plan.points),
            submitted_at=now,
        )
        sweep_record.save()
    return sweep_record, "\n".join(line for line in said if line)


def _provenances(specs) -> list[dict]:
    """What produced each point (:func:`~hpc_hsdp.job.provenance.gather_provenance`), asked once per
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
    return state.resume_step is not None and state.resume_step >= spec.run.training.steps


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
