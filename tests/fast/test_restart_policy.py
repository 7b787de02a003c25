"""The one restart policy (scheduler/restart_policy.py) and the job environment each backend gives its
task (scheduler/backends/job_environment.py, slurm_task.py): the --max-restarts budget counted from
restarts.jsonl, its words, and which job may requeue itself. The callers' paths: test_watchdog,
test_node_failure, test_preemption, test_fabric (fast); their processes and cluster tests."""

from __future__ import annotations

import pytest

from hpc_hsdp.rundir.checkpointing.state import record_restart
from hpc_hsdp.rundir.lifecycle.attempts import begin_attempt
from hpc_hsdp.scheduler.backends import task_environment
from hpc_hsdp.scheduler.backends.slurm_task import SlurmJobEnvironment
from hpc_hsdp.scheduler.restart_policy import RestartPolicy

SLURM_JOB = {"SLURM_JOB_ID": "41", "SLURM_CLUSTER_NAME": "dev"}


@pytest.mark.parametrize(
    ("env", "kind", "requeues", "restarts"),
    [
        ({**SLURM_JOB, "SLURM_RESTART_COUNT": "2"}, SlurmJobEnvironment, True, 2),
        ({"SLURM_JOB_ID": "41"}, SlurmJobEnvironment, False, 0),  # SLURM-like variables of a test: no cluster name
        ({}, SlurmJobEnvironment, False, 0),  # outside any job
        ({**SLURM_JOB, "SLURM_RESTART_COUNT": "x"}, SlurmJobEnvironment, True, 0),
        ({**SLURM_JOB, "HPC_HSDP_EMULATOR": "1", "SLURM_CLUSTER_NAME": "local-emulator"}, None, False, 0),
    ],
)
def test_each_backend_tells_its_task_its_job(env, kind, requeues, restarts):
    environment = task_environment(env)
    assert (type(environment) is kind) if kind else not isinstance(environment, SlurmJobEnvironment)
    assert environment.job_id == env.get("SLURM_JOB_ID", "")
    assert environment.requeues is requeues and environment.restart_count == restarts


def test_the_emulators_job_requeues_nothing_and_keeps_no_node_range():
    environment = task_environment(
        {"SLURM_JOB_ID": "7", "HPC_HSDP_EMULATOR": "1", "HPC_HSDP_REQUEUE_REQUEST": "NumNodes=1-2"}
    )
    assert environment.requeue(exclude=("n2",)) == (
        False,
        "the local emulator requeues nothing: resubmit with the same --run-dir to resume",
    )
    assert not environment.keeps_node_range() and environment.restore_node_range() == (False, "")
    assert environment.requeues_on_node_failure() == (False, 0.0)


def _failed_attempts(run_dir, job_id: str, reasons: list[str]) -> None:
    for restart, reason in enumerate(reasons):
        begin_attempt(run_dir, restart=restart, job_id=job_id, start_step=0, total_steps=10)
        record_restart(run_dir, reason=reason, cause=f"cause {restart}")
    begin_attempt(run_dir, restart=len(reasons), job_id=job_id, start_step=0, total_steps=10)


@pytest.mark.parametrize(
    ("reasons", "max_restarts", "spent", "exceeded"),
    [
        ([], 2, False, False),
        (["hang"], 2, False, False),
        (["hang", "node_failure"], 2, True, False),
        (["hang", "node_failure", "hang"], 2, True, True),
        (
            ["warning_signal", "sigterm", "warning_signal"],
            1,
            False,
            False,
        ),  # the warning signal's requeues are no failures
    ],
)
def test_the_budget_counts_failure_restarts_of_this_job(tmp_path, reasons, max_restarts, spent, exceeded):
    _failed_attempts(tmp_path, "41", reasons)
    policy = RestartPolicy(task_environment(SLURM_JOB), run_dir=tmp_path, max_restarts=max_restarts)
    failures = sum(r in ("hang", "node_failure") for r in reasons)
    assert policy.failures() == failures
    assert policy.next_restart() == f"failure restart {failures + 1} of at most {max_restarts}"
    assert (policy.spent() is not None) is spent
    if spent:
        assert policy.spent() == (
            f"not requeued: the job already restarted {failures} times after failures (--max-restarts {max_restarts})"
        )
    found = policy.exceeded()
    assert (found is not None) is exceeded
    if exceeded:
        assert found.startswith(f"job 41 restarted {failures} times after failures, more than --max-restarts 2")
        assert "restart 1: cause 0" in found  # the restart that cause led to
    other_job = RestartPolicy(task_environment({**SLURM_JOB, "SLURM_JOB_ID": "42"}), run_dir=tmp_path, max_restarts=0)
    assert other_job.failures() == 0 and other_job.exceeded() is None


def test_without_a_run_directory_every_restart_counts_and_nothing_is_recorded():
    policy = RestartPolicy(task_environment({**SLURM_JOB, "SLURM_RESTART_COUNT": "3"}), max_restarts=3)
    assert policy.failures() == 3 and policy.spent() is not None and policy.exceeded() is None
    policy.record(reason="hang", cause="no run directory")  # nowhere to write: nothing happens


def test_only_the_backends_requeue_and_only_the_policy_counts_the_budget():
    """The watchdog, a lost node, preemption and the check's verdict requeued each through its own
    call of the SLURM requeue, each with its own budget: now through the policy and the job environment."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "hpc_hsdp"
    calls = ("requeue_job(", "restore_request(", "failure_restarts(", '"SLURM_RESTART_COUNT"')
    found = [
        f"{path.relative_to(package)}: {call}"
        for path in sorted(package.rglob("*.py"))
        if "backends" not in path.relative_to(package).parts and path.name not in ("restart_policy.py", "state.py")
        for call in calls
        if call in path.read_text()
    ]
    # what remains reads the variable as a name of this attempt, not as a count: a staging lock's
    # owner (data/, below the backends) and the provenance record's copy
    assert found == [
        'data/staging_copies.py: "SLURM_RESTART_COUNT"',
        'task/parallelism/dist.py: "SLURM_RESTART_COUNT"',
    ], found
