"""When a node of the job dies: find out fast, and requeue the job away from it.

A crashed node takes its ranks with it; the survivors' next collective fails (gloo: the
connections close) or hangs (NCCL, or a machine that lost power: the watchdog fires). Either
way the survivors cannot tell a dead peer from one that raised, unless they ask the node:
:func:`unreachable_nodes` tries a TCP connection to each node's slurmd (address and port
from ``scontrol show node``), which a dead machine refuses or never answers within a few
seconds, long before SLURM itself marks the node DOWN (``SlurmdTimeout``, minutes).

:func:`handle_lost_peers` is called on the ranks that are left (``run_task`` when the
payload raised, the watchdog when ranks did not answer): the lowest rank on a live node
records the cause in ``restarts.jsonl`` and requeues the job with the dead nodes excluded,
within ``--max-restarts``; it resumes from the newest complete checkpoint.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

PROBE_TIMEOUT_S = 3.0


def _note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def slurmd_address(node: str, *, timeout_s: float = 10.0) -> tuple[str, int] | None:
    """(NodeAddr, Port) of a node's slurmd from ``scontrol -o show node``; None when unknown."""
    try:
        shown = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    fields = dict(item.split("=", 1) for item in shown.stdout.split() if "=" in item)
    addr, port = fields.get("NodeAddr"), fields.get("Port", "6818")
    if shown.returncode != 0 or not addr or not port.isdigit():
        return None
    return addr, int(port)


def unreachable_nodes(nodes: Sequence[str], *, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """The nodes whose slurmd refuses or does not answer a TCP connection within ``timeout_s``."""
    dead = []
    for node in nodes:
        address = slurmd_address(node)
        if address is None:
            continue  # unknown to scontrol here: say nothing rather than guess
        try:
            with socket.create_connection(address, timeout=timeout_s):
                pass
        except OSError:
            dead.append(node)
    return dead


def handle_lost_peers(ctx, *, max_restarts: int, env: Mapping[str, str], reason: str) -> str | None:
    """On a rank that is left after peers were lost: when some of the job's nodes are dead,
    the lowest rank on a live node requeues the job without them (within ``max_restarts``)
    and records why; returns the line it printed (None: no dead node, or not this rank's job)."""
    from hpc_hsdp.requeue import requeue_job
    from hpc_hsdp.run_state import failure_restarts, record_restart
    from hpc_hsdp.runtime.preemption import in_slurm, restart_count

    if not in_slurm(env) or ctx.world_size < 2:
        return None
    plan = ctx.plan
    others = [name for name in dict.fromkeys(plan.node_names) if name != ctx.layout.node]
    dead = unreachable_nodes(others)
    if not dead:
        return None
    live_ranks = [r for r in range(plan.world_size) if plan.node_names[plan.node_of_rank[r]] not in dead]
    if ctx.rank != min(live_ranks):
        return None
    lost = [r for r in range(plan.world_size) if r not in live_ranks]
    job_id = env.get("SLURM_JOB_ID", "")
    cause = f"node {','.join(dead)} died (slurmd unreachable) with ranks {lost[0]}-{lost[-1]}; {reason}"
    failures = failure_restarts(ctx.run_dir, job_id=job_id) if ctx.run_dir is not None else restart_count(env)
    if failures >= max_restarts:
        line = f"{cause}; not requeued: the job already restarted {failures} times after failures (--max-restarts {max_restarts})"
    else:
        ok, said = requeue_job(job_id, exclude=tuple(dead))
        if ctx.run_dir is not None:
            record_restart(ctx.run_dir, reason="node_failure", cause=cause)
        line = (f"{cause}; requeued job {job_id} without {','.join(dead)} (failure restart {failures + 1} of at most "
                f"{max_restarts}) {said}".rstrip() if ok else f"{cause}; scontrol requeue {job_id} failed: {said}")  # fmt: skip
    _note(f"[hpc-hsdp] {line}")
    return line
