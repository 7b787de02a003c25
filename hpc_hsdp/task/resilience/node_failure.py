"""When a node of the job dies: find out fast, and requeue the job away from it.

A crashed node takes its ranks with it; the survivors' next collective fails (gloo: the
connections close) or hangs (NCCL, or a machine that lost power: the watchdog fires). Either
way the survivors cannot tell a dead peer from one that raised, unless they ask the node:
:func:`unreachable_nodes` tries a TCP connection to each node's slurmd (address and port
from ``scontrol show node``), which a dead machine refuses or never answers within a few
seconds, long before SLURM itself marks the node DOWN (``SlurmdTimeout``, minutes).

:func:`handle_lost_peers` is called on the ranks that are left (``run_task`` when the
payload raised, the watchdog when ranks did not answer): the lowest rank on a live node
records the cause in ``restarts.jsonl``; within ``--max-restarts`` the job is requeued away
from the dead node (by SLURM itself when it marks the node DOWN, the survivors waiting for
it; by the survivors when SLURM does not) and resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from hpc_hsdp.scheduler.backends import task_environment
from hpc_hsdp.scheduler.backends.slurm_command import (  # noqa: F401 - re-exported: the node probe lives beside run_slurm
    PROBE_TIMEOUT_S,
    run_slurm,
    slurmd_address,
    unreachable_nodes,
)
from hpc_hsdp.scheduler.restart_policy import RestartPolicy
from hpc_hsdp.task.observation.log import note

WAIT_GRACE_S = 60.0
"""How long past ``SlurmdTimeout`` the survivors wait for SLURM's own requeue before requeueing the job themselves."""


def handle_lost_peers(
    ctx, *, max_restarts: int, env: Mapping[str, str], reason: str, grace_s: float = WAIT_GRACE_S
) -> str | None:
    """On a rank that is left after peers were lost, when some of the job's nodes are dead.

    Within ``max_restarts``, the lowest rank on a live node records why (``restarts.jsonl``).
    A requeueable job is then left to SLURM: when it marks the dead node DOWN (``SlurmdTimeout``
    after its last answer) it requeues the job itself, away from that node; meanwhile every live
    rank stops training and waits, so that the job is still running then (a job that ended by
    itself is not requeued). SLURM pins the requeued job to the node count it had: for a flexible
    allocation (``--nodes MIN-MAX``) the range is put back on its SIGTERM, on every live node
    (:class:`hpc_hsdp.task.resilience.preemption.NodeRangeKeeper`, even while the ranks are stuck in a
    collective), so that it resumes on the nodes that are free, fewer if need be. Only when
    SLURM has not ended it ``SlurmdTimeout`` + ``grace_s`` later, or the job is not requeueable,
    the lowest live rank requeues it without the dead nodes (requeuehold, ExcNodeList, release).
    (Requeueing it ourselves at once would gain nothing: SLURM keeps the job COMPLETING until
    the dead node is DOWN; and Slurm 22.05 then loses the job's GPU bookkeeping: its next steps
    fail with "Invalid generic resource".)

    Returns the line printed on the lowest live rank (None: no dead node, or another rank)."""
    environment = task_environment(env)
    if not environment.requeues or ctx.world_size < 2:
        return None
    plan = ctx.plan
    others = [name for name in dict.fromkeys(plan.node_names) if name != ctx.layout.node]
    dead = unreachable_nodes(others)
    if not dead:
        return None
    live_ranks = [r for r in range(plan.world_size) if plan.node_names[plan.node_of_rank[r]] not in dead]
    lowest = ctx.rank == min(live_ranks)
    lost = [r for r in range(plan.world_size) if r not in live_ranks]
    job_id = environment.job_id
    cause = f"node {','.join(dead)} died (slurmd unreachable) with ranks {lost[0]}-{lost[-1]}; {reason}"
    policy = RestartPolicy(environment, run_dir=ctx.run_dir, max_restarts=max_restarts)
    if (spent := policy.spent()) is not None:
        line = f"{cause}; {spent}"
        if lowest:
            note(line)
        return line if lowest else None
    budget = policy.next_restart()
    slurm_requeues, slurmd_timeout = environment.requeues_on_node_failure()
    if slurm_requeues:
        if lowest:
            policy.record(reason="node_failure", cause=cause)
            note(
                f"{cause}; SLURM requeues job {job_id} when it marks {','.join(dead)} DOWN (SlurmdTimeout "
                f"{slurmd_timeout:.0f} s; {budget}): every rank stops and waits for it"
            )
        if _wait_for_slurm(ctx, slurmd_timeout + grace_s):
            return (f"{cause}; SLURM is requeueing job {job_id} ({budget})") if lowest else None
        if lowest:
            note(f"SLURM did not requeue job {job_id} within {slurmd_timeout + grace_s:.0f} s: requeueing it")
    if not lowest:
        return None
    ok, said = policy.requeue(exclude=dead)
    policy.record(reason="node_failure", cause=cause)
    line = (
        f"{cause}; requeued job {job_id} without {','.join(dead)} ({budget}) {said}".rstrip()
        if ok
        else f"{cause}; {policy.refused(said)}"
    )
    note(line)
    return line


def _wait_for_slurm(ctx, limit_s: float) -> bool:
    """Sleep until SLURM ends this task (SIGTERM, recorded by the task's preemption handler:
    True) or ``limit_s`` passed (False)."""
    preemption = ctx.preemption
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if preemption is not None and "TERM" in preemption.received:
            return True
        time.sleep(0.2)
    return False
