"""Small file helpers of the run directory (rank 0 writes; no torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpc_hsdp.files import UnreadableFile, append_text, open_regular, parse_json, write_atomically


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` durably to ``path`` (creating its directory): a reader sees the old
    file or the whole new one; a symlink or FIFO at ``path`` is refused (:func:`hpc_hsdp.files.write_atomically`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text, durable=True)


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """Append ``record`` as one line (:func:`hpc_hsdp.files.append_text`: a symlink, FIFO or
    device at ``path`` is refused, nothing appended)."""
    append_text(path, json.dumps(record) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Every record of a JSON-lines file of the run (``metrics.jsonl``: NaN is a value), up to
    the first line that is not one (torn by a crash, garbage: it ends the valid part). Read as
    a regular file only (:func:`hpc_hsdp.files.open_regular`); none without the file."""
    try:
        with open_regular(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        if not line.strip():
            continue
        try:
            record = parse_json(line, finite=False)
        except UnreadableFile:
            break  # a line torn by a crash ends the valid part
        if not isinstance(record, dict):
            break  # JSON, but no record (a number, a list): garbage as well
        records.append(record)
    return records
