"""One line of words per run: the HTML report's table and the picture's heading (pure)."""

from __future__ import annotations

import statistics

from hpc_hsdp.plan.units import si
from hpc_hsdp.report.data import RunData
from hpc_hsdp.rundir import attempts
from hpc_hsdp.rundir.replicas import membership_changes


def summary_rows(run: RunData) -> dict[str, str]:
    last = run.last or {}
    total = run.total_steps
    tps = [r["tokens_per_s"] for r in run.records if isinstance(r.get("tokens_per_s"), (int, float))]
    evals = run.series("eval_loss")[1]
    return {
        "run": run.label,
        "state": run.state,
        "step": f"{last.get('step', '-')}" + (f" / {total}" if total else ""),
        "loss": f"{last['loss']:.4f}" if isinstance(last.get("loss"), (int, float)) else "-",
        "eval loss": f"{evals[-1]:.4f}" if evals else "-",
        "tokens/s (median)": si(statistics.median(tps)) if tps else "-",
        "world": f"{last.get('world_size', '-')} (shard {last.get('shard_size', '-')})" if last else "-",
        "restarts": ", ".join(
            f"step {r.get('resumed_from_step')}: {attempts.SHORT.get(r.get('reason'), r.get('reason'))}"
            for r in run.restarts
        )
        or "none",
        "replica groups": _replica_groups(run),
        "slowest": run.straggler_verdict() or "-",
    }


def _replica_groups(run: RunData) -> str:
    """The live replica groups over the run (``2 -> 1 -> 2``) and its changes, or ``-``."""
    counts = [r["replicas"] for r in run.records if isinstance(r.get("replicas"), int)]
    if not counts:
        return "-"
    path = [counts[0]] + [c for previous, c in zip(counts, counts[1:], strict=False) if c != previous]
    changes = membership_changes(run.membership)
    text = " -> ".join(map(str, path))
    return text + (f" ({len(changes)} changes; last: {changes[-1]})" if changes else "")
