"""``<run-dir>/provenance.json`` and ``task_provenance.json``: what produced a run.

``provenance.json`` is written at submit, on the submitting machine, without torch: the git
commit and the uncommitted changes of each checkout whose code the job runs (hpc-hsdp's own, the
model's or entry's module), the installed packages and their versions, Python, whether the code
was snapshotted (``--snapshot-code``: ``code/``) and the rendered script the job was sent
(``logs/<job id>_submission.sh``). ``task_provenance.json`` is written by rank 0 when each
attempt starts: what only the task knows (torch, CUDA, NCCL, where the code was imported from).

The readers answer ``status``, ``report`` and ``runs``; a missing or damaged file is no answer
(None), never an error. Both are read as regular files only (:func:`hpc_hsdp.files.read_json`).
"""

from __future__ import annotations

import json
from pathlib import Path

from hpc_hsdp.files import is_time, read_json
from hpc_hsdp.rundir.files import atomic_write_text
from hpc_hsdp.rundir.status_section import RunView, StatusSection

PROVENANCE = "provenance.json"
TASK_PROVENANCE = "task_provenance.json"
SNAPSHOT_DIR = "code"
"""``--snapshot-code``: the copy of the code the job runs, under the run directory."""
MAX_DIFF_BYTES = 1 << 20
"""The uncommitted changes kept per checkout; a larger diff is cut there (``diff_truncated``)."""
MAX_PROVENANCE_BYTES = 16 << 20
"""A record is the diffs (capped) plus a few hundred package names."""
MAX_TASK_PROVENANCE_BYTES = 1 << 20
SHORT_COMMIT = 10


def provenance_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / PROVENANCE


def task_provenance_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / TASK_PROVENANCE


def snapshot_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / SNAPSHOT_DIR


def write_provenance(run_dir: str | Path, record: dict) -> Path:
    path = provenance_path(run_dir)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def write_task_provenance(run_dir: str | Path, record: dict) -> Path:
    """Rank 0, when an attempt starts (each requeue writes its own)."""
    path = task_provenance_path(run_dir)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def _read(path: Path, max_bytes: int) -> dict | None:
    try:
        data = read_json(path, max_bytes=max_bytes)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _checkout(entry: object) -> dict | None:
    """One entry of ``code`` as the submission writes it, its fields of the right types; None otherwise."""
    if not isinstance(entry, dict) or _text(entry.get("name")) is None:
        return None
    kept = {"name": entry["name"]}
    for key in ("path", "checkout", "commit", "diff", "diff_sha256", "error"):
        if _text(entry.get(key)) is not None:
            kept[key] = entry[key]
    for key in ("dirty", "diff_truncated"):
        kept[key] = entry.get(key) is True
    untracked = entry.get("untracked")
    kept["untracked"] = [u for u in untracked if isinstance(u, str)] if isinstance(untracked, list) else []
    return kept


def read_provenance(run_dir: str | Path) -> dict | None:
    """The submission's record, its ``code`` entries and ``packages`` checked (others dropped);
    None when there is none or it cannot be read."""
    data = _read(provenance_path(run_dir), MAX_PROVENANCE_BYTES)
    if data is None:
        return None
    code = data.get("code")
    data["code"] = [c for c in map(_checkout, code if isinstance(code, list) else []) if c is not None]
    earlier = data.get("earlier")
    data["earlier"] = (
        [
            {
                "job_id": _text(e.get("job_id")),
                "submitted_at": e.get("submitted_at") if is_time(e.get("submitted_at")) else None,
                "commit": _text(e.get("commit")),
            }
            for e in earlier
            if isinstance(e, dict)
        ]
        if isinstance(earlier, list)
        else []
    )
    packages = data.get("packages")
    data["packages"] = (
        {k: v for k, v in packages.items() if isinstance(k, str) and isinstance(v, str)}
        if isinstance(packages, dict)
        else {}
    )
    return data


def read_task_provenance(run_dir: str | Path) -> dict | None:
    return _read(task_provenance_path(run_dir), MAX_TASK_PROVENANCE_BYTES)


def _checkouts(record: dict) -> list[tuple[str, dict, list[str]]]:
    """(checkout, its first entry, the names of the code in it) in the record's order; the
    user's code is listed before hpc-hsdp's own (what a person changes most)."""
    groups: dict[str, tuple[dict, list[str]]] = {}
    for entry in record.get("code", []):
        if entry.get("commit") is None:
            continue
        key = entry.get("checkout") or entry["name"]
        groups.setdefault(key, (entry, []))[1].append(entry["name"])
    ordered = sorted(groups.items(), key=lambda item: "hpc_hsdp" in item[1][1])
    return [(key, entry, names) for key, (entry, names) in ordered]


