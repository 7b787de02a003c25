"""The TensorBoard tracker (``--tracker tensorboard``, the default): event files under ``<run-dir>/tb/``.

TensorBoard's own writer (``torch.utils.tensorboard.SummaryWriter``; it needs the
``tensorboard`` package, the ``tb`` extra). Each row's scalars (the tags of
:mod:`hpc_hsdp.rundir.training.scalars`) at the record's step and wall time. A resumed attempt opens
the same directory with ``purge_step`` = the first step it will write: TensorBoard hides
whatever the previous attempt wrote from that step on, as metrics.jsonl drops those records,
so the curves go on with no repeated or out-of-order steps. One of the trackers of
:mod:`hpc_hsdp.task.observation.trackers`.

    tensorboard --logdir <run-dir>/tb
"""

from __future__ import annotations

from hpc_hsdp.rundir.observation.tracker_runs import TB_DIR, tracker_run, write_tracker_run


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, writer, *, through: int) -> None:
        self.writer = writer
        self.through = through
        """The step after which this attempt writes (rows before it are in the event files)."""

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=wall_time)
        self.writer.flush()

    def close(self, outcome: str) -> None:
        self.writer.close()


def open_tracker(start) -> TensorBoardTracker:
    """The writer for ``<run_dir>/tb`` continuing after the checkpoint's step, or after the last
    step the event files are known to hold when that is earlier (ImportError without the
    tensorboard package)."""
    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - tensorboard is an optional extra, loaded on rank 0 only

    through = start.continues_after(tracker_run(start.run_dir, "tensorboard"))
    write_tracker_run(start.run_dir, "tensorboard", {"logged_through": through})
    writer = SummaryWriter(log_dir=str(start.run_dir / TB_DIR), purge_step=through + 1, flush_secs=10)
    return TensorBoardTracker(writer, through=through)
