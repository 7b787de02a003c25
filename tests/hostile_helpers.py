"""Helpers shared by tests (moved out of tests/fast/test_hostile.py: no test module imports another)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import pytest

from hpc_hsdp.cli import main


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def one_error_line(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpc-hsdp: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, err)


class MarkerPickle:
    """Unpickled, it would run ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _poison_bytes_entry(checkpoint: Path, marker: Path) -> None:
    """Point one non-tensor entry (the optimizer's lr) at a torch.save of a pickle whose reduce
    runs a command; the metadata itself stays plain DCP classes."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from hpc_hsdp.task.checkpointing.safe_dcp import read_metadata_file

    metadata = read_metadata_file(checkpoint / ".metadata")
    buffer = io.BytesIO()
    torch.save(MarkerPickle(marker), buffer)
    (checkpoint / "__9_0.distcp").write_bytes(buffer.getvalue())
    for index in list(metadata.storage_data):
        if index.fqn == "optim.param_groups.0.lr":
            metadata.storage_data[index] = _StorageInfo("__9_0.distcp", 0, len(buffer.getvalue()))
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