def commit_id(record: dict | None) -> str | None:
    """A short name of the code a run ran, equal for two runs exactly when their commits and
    uncommitted changes are: ``a1b2c3d4e5`` per checkout, ``+`` and 4 hex digits of the diff
    when it has uncommitted changes, checkouts joined by ``,``; None without a checkout."""
    if record is None:
        return None
    parts = []
    for _, entry, _names in _checkouts(record):
        text = entry["commit"][:SHORT_COMMIT]
        if entry.get("dirty"):
            text += "+" + (entry.get("diff_sha256") or "????")[:4]
        parts.append(text)
    return ",".join(parts) or None


def code_words(record: dict | None) -> str | None:
    """What ``status`` and ``report`` say of the code: ``a1b2c3d4e5 + uncommitted changes
    (/src/proj: mymodel; /src/hpc-hsdp: hpc_hsdp), snapshot in code/``; None without a record."""
    if record is None:
        return None
    parts = []
    for checkout, entry, names in _checkouts(record):
        text = entry["commit"][:SHORT_COMMIT]
        if entry.get("dirty"):
            text += " + uncommitted changes"
            if entry.get("diff_truncated"):
                text += " (diff cut at 1 MiB)"
        parts.append(f"{text} ({checkout}: {', '.join(names)})")
    untracked = [e["name"] for e in record.get("code", []) if e.get("commit") is None]
    if untracked:
        parts.append(f"not in a git checkout: {', '.join(untracked)}")
    words = "; ".join(parts) or "no code recorded"
    snapshot = record.get("snapshot")
    if isinstance(snapshot, dict):
        words += f"; runs the snapshot in {SNAPSHOT_DIR}/ taken at submit"
    current = commit_id(record)
    other = [e for e in record.get("earlier", []) if isinstance(e, dict) and e.get("commit") != current]
    if other:  # a resumed run whose earlier steps came from other code
        jobs = ", ".join(f"job {e.get('job_id') or '?'}: {e.get('commit') or 'no checkout'}" for e in other[-3:])
        words += f"; earlier submissions of this run ran other code ({jobs})"
    return words


def task_words(record: dict | None) -> str | None:
    """``torch 2.5.1, CUDA 12.4, NCCL 2.21.5, Python 3.11.7`` of the latest attempt; None without it."""
    if record is None:
        return None
    parts = []
    for key, label in (("torch", "torch"), ("cuda", "CUDA"), ("nccl", "NCCL"), ("python", "Python")):
        value = record.get(key)
        if isinstance(value, str) and value:
            parts.append(f"{label} {value}")
    return ", ".join(parts) or None


def differences(records: list[dict | None]) -> list[str]:
    """Where the runs of a listing differ, in words: the code (how many versions), Python, and
    each package whose version is not the same in all of them (runs without a record aside)."""
    known = [r for r in records if r is not None]
    if len(known) < 2:
        return []
    found = []
    commits = {commit_id(r) for r in known}
    if len(commits) > 1:
        found.append(f"code ({len(commits)} versions: {', '.join(sorted(c or 'none' for c in commits))})")
    pythons = {str((r.get("python") or {}).get("version")) if isinstance(r.get("python"), dict) else "?" for r in known}
    if len(pythons) > 1:
        found.append(f"Python ({', '.join(sorted(pythons))})")
    names = sorted(set().union(*(r["packages"] for r in known)))
    for name in names:
        versions = {r["packages"].get(name, "none") for r in known}
        if len(versions) > 1:
            found.append(f"{name} ({', '.join(sorted(versions))})")
    return found


CODE_SECTION: StatusSection[RunView, dict | None] = StatusSection(
    name="code",
    read=lambda view: read_provenance(view.run_dir),
    lines=lambda record: [f"code: {code_words(record)}"] if code_words(record) else [],
    fields=lambda record: {"code": code_words(record), "commit": commit_id(record)},
)
VERSIONS_SECTION: StatusSection[RunView, dict | None] = StatusSection(
    name="versions",
    read=lambda view: read_task_provenance(view.run_dir),
    lines=lambda record: [f"ran with: {task_words(record)}"] if task_words(record) else [],
    fields=lambda record: {"versions": record},
)
