"""The fabric check's records in a run directory: ``check.json`` (the last check: every node's and
link's figures, what fell below its peers) and ``checks.jsonl`` (each verdict of ``submit --check``:
the nodes trained on, those left out, spares used, requeues). Read as files that may be hostile."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeGuard

from hpc_hsdp.files import UnreadableFile, read_json, read_json_lines
from hpc_hsdp.plan.fabric_check_rounds import Finding, Verdict, table
from hpc_hsdp.plan.units import terminal_safe
from hpc_hsdp.rundir.status_section import RunView, StatusSection

CHECK_RECORD = "check.json"
CHECK_HISTORY = "checks.jsonl"
MAX_RECORD_BYTES = 4 << 20


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "time": (int, float),
    "seconds": (int, float),
    "threshold": (int, float),
    "nodes": dict,
    "links": dict,
    "findings": list,
    "bad_nodes": list,
    "bad_links": list,
    "transport_warning": str,
    "job_id": str,
}
"""What each field of ``check.json`` is when the check wrote it (a field may be absent)."""


def _well_formed(record: object) -> TypeGuard[dict]:
    """``record`` holds the check's fields of the check's types (``"bad_nodes": 5`` was a traceback
    in the batch step of ``submit --check``), its node and link names text."""
    if not isinstance(record, dict):
        return False
    for key, kinds in _FIELD_TYPES.items():
        if key in record and (isinstance(record[key], bool) or not isinstance(record[key], kinds)):
            return False
    return all(isinstance(name, str) for key in ("bad_nodes", "bad_links") for name in record.get(key, ()))


def read_check(run_dir: str | Path) -> dict | None:
    """``check.json``, or None when there is none or it is not one (:func:`_well_formed`)."""
    try:
        record = read_json(Path(run_dir) / CHECK_RECORD, max_bytes=MAX_RECORD_BYTES)
    except (OSError, UnreadableFile):
        return None
    return record if _well_formed(record) else None


def read_own_check(run_dir: str | Path, job_id: str) -> tuple[dict | None, str | None]:
    """``check.json`` as the check of job ``job_id`` wrote it: (the record, None), or (None, why
    not) when there is none, it is not one, another job wrote it, or the file could have been
    written by someone else (another user's, or writable by others: the check writes it 0644,
    whatever the umask): a run directory others can write could otherwise hold a forged verdict."""
    path = Path(run_dir) / CHECK_RECORD
    record = read_check(run_dir)
    if record is None:
        return None, f"no readable {path}"
    try:
        info = os.lstat(path)
    except OSError as exc:
        return None, f"{path} cannot be read ({exc.strerror})"
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        return None, f"{path} is another user's or writable by others: not the check's"
    if record.get("job_id") != job_id:
        return None, f"{path} was not written by the check of job {job_id}"
    return record, None


def read_decisions(run_dir: str | Path) -> list[dict]:
    """The verdicts of ``checks.jsonl``, oldest first."""
    try:
        entries = read_json_lines(Path(run_dir) / CHECK_HISTORY, max_bytes=MAX_RECORD_BYTES)
    except (OSError, UnreadableFile):
        return []
    return [e for e in entries if isinstance(e, dict)]


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _names(value) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


CHECK_ROWS_SHOWN = 8
"""``status`` shows every node's row up to this many nodes, above it those below their peers."""


def check_lines(record: dict) -> list[str]:
    """``check.json`` as a table, its findings, its warning and its summary (``check``, ``report``)."""
    return [*check_table(record), check_summary(record)]


def check_table(record: dict, *, every_row: bool = True) -> list[str]:
    """``check.json`` as a table (every row, or the header and the rows below their peers), its
    findings and its warning."""
    findings = []
    for f in record.get("findings", []) if isinstance(record.get("findings"), list) else []:
        if isinstance(f, dict) and all(isinstance(f.get(k), (int, float)) for k in ("value", "median")):
            findings.append(
                Finding(str(f.get("kind")), str(f.get("name")), str(f.get("figure")), f["value"], f["median"])
            )
    found = Verdict(
        findings=tuple(findings),
        bad_nodes=tuple(_names(record.get("bad_nodes"))),
        bad_links=tuple(_names(record.get("bad_links"))),
    )
    nodes = {str(k): _dict(v) for k, v in _dict(record.get("nodes")).items()}
    links = {str(k): _dict(v) for k, v in _dict(record.get("links")).items()}
    lines = table(nodes, links, found)
    if not every_row:
        lines = [lines[0], *(line for line in lines[1:] if line.endswith("below its peers"))]
    lines += [f.line() for f in findings]
    if isinstance(record.get("transport_warning"), str):
        lines.append(f"warning: {record['transport_warning']}")
    return lines


def check_summary(record: dict, decision: dict | None = None) -> str:
    """One line: what the check found and, with a verdict of ``submit --check``, what the job did."""
    bad = _names(record.get("bad_nodes"))
    seconds = record.get("seconds")
    found = (
        f"{len(_dict(record.get('nodes')))} node(s), {len(_dict(record.get('links')))} link(s)"
        + (f" in {seconds:.1f} s" if isinstance(seconds, (int, float)) else "")
        + (f": below their peers: {', '.join(bad)}" if bad else ": no node below its peers")
        + f" (threshold {record.get('threshold', '?')} of the median)"
    )
    if decision is None:
        return found
    excluded = _names(decision.get("excluded"))
    spares = _names(decision.get("spares_used"))
    if decision.get("action") == "requeue":
        did = f"{', '.join(excluded)} left out: job requeued without {'them' if len(excluded) > 1 else 'it'}"
    elif excluded:
        did = f"{', '.join(excluded)} left out" + (f", spare {', '.join(spares)} in its place" if spares else "")
    else:
        did = "trained on " + ", ".join(_names(decision.get("nodes")))
    return f"{did}; {found}"


def _check_and_decision(view: RunView) -> tuple[dict, dict | None] | None:
    """The check's record and the batch shell's newest decision on it (None: no check ran)."""
    check = read_check(view.run_dir)
    if check is None:
        return None
    decisions = read_decisions(view.run_dir)
    return check, decisions[-1] if decisions else None


def _check_status_lines(found: tuple[dict, dict | None] | None) -> list[str]:
    if found is None:
        return []
    check, decision = found
    table_lines = check_table(check, every_row=len(check.get("nodes") or ()) <= CHECK_ROWS_SHOWN)
    return [terminal_safe(f"check: {check_summary(check, decision)}")] + [
        terminal_safe(f"  {line}") for line in table_lines
    ]


CHECK_SECTION: StatusSection[RunView, tuple[dict, dict | None] | None] = StatusSection(
    name="check", read=_check_and_decision, lines=_check_status_lines
)
