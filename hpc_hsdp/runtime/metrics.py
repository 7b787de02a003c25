"""``<run_dir>/metrics.jsonl``, written by rank 0, and the step's line on stdout."""

from __future__ import annotations

from hpc_hsdp.rundir.files import append_jsonl, truncate_metrics
from hpc_hsdp.runtime.dist import RunContext


class MetricsLog:
    """``<run_dir>/metrics.jsonl`` on rank 0: records after ``start_step`` are dropped on
    resume (the resumed run rewrites them), then one line per step."""

    def __init__(self, ctx: RunContext, *, start_step: int) -> None:
        self.path = ctx.run_dir / "metrics.jsonl" if ctx.run_dir is not None and ctx.is_rank0 else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            truncate_metrics(self.path, keep_through_step=start_step)

    def write(self, record: dict) -> None:
        if self.path is not None:
            append_jsonl(self.path, record)


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
