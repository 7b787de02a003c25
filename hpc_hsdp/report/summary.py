"""One line of words per run: the HTML report's table and the picture's heading (pure)."""

from __future__ import annotations

from hpc_hsdp.plan.units import si
from hpc_hsdp.report.data import RunData
from hpc_hsdp.rundir.lifecycle import attempts
from hpc_hsdp.rundir.lifecycle.provenance_record import code_words
from hpc_hsdp.rundir.observation.replica_membership import membership_changes


def summary_rows(run: RunData) -> dict[str, str]:
    last = run.last or {}
    total = run.total_steps
    digest = run.digest
    tps = digest.median_tokens_per_s() if digest is not None else None
    evals = digest.latest_eval if digest is not None else None
    best = digest.best_eval if digest is not None else None
    return {
        "run": run.label,
        "state": run.state,
        "step": f"{last.get('step', '-')}" + (f" / {total}" if total else ""),
        "loss": f"{last['loss']:.4f}" if isinstance(last.get("loss"), (int, float)) else "-",
        "eval loss": f"{evals[1]:.4f}" if evals else "-",
        "best eval": f"{best[1]:.4f} (step {best[0]})" if best else "-",
        "tokens/s (median)": si(tps) if tps is not None else "-",
        "world": f"{last.get('world_size', '-')} (shard {last.get('shard_size', '-')})" if last else "-",
        "restarts": ", ".join(
            f"step {r.get('resumed_from_step')}: {attempts.SHORT.get(r.get('reason'), r.get('reason'))}"
            for r in run.restarts
        )
        or "none",
        "replica groups": _replica_groups(run),
        "slowest": run.straggler_verdict() or "-",
        "code": code_words(run.provenance) or "-",
    }


def _replica_groups(run: RunData) -> str:
    """The live replica groups over the run (``2 -> 1 -> 2``) and its changes, or ``-``."""
    path = run.digest.replica_path if run.digest is not None else []
    if not path:
        return "-"
    changes = membership_changes(run.membership)
    text = " -> ".join(map(str, path))
    return text + (f" ({len(changes)} changes; last: {changes[-1]})" if changes else "")
