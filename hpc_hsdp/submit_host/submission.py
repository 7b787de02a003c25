"""Submission: a JobSpec checked, its run directory claimed, handed to its scheduler, recorded.

SLURM jobs go through submitit, whose sbatch text is replaced by the script ``render``
produces for the same spec: only the command each task runs differs (submitit's job
runner, ``python -u -m hpc_hsdp.task.submitit_job <folder>``, in place of
``python -m hpc_hsdp run``), so ``hpc-hsdp render`` shows what runs. Without SLURM the
local emulator (:mod:`hpc_hsdp.scheduler.emulator`) runs that same script.

Every job leaves ``<run-dir>/job.json``; a handle is rebuilt from it (or from the job id,
through a small index in the user's state directory) in any new shell.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.task_call import RUN_TASK, RUN_TORCHRUN
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.scheduler.backends import backend, resolve_cluster
from hpc_hsdp.submit_host.claims import check_run_dir, claimed
from hpc_hsdp.submit_host.handle import JobHandle
from hpc_hsdp.submit_host.preflight import (
    check_checkpoint_store,
    check_fp8_gpus,
    check_job_inputs,
    check_partition,
    check_stage_dir,
    check_tensor_parallel,
    check_trackers,
)
from hpc_hsdp.submit_host.provenance import gather_provenance, record_submission, snapshot_code, snapshot_note

# ----------------------------------------------------------------------------- what runs on each task


def task_function(spec) -> tuple[Callable, tuple]:
    """The callable (and its arguments) that submitit runs on every task of ``spec``."""
    if spec.launch.launcher == "torchrun":
        return RUN_TORCHRUN, (spec.run, spec.gpus_per_node)
    return RUN_TASK, (spec.run,)


def _submitit_command(logs_dir: Path) -> str:
    return " ".join([shlex.quote(sys.executable), "-u -m hpc_hsdp.task.submitit_job", shlex.quote(str(logs_dir))])


def submission_script(spec, snapshot_sha256: str | None = None) -> str:
    """The exact text that ``submit`` hands to sbatch (and to the emulator) for ``spec`` (with the
    SHA-256 of its ``--snapshot-code`` copy, which the job checks)."""
    from hpc_hsdp.submit_host.render import render_sbatch  # noqa: PLC0415  (jinja2: status, logs and cancel load this module and render nothing)

    return render_sbatch(spec, launch_command=_submitit_command(Path(spec.log_dir)), snapshot_sha256=snapshot_sha256)


def submit_spec(spec, *, cluster: str | None = None, fn: Callable | None = None) -> tuple[JobHandle, Any, str]:
    """Submit ``spec`` (to ``cluster``, else the one it names); returns the handle, the submitit-style job object and what to say
    before the job's own line: from which step it resumes (when it does), then why this
    cluster. Nothing is submitted when the spec or cluster is invalid, when a job still runs
    in its run directory, the run there already completed, the tasks could not use the
    job's inputs (:func:`~hpc_hsdp.submit_host.preflight.check_job_inputs`) or a ``--tracker`` is
    not installed (:func:`~hpc_hsdp.submit_host.preflight.check_trackers`)."""
    from hpc_hsdp.rundir.checkpointing.state import run_dir_state  # noqa: PLC0415  (the run directory is read on a submission, not when status/logs/--help load this module)

    if spec.sweep:
        raise SpecError("a sweep is one job array of many jobs: submit it with submit --sweep (submit_sweep)")
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
    check_tensor_parallel(spec, own_function=fn is not None)  # --tp that does not split the model: nothing written
    check_trackers(spec.run.training.observation)  # a tracker asked for and not installed: nothing submitted
    check_stage_dir(
        spec.run.training.dataset
    )  # --stage-data DIR that is a file or not writable here: nothing submitted
    stored = check_checkpoint_store(spec)  # --checkpoint-store: extra, bucket, credentials, a write; nothing written
    # first where it goes: a SLURM controller that does not answer refuses the job before anything is read or written
    target, reason = resolve_cluster(cluster or spec.cluster)
    scheduler = backend(target)
    check_partition(spec, scheduler)  # a --partition the cluster does not have: nothing written
    check_fp8_gpus(spec, scheduler)  # --precision fp8 where the job's GPUs are known to lack it: nothing written
    # one writer per run directory: the claim is taken (or refused) before anything of the job is written
    with claimed(spec.run.run_dir, cluster=target) as (takeover, claim_job):
        state = run_dir_state(spec.run.run_dir)  # read once: the resume note and the data position both come from it
        resumes = check_run_dir(spec, own_function=fn is not None, state=state, writers=False)
        mixture_note = check_job_inputs(spec, own_function=fn is not None, state=state)
        func, args = task_function(spec)
        kwargs = {"fn": fn} if fn is not None else {}
        logs_dir = Path(spec.log_dir)
        logs_dir.mkdir(parents=True, exist_ok=True)
        provenance = gather_provenance(spec, fn)  # before the job exists: the code as it is now
        if spec.environment.snapshot_code:
            provenance["snapshot"] = snapshot_code(spec.run.run_dir, spec, fn)
        script = submission_script(spec, (provenance["snapshot"] or {}).get("sha256"))
        job_id, job = scheduler.submit(spec, script, func, args, kwargs)
        record_submission(spec.run.run_dir, provenance, job_id=job_id, script=script, logs_dir=logs_dir)
        record = JobRecord(
            job_id=job_id,
            cluster=scheduler.name,
            run_dir=str(spec.run.run_dir),
            logs_dir=str(logs_dir),
            job_name=spec.scheduler.job_name,
            ntasks=spec.world_size,
            launcher=spec.launch.launcher,
            submitted_at=time.time(),
        )
        claim_job(record)
        record.save()
    said = (takeover, resumes, stored, mixture_note, snapshot_note(provenance["snapshot"]), reason)
    return JobHandle(record), job, "\n".join(line for line in said if line)
