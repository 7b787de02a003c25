"""The run's metrics on this task: ``metrics.jsonl`` through :mod:`hpc_hsdp.rundir.training.metrics`
(rank 0 writes it), and the step's line on stdout."""

from __future__ import annotations

from hpc_hsdp.rundir.training.metrics import MetricsLog
from hpc_hsdp.task.parallelism.dist import RunContext


def metrics_log(ctx: RunContext, *, start_step: int) -> MetricsLog:
    """Rank 0's writer of ``<run_dir>/metrics.jsonl``; on other ranks one that writes nothing. In a
    fault-tolerant run rank 0 of every replica group (the leading group of a step writes its record)."""
    if ctx.replica is not None:
        return MetricsLog(ctx.run_dir if ctx.rank == 0 else None, start_step=start_step, replacing=True)
    return MetricsLog(ctx.run_dir if ctx.is_rank0 else None, start_step=start_step)


def step_line(record: dict, total_steps: int) -> str:
    text = (
        f"step {record['step']:>5}/{total_steps}  loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
        f"gnorm {record['grad_norm']:.3f}"
    )
    if "eval_loss" in record:
        text += f"  eval {record['eval_loss']:.4f}"
    return text + (
        f"  {record['tokens_per_s']:,.0f} tok/s  {record['step_time_s'] * 1000:.0f} ms  "
        f"wait {record['data_wait_s'] * 1000:.1f} ms  peak {record['peak_mem_bytes'] / 2**20:.0f} MiB "
        f"({record['peak_mem_kind']})"
    )
