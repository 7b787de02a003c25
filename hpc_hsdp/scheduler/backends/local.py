"""The local emulator behind the interface every scheduler has (:mod:`hpc_hsdp.scheduler.backends.base`):
a job spec's tasks laid out as SLURM would lay them out, handed to the emulator
(:mod:`hpc_hsdp.scheduler.emulator`), which runs the rendered script on this machine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from hpc_hsdp.plan.float8_support import fp8_local_refusal
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.scheduler.backends.base import Backend
from hpc_hsdp.scheduler.emulator.allocation import allocation_for, local_gpus
from hpc_hsdp.scheduler.emulator.emulated_job import LocalJob
from hpc_hsdp.scheduler.emulator.launch import ArrayPoint, launch_array, launch_local
from hpc_hsdp.scheduler.emulator.state_files import new_job_id
from hpc_hsdp.scheduler.status import JobStatus, release_if_ended


def submit_local(spec, script, func, args, kwargs):
    """Start ``script`` (the rendered job of ``spec``) on the emulator, its tasks running ``func(*args, **kwargs)``."""

    from hpc_hsdp.scheduler.backends.submitit_hooks import dump_call  # noqa: PLC0415  (submitit, only when a job is submitted)

    job_id = new_job_id()
    dump_call(spec.log_dir, job_id, func, args, kwargs)
    tasks_per_node = (1,) * spec.nodes if spec.launch.launcher == "torchrun" else spec.tasks_per_node
    tasks_per_node += (spec.gpus_per_node,) * spec.spare_nodes  # --fault-tolerance replica: spares wait
    alloc = allocation_for(
        tasks_per_node=tasks_per_node, gpus_per_node=spec.gpus_per_node, job_name=spec.scheduler.job_name
    )
    return launch_local(script, alloc=alloc, logs_dir=Path(spec.log_dir), job_id=job_id, run_dir=spec.run.run_dir)


def submit_local_array(
    specs, script: str, *, parallelism: int | None, array_dir: Path, indices: Sequence[int] | None = None
) -> str:
    """A sweep's job array on the emulator: every point a PENDING emulated job (``<array>_<i>``, in its
    own run directory's logs, with the variables SLURM gives an array task), and a detached runner
    that starts them in order, at most ``parallelism`` at once. The array's id."""
    indices = list(range(len(specs))) if indices is None else list(indices)
    points = []
    for index, spec in zip(indices, specs):
        tasks_per_node = (1,) * spec.nodes if spec.launch.launcher == "torchrun" else spec.tasks_per_node
        alloc = allocation_for(
            tasks_per_node=tasks_per_node, gpus_per_node=spec.gpus_per_node, job_name=spec.scheduler.job_name
        )
        points.append(ArrayPoint(index=index, alloc=alloc, logs_dir=Path(spec.log_dir), run_dir=spec.run.run_dir))
    return launch_array(script, points, parallelism=parallelism, array_dir=array_dir)


class LocalBackend(Backend):
    """The local emulator: every task a process on this machine; a job's state is its state file."""

    name = "local"
    title = "local emulator"
    has_time_limits = False
    separate_machines = False
    requeues = False

    def __init__(self, *, alive: Callable[[int], bool] | None = None) -> None:
        self.alive = alive

    def job(self, record: JobRecord) -> LocalJob:
        return LocalJob(logs_dir=Path(record.logs_dir), job_id=record.job_id, alive=self.alive)

    def submit(self, spec, script, func, args, kwargs):
        job = submit_local(spec, script, func, args, kwargs)
        return job.job_id, job

    def submit_array(self, specs, script, script_path, *, parallelism, indices):
        logs = Path(script_path).parent / "logs"
        return submit_local_array(specs, script, parallelism=parallelism, array_dir=logs, indices=indices)

    def status(self, record: JobRecord) -> JobStatus:
        info = self.job(record).info()
        code = info.get("exit_code")
        return release_if_ended(record, JobStatus(state=info["state"], exit_code=None if code is None else str(code)))

    def statuses(self, records: list[JobRecord]) -> dict[str, JobStatus]:
        statuses = {}
        for record in records:
            try:
                statuses[record.run_dir] = self.status(record)
            except (OSError, ValueError) as exc:  # a broken state file is shown, not fatal
                statuses[record.run_dir] = JobStatus(state="UNKNOWN", reason=f"{type(exc).__name__}: {exc}"[:200])
        return statuses

    def cancel(self, record: JobRecord) -> None:
        self.job(record).cancel()

    def works_in(self, record: JobRecord) -> Path | None:
        """The run directory the emulator launched the job for, from its state file."""
        info = self.job(record).info()
        logs = info.get("logs_dir")
        if not isinstance(logs, str) or not logs:  # a state file of before: its script lies in the logs
            logs = str(Path(info["script"]).parent) if isinstance(info.get("script"), str) else None
        return Path(logs) if logs else None

    def requeue(self, job_id: str) -> None:
        return None  # the emulator requeues nothing: a stopped job is submitted again

    def fp8_refusal(self, spec) -> str | None:
        return fp8_local_refusal(local_gpus())
