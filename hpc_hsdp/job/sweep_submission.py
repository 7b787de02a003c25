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
from hpc_hsdp.job.preflight import check_fp8_gpus, check_job_inputs, check_tensor_parallel, check_trackers
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
    sweep: Sequence[str] | Mapping[str, Sequence[Any]],
    *,
    mode: str,
    parallelism: int | None,
    given: Mapping[str, Any],
    resolve: Callable[[Mapping[str, Any], bool], Any],
) -> SweepPlan:
    """The sweep of ``--sweep`` texts (or the API's ``{key: [values]}``) over the command line's
    options ``given`` (by key); ``resolve(options, new_run_dir)`` makes one JobSpec as the command
    does. The sweep's directory is the ``--run-dir`` given, else a new one as a job's would be."""
    axes = parse_axes(sweep)
    points = expand(axes, mode)
    if parallelism is not None and parallelism < 1:
        raise SpecError(f"--array-parallelism {parallelism} must be a positive integer (points running at once)")
    base = resolve(dict(given), True)  # the options that are not swept, checked once; the sweep's directory
    sweep_dir = str(base.run.run_dir)
    specs = point_specs(points, given, sweep_dir, lambda options: resolve(options, False))
    check_one_header(points, [sbatch_options(spec) for spec in specs])
    texts = tuple(sweep) if not isinstance(sweep, Mapping) else tuple(f"{a.key}={','.join(a.texts)}" for a in axes)
    script = render_sweep(specs, points, sweep_dir=sweep_dir, mode=mode, sweep=texts, parallelism=parallelism)
    return SweepPlan(sweep_dir, mode, texts, parallelism, tuple(points), tuple(specs), script)


def dry_run_text(plan: SweepPlan) -> str:
    """What ``submit --sweep --dry-run`` prints: the points, the array's script, the first point's script."""
    lines = [f"# sweep {plan.sweep_dir}: {len(plan.points)} points ({plan.mode})"]
    for point, spec in zip(plan.points, plan.specs):
        lines.append(f"#   task {point.index}: {point.name} -> {spec.run.run_dir}")
    out = "\n".join(lines) + "\n# ---- the job array's script (sweep.sbatch)\n" + plan.script
    first = plan.specs[0].run.run_dir
    out += f"# ---- point 0's script ({first}/{POINT_SCRIPT}); the others differ in their values and run directory\n"
    return out + plan.point_script(0)


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
    check_fp8_gpus(plan.specs[0], scheduler)
    said = [reason]
    with ExitStack() as stack:
        recorders = []
        for point, spec in zip(plan.points, plan.specs):
            takeover, claim_job = stack.enter_context(claimed(spec.run.run_dir, cluster=target))
            state = run_dir_state(spec.run.run_dir)
            resumes = check_run_dir(spec, own_function=False, state=state, writers=False)
            note = check_job_inputs(spec, own_function=False, state=state)
            said += [f"{point.name}: {line}" for line in (takeover, resumes, note) if line]
            recorders.append(claim_job)
        sweep_dir = Path(plan.sweep_dir)
        (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
        for spec in plan.specs:
            Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
            (Path(spec.run.run_dir) / POINT_SCRIPT).write_text(render_point(spec))
        script_path = sweep_dir / SWEEP_SCRIPT
        script_path.write_text(plan.script)
        job_id = scheduler.submit_array(plan.specs, plan.script, script_path, parallelism=plan.parallelism)
        now = time.time()
        for point, spec, claim_job in zip(plan.points, plan.specs, recorders):
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


__all__ = ["SWEEP_RECORD", "SweepPlan", "dry_run_text", "plan_sweep", "submit_sweep"]
