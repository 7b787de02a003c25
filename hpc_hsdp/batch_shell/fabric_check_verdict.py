"""What the batch shell does with the fabric check's result (``submit --check``), run there between
the check step and the training step::

    python -m hpc_hsdp.batch_shell.fabric_check_verdict RUN_DIR NODES

It reads ``check.json`` (written by the check's rank 0) and prints the nodes the training step runs
on (a node list for ``srun --nodelist``), exit code 0: every node when none is bad; the first NODES
good ones when spare nodes make up for the bad (the spares otherwise wait). With too few good nodes
it requeues the job once with the bad nodes excluded (SLURM's ``ExcNodeList``) and exits 3: the
script ends there. A job that was requeued for its check already trains on what it has, saying so.
Every decision is appended to ``checks.jsonl`` in the run directory. No torch.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hpc_hsdp.plan.slurm_env import compress_nodelist
from hpc_hsdp.plan.topology import expand_nodelist
from hpc_hsdp.rundir.files import append_jsonl
from hpc_hsdp.rundir.observation.fabric_check_record import CHECK_HISTORY, read_decisions, read_own_check
from hpc_hsdp.scheduler.backends import task_environment
from hpc_hsdp.scheduler.restart_policy import RestartPolicy

REQUEUED = 3


def decide(record: dict, *, allocated: Sequence[str], nodes: int, requeued_before: bool) -> dict:
    """The decision on ``record`` (check.json) for a job of ``nodes`` nodes on ``allocated``."""
    bad = [n for n in record.get("bad_nodes", []) if n in allocated]
    good = [n for n in allocated if n not in bad]
    if len(good) >= nodes:
        train = good[:nodes]
        spares = [n for n in train if n not in allocated[:nodes]]
        why = (
            f"left out {', '.join(bad)}: spare{'s' if len(spares) > 1 else ''} {', '.join(spares)} in "
            f"{'their' if len(bad) > 1 else 'its'} place"
            if bad
            else "every node as fast as its peers"
        )
        return {"action": "train", "nodes": train, "excluded": bad, "spares_used": spares, "why": why}
    if requeued_before:
        return {
            "action": "train",
            "nodes": allocated[:nodes],
            "excluded": [],
            "spares_used": [],
            "why": f"{', '.join(bad)} below its peers again after a requeue that excluded the last bad nodes: "
            f"training on what the job has",
        }
    return {
        "action": "requeue",
        "nodes": [],
        "excluded": bad,
        "spares_used": [],
        "why": f"{', '.join(bad)} below its peers and no spare node (--spare-nodes): requeued once without "
        f"{'them' if len(bad) > 1 else 'it'}",
    }


def _requeued_before(run_dir: Path, job_id: str) -> bool:
    return any(e.get("job_id") == job_id and e.get("action") == "requeue" for e in read_decisions(run_dir))


def _append(run_dir: Path, entry: dict) -> None:
    append_jsonl(run_dir / CHECK_HISTORY, entry)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    run_dir, nodes = Path(args[0]), int(args[1])
    allocated = expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", ""))
    environment = task_environment(os.environ)
    job_id = environment.job_id
    record, why_not = read_own_check(run_dir, job_id)
    if record is None:  # no verdict without this job's record: train on the job's nodes
        print(f"hpc-hsdp: check: {why_not}: training on the job's nodes", file=sys.stderr)
        print(compress_nodelist(allocated[:nodes]))
        return 0
    decision = decide(
        record,
        allocated=allocated,
        nodes=nodes,
        requeued_before=_requeued_before(run_dir, job_id),
    )
    entry = {"time": time.time(), "job_id": job_id, "restart": str(environment.restart_count)}
    entry |= decision
    print(f"hpc-hsdp: check: {decision['why']}", file=sys.stderr)
    if decision["action"] == "requeue":
        # the requeue ends this job (SIGTERM to every process of it, this one too): the decision is
        # written first, and this process outlives the signal long enough to hear what scontrol said
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _append(run_dir, entry | {"requeued": True})
        done, said = RestartPolicy(environment, run_dir=run_dir).requeue(
            exclude=decision["excluded"]
        )  # once: no failure
        if done:
            return REQUEUED
        _append(run_dir, entry | {"action": "train", "requeued": False, "scontrol": said, "nodes": allocated[:nodes]})
        print(f"hpc-hsdp: check: the requeue failed ({said}): training on the job's nodes", file=sys.stderr)
        decision["nodes"] = allocated[:nodes]
    else:
        _append(run_dir, entry)
    print(compress_nodelist(decision["nodes"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
