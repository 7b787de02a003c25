"""TensorBoard event files of a run, written by rank 0 under ``<run-dir>/tb/``.

TensorBoard's own writer (``torch.utils.tensorboard.SummaryWriter``; it needs the
``tensorboard`` package, the ``tb`` extra). Each metrics.jsonl record becomes the
scalars :func:`hpc_hsdp.rundir.scalars.record_scalars` lists, at the record's step and wall
time. A resumed attempt opens the same directory with ``purge_step`` = the first step it
will write: TensorBoard hides whatever the previous attempt wrote from that step on, as
metrics.jsonl drops those records, so the curves go on with no repeated or out-of-order
steps. Without the package the run goes on; :func:`open_writer` says so once.

    tensorboard --logdir <run-dir>/tb
"""

from __future__ import annotations

import sys
from pathlib import Path

from hpc_hsdp.rundir.scalars import record_scalars

TB_DIR = "tb"


class TensorBoardLog:
    def __init__(self, writer) -> None:
        self.writer = writer

    def write(self, record: dict) -> None:
        step = int(record["step"])
        wall = record.get("wall_time")
        for tag, value in record_scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=wall)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_writer(run_dir: str | Path, *, start_step: int, verbose: bool = True) -> TensorBoardLog | None:
    """The writer for ``<run_dir>/tb`` continuing after ``start_step``; None (and one line on
    stderr) when the tensorboard package is missing."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - tensorboard is an optional extra, loaded on rank 0 only
    except ImportError as exc:
        if verbose:
            print(
                f"[hpc-hsdp] note: no TensorBoard event files are written ({exc}); pip install 'hpc-hsdp[tb]' "
                f"(or tensorboard) to get them under {Path(run_dir) / TB_DIR}",
                file=sys.stderr,
                flush=True,
            )
        return None
    return TensorBoardLog(SummaryWriter(log_dir=str(Path(run_dir) / TB_DIR), purge_step=start_step + 1, flush_secs=10))
