"""``<run-dir>/staging.json``: where each node read the token data from with ``--stage-data``,
and how long its copy took (rank 0 writes it after the nodes have staged; a later attempt
writes its own over it).

``{"dir": "auto", "seconds": 1.42, "waited_s": 0.3, "copied_bytes": ..., "nodes": {"n1": {"root":
..., "seconds": 1.42, "waited_s": 0.3, "copy_s": 1.40, "verify_s": 0.0, "copied_bytes": ...,
"fallback": null, "files": [...]}, ...}}``: ``seconds`` from the start of staging until every
node's copies were ready (each node's: until its tasks' were), ``waited_s`` how long the ranks
waited for them after the model was built (the copy runs while it is), ``copy_s`` the node's copying and verifying, ``verify_s`` its
re-reading of earlier copies, ``fallback`` why the node reads the shared copy (too little
space), ``files`` each file's ``action``: copied, reused, replaced (a damaged or stale copy)
or shared.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from hpc_hsdp.files import UnreadableFile, read_json
from hpc_hsdp.plan.units import human_bytes, terminal_safe
from hpc_hsdp.rundir.files import atomic_write_text
from hpc_hsdp.rundir.status_section import RunView, StatusSection

STAGING_RECORD = "staging.json"
MAX_RECORD_BYTES = 4 << 20


def staging_record_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / STAGING_RECORD


def node_staging(per_rank: Sequence[tuple[str, dict]], value: str) -> dict:
    """The record from every rank's ``(node, StageResult.as_record())``: per node, the result of
    the task that copied or verified (the most ``copy_s + verify_s``), the node ready when its
    last task was."""
    nodes: dict[str, dict] = {}
    for node, result in per_rank:
        kept = nodes.get(node)
        if kept is None or result["copy_s"] + result["verify_s"] > kept["copy_s"] + kept["verify_s"]:
            nodes[node] = {
                **result,
                "seconds": max(result["seconds"], kept["seconds"] if kept else 0.0),
                "waited_s": max(result.get("waited_s", 0.0), kept.get("waited_s", 0.0) if kept else 0.0),
            }
        else:
            kept["seconds"] = max(kept["seconds"], result["seconds"])
            kept["waited_s"] = max(kept.get("waited_s", 0.0), result.get("waited_s", 0.0))
    return {
        "dir": value,
        "seconds": max((n["seconds"] for n in nodes.values()), default=0.0),
        "waited_s": max((n.get("waited_s", 0.0) for n in nodes.values()), default=0.0),
        "copied_bytes": sum(n["copied_bytes"] for n in nodes.values()),
        "nodes": nodes,
    }


def staging_lines(record: dict) -> list[str]:
    """Rank 0's line about the staging, then one warning per node on the shared copy."""
    nodes = record["nodes"]
    counts = {"copied": 0, "reused": 0, "replaced": 0, "shared": 0}
    for entry in nodes.values():
        for f in entry["files"]:
            counts[f["action"]] += 1
    slowest = max(nodes, key=lambda n: nodes[n]["seconds"]) if nodes else "-"
    actions = ", ".join(f"{what} {n}" for what, n in counts.items() if n)
    line = (
        f"--stage-data: token files on node-local disk of {len(nodes) - sum(bool(e['fallback']) for e in nodes.values())}"
        f"/{len(nodes)} node(s) in {record['seconds']:.2f} s (slowest {slowest}; the ranks waited "
        f"{record.get('waited_s', 0.0):.2f} s for it after the model was built); copied "
        f"{human_bytes(record['copied_bytes'])}; files: {actions or 'none'} ({STAGING_RECORD})"
    )
    unchecked = sorted({f["source"] for e in nodes.values() for f in e["files"] if f["checksum_from"] != "sidecar"})
    lines = [line]
    if unchecked:
        lines.append(
            f"--stage-data: {len(unchecked)} token file(s) have no sha256 in their sidecar (prepared before hpc-hsdp "
            f"recorded them, e.g. {unchecked[0]}): their copies are checked against the shared copy as read; "
            f"prepare the data again to check them against what prepare-data wrote"
        )
    lines += [f"warning: --stage-data: {node}: {e['fallback']}" for node, e in sorted(nodes.items()) if e["fallback"]]
    return lines


def write_staging_record(run_dir: str | Path, record: dict) -> None:
    atomic_write_text(staging_record_path(run_dir), json.dumps(record, indent=1) + "\n")


def read_staging(run_dir: str | Path) -> dict | None:
    """``staging.json``, or None when there is none or it is not one."""
    try:
        record = read_json(staging_record_path(run_dir), max_bytes=MAX_RECORD_BYTES)
    except (OSError, UnreadableFile):
        return None
    return record if isinstance(record, dict) else None


def staging_status_lines(run_dir: str | Path) -> list[str]:
    """What ``status`` says of ``--stage-data``: :func:`staging_lines` of the run's record; none when
    there is no record or it is not one (the run directory's files may be anyone's)."""
    record = read_staging(run_dir)
    if record is None:
        return []
    try:
        return staging_lines(record)
    except (KeyError, TypeError, ValueError, AttributeError):
        return []


STAGING_SECTION: StatusSection[RunView, list[str]] = StatusSection(
    name="staging",
    read=lambda view: staging_status_lines(view.run_dir),
    lines=lambda found: [terminal_safe(line) for line in found],
    fields=lambda found: {"staging": found},
)
