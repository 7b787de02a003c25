"""Small file helpers of the run directory (rank 0 writes; no torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_hsdp.files import write_atomically


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` durably to ``path`` (creating its directory): a reader sees the old
    file or the whole new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text, durable=True)


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line torn by a crash ends the valid part
    return records
