"""SLURM from inside a running job: ``scontrol requeue`` (held, updated and released where the
job must avoid nodes or keep its node range), and the node range put back after SLURM's own requeue.

Run on the task and in the batch shell, never on the submitting side: it imports only the
package's errors, its atomic write and the one bounded runner,
:func:`hpc_hsdp.scheduler.backends.slurm_command.run_slurm`, so that the runtime asks for a requeue
without loading the submission's code.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from hpc_hsdp.errors import SchedulerError
from hpc_hsdp.files import write_atomically
from hpc_hsdp.scheduler.backends.job_environment import JobEnvironment
from hpc_hsdp.scheduler.backends.slurm_command import run_slurm

REQUEUE_FILE_VARIABLE = "HPC_HSDP_REQUEUE_FILE"
"""Set by the rendered script of a container job: where no ``scontrol`` exists (inside the
image), rank 0 writes this file and the batch shell (on the host) requeues the job when the
step has ended."""

REQUEST_FIELDS_VARIABLE = "HPC_HSDP_REQUEUE_REQUEST"
"""Set by the rendered script of a flexible allocation (``--nodes MIN-MAX``) to the job's request
as ``scontrol update`` fields (``NumNodes=1-2 NumTasks=2``): SLURM fixes a requeued job's request
to the nodes it last had, so a job that ran on 2 nodes would wait for 2 again; the requeue
restores the range."""


def requeue_job(job_id: str, *, timeout_s: float = 30.0, exclude: tuple[str, ...] = (), env=None) -> tuple[bool, str]:
    """``scontrol requeue <job_id>``, from inside the job: rank 0 calls it after every rank
    saved on the warning signal (:mod:`hpc_hsdp.task.resilience.preemption`) or after a hang. SLURM then ends this
    run (SIGTERM, SIGKILL after KillWait) and starts the job again with the same id and
    ``SLURM_RESTART_COUNT`` + 1. With ``exclude`` (nodes found dead), the job is requeued held,
    told to avoid those nodes, then released, so that it does not land on them again before
    SLURM marks them down. Without ``scontrol`` here (a container) and with
    ``HPC_HSDP_REQUEUE_FILE`` set, the request goes to the batch shell through that file.
    Never raises: returns (requeued, what scontrol said)."""
    env = os.environ if env is None else env
    request = env.get(REQUEUE_FILE_VARIABLE, "").strip()
    if request and shutil.which("scontrol", path=env.get("PATH")) is None:
        try:
            write_atomically(request, f"{job_id}\n")
        except OSError as exc:
            return False, f"no scontrol here and the requeue request {request} cannot be written ({exc})"
        return True, f"no scontrol here: asked the batch shell to requeue job {job_id} when the step ends ({request})"
    updates = tuple(env.get(REQUEST_FIELDS_VARIABLE, "").split())
    if exclude:
        updates += (f"ExcNodeList={','.join(exclude)}",)
    if updates:
        return _requeue_updated(job_id, updates, timeout_s=timeout_s)
    try:  # SLURM's SIGTERM to every process of the job can reach scontrol before it has read the answer: ignored
        done = run_slurm(["sh", "-c", "trap '' TERM; exec scontrol requeue \"$1\"", "sh", job_id], timeout_s=timeout_s)
    except SchedulerError as exc:
        return False, f"scontrol requeue could not run ({exc})"
    said = " ".join((done.stdout + done.stderr).split())
    return done.returncode == 0, said or f"exit code {done.returncode}"


_REQUEUE_UPDATED = """trap '' TERM
job=$1; shift
scontrol requeuehold "$job" || { echo "requeuehold: failed"; exit 1; }
scontrol update JobId="$job" "$@" || echo "update: failed"
scontrol release "$job" || { echo "release: failed"; exit 1; }
"""
"""Run by one shell that ignores SIGTERM (and hands that to the scontrols it starts): once the job
is requeued, SLURM ends this very task (SIGTERM, then SIGKILL after KillWait), and a release
started from the task would be killed with it, leaving the job held forever."""


def _requeue_updated(job_id: str, updates: tuple[str, ...], *, timeout_s: float) -> tuple[bool, str]:
    """Requeue held, ``scontrol update`` the pending job (``ExcNodeList=``, ``NumNodes=``), release."""
    try:
        done = run_slurm(["sh", "-c", _REQUEUE_UPDATED, "sh", job_id, *updates], timeout_s=timeout_s)
    except SchedulerError as exc:
        return False, f"scontrol requeuehold/release could not run ({exc}); check with scontrol show job {job_id}"
    said = " ".join((done.stdout + done.stderr).split())
    if "requeuehold: failed" in said:
        return False, said
    if "release: failed" in said or done.returncode != 0:
        return (
            False,
            f"requeued but still held: {said or f'exit code {done.returncode}'}; release it with scontrol release {job_id}",
        )
    if "update: failed" in said:
        return True, f"(could not update the pending job with {' '.join(updates)}: {said})"
    return True, ""


_RESTORE_REQUEST = """trap '' TERM
job=$1; restarts=$2; shift 2
shown=$(scontrol -o show job "$job") || { echo "show job: failed"; exit 1; }
case " $shown " in *" Restarts=$restarts "*) echo "not requeued: Restarts=$restarts"; exit 3;; esac
scontrol update JobId="$job" "$@"
"""
"""SLURM sends SIGTERM when it requeues the job itself, and the task has KillWait left: the shell
ignores it (and hands that to scontrol). A job whose ``Restarts`` is still this run's was not
requeued (cancelled, timed out) and is left alone."""


def restore_request(job_id: str, *, env=None, timeout_s: float = 10.0) -> tuple[bool, str]:
    """After SLURM itself requeued the job (a node died: ``NODE_FAIL``; or preempted it), put the
    flexible allocation's range back (``HPC_HSDP_REQUEUE_REQUEST``): SLURM pinned the pending job
    to the node count it last had, so a job that ran on 2 of ``--nodes 1-2`` would wait for 2.
    Called on SIGTERM, while SLURM still ends this run (the job is then PENDING and COMPLETING; an
    ``scontrol update`` of it is accepted, unlike a second requeue). Never raises:
    (restored, what scontrol said); (False, "") where there is no range to restore."""
    env = os.environ if env is None else env
    updates = tuple(env.get(REQUEST_FIELDS_VARIABLE, "").split())
    if not updates or shutil.which("scontrol", path=env.get("PATH")) is None:
        return False, ""
    restarts = (env.get("SLURM_RESTART_COUNT") or "0").strip()
    try:
        done = run_slurm(["sh", "-c", _RESTORE_REQUEST, "sh", job_id, restarts, *updates], timeout_s=timeout_s)
    except SchedulerError as exc:
        return False, f"scontrol update could not run ({exc})"
    said = " ".join((done.stdout + done.stderr).split())
    return done.returncode == 0, said or ("" if done.returncode == 0 else f"exit code {done.returncode}")


def _scontrol_fields(*args: str, timeout_s: float = 10.0) -> dict[str, str]:
    """``KEY=VALUE`` words (``scontrol -o show job``) or ``KEY = VALUE`` lines (``show config``)."""
    try:
        shown = run_slurm(["scontrol", *args], timeout_s=timeout_s)
    except SchedulerError:
        return {}
    if shown.returncode != 0:
        return {}
    fields: dict[str, str] = {}
    for line in shown.stdout.splitlines():
        if " = " in line:
            key, _, value = line.partition(" = ")
            fields[key.strip()] = value.strip()
        else:
            for item in line.split():
                key, equals, value = item.partition("=")
                if equals:
                    fields[key] = value
    return fields


def slurm_requeues_on_node_failure(job_id: str) -> tuple[bool, float]:
    """(whether SLURM itself requeues this job when one of its nodes is marked DOWN: the job is
    requeueable, ``Requeue=1``; SLURM's ``SlurmdTimeout``: how long after a node's last answer
    it is marked DOWN)."""
    requeue = _scontrol_fields("-o", "show", "job", job_id).get("Requeue") == "1"
    timeout = _scontrol_fields("show", "config").get("SlurmdTimeout", "300 sec").split()[0]
    return requeue, float(timeout) if timeout.isdigit() else 300.0


class SlurmJobEnvironment(JobEnvironment):
    """A SLURM job as its task and its batch shell see it: ``scontrol`` for the rest."""

    @property
    def requeues(self) -> bool:
        """In a real SLURM job (tests give SLURM-like variables but no ``SLURM_CLUSTER_NAME``)."""
        return bool(self.job_id) and bool(self.env.get("SLURM_CLUSTER_NAME"))

    def requeue(self, *, exclude: Sequence[str] = ()) -> tuple[bool, str]:
        """:func:`requeue_job` (the process's own environment: its ``PATH``, the container's request file)."""
        return requeue_job(self.job_id, exclude=tuple(exclude))

    def requeue_words(self) -> str:
        request = self.env.get(REQUEST_FIELDS_VARIABLE, "").strip()  # a flexible job's range, put back with the requeue
        return f"scontrol requeuehold, update {request}, release" if request else "scontrol requeue"

    def keeps_node_range(self) -> bool:
        return bool(self.env.get(REQUEST_FIELDS_VARIABLE, "").strip()) and self.requeues

    def restore_node_range(self) -> tuple[bool, str]:
        return restore_request(self.job_id, env=self.env)

    def requeues_on_node_failure(self) -> tuple[bool, float]:
        """(SLURM requeues the job itself when a node of it is marked DOWN: it is requeueable,
        ``Requeue=1``; SLURM's ``SlurmdTimeout``: how long after a node's last answer it is)."""
        return slurm_requeues_on_node_failure(self.job_id)
