"""The scalars of a metrics.jsonl record, under TensorBoard tag names (no torch).

One mapping, used by the TensorBoard writer on rank 0 and by anything that compares
event files with metrics.jsonl. A key absent from a record (eval loss between
evaluations, ``comm`` without ``--comm-stats``) gives no scalar at that step.
"""

from __future__ import annotations

import math

# record key -> tag
TAGS = {
    "loss": "loss/train",
    "eval_loss": "loss/eval",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "tokens_seen": "throughput/tokens_seen",
    "step_time_s": "time/step_s",
    "cpu_time_s": "time/cpu_s",
    "data_wait_s": "time/data_wait_s",
    "peak_mem_bytes": "memory/peak_bytes",
}
COMM_TOTALS = {
    "intra_node_wire_bytes": "comm/intra_node_wire_bytes",
    "inter_node_wire_bytes": "comm/inter_node_wire_bytes",
}
SOURCE_PREFIXES = {
    "loss/": "loss/train_",
    "eval_loss/": "loss/eval_",
    "tokens/": "data/tokens_",
    "epoch/": "data/epoch_",
}
"""A data mixture's per-source keys (``loss/web``) -> their tags (``loss/train_web``)."""
STRAGGLERS = {
    "spread": "stragglers/slowest_over_median",
    "slowest_rank": "stragglers/slowest_rank",
    "median_s": "stragglers/median_own_time_s",
}


def _number(value) -> float | None:
    """A finite float of an int or float (None: anything else, and an integer past a float's
    range, ``10**400``, which ``float()`` refuses with OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def record_scalars(record: dict) -> dict[str, float]:
    """``{tag: value}`` of one record: the fields in :data:`TAGS`; with ``comm``, the intra-
    and inter-node wire bytes and ``comm/<axis>_wire_bytes`` per mesh axis; with
    ``stragglers``, the spread, the slowest rank and the median own time; a mixture's
    per-source keys (:data:`SOURCE_PREFIXES`)."""
    out: dict[str, float] = {}
    _copy_numbers(record, TAGS, out)
    for key, value in record.items():
        prefix, slash, name = key.partition("/")
        tag = SOURCE_PREFIXES.get(prefix + slash) if slash else None
        if tag is not None and name and _number(value) is not None:
            out[tag + name] = float(value)
    comm = record.get("comm")
    if isinstance(comm, dict):
        _copy_numbers(comm, COMM_TOTALS, out)
        for axis, section in comm.items():
            if isinstance(section, dict):
                wire = [s.get("wire_bytes") for s in section.values() if isinstance(s, dict)]
                known = [n for n in map(_number, wire) if n is not None]
                if known:
                    out[f"comm/{axis}_wire_bytes"] = sum(known)
    stragglers = record.get("stragglers")
    if isinstance(stragglers, dict):
        _copy_numbers(stragglers, STRAGGLERS, out)
    return out


def _copy_numbers(source: dict, tags: dict[str, str], out: dict[str, float]) -> None:
    """``out[tag] = source[key]`` for each ``key -> tag`` whose value is a number."""
    for key, tag in tags.items():
        value = _number(source.get(key))
        if value is not None:
            out[tag] = value
