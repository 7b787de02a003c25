"""Helpers shared by tests (moved out of tests/processes/test_fault_tolerance.py: no test module imports another)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from hpc_hsdp.cli.job_options import job_spec_from_options
from hpc_hsdp.cli.render_cmd import render
from hpc_hsdp.scheduler.emulator.allocation import allocation_for
from hpc_hsdp.scheduler.emulator.launch import launch_local
from hpc_hsdp.submit_host.render import render_sbatch
from tests.job_helpers import tiny_job

GLOBAL_BATCH = 12


STEPS = 24


def _spec(run_dir: Path, samples: Path, *extra: str, step_delay: str = "0.4"):
    argv = [
        *("--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--fault-tolerance", "replica"),
        *("--quorum-timeout", "20", "--steps", str(STEPS)),
        *tiny_job(width=16, heads=2, batch_size=None, vocab_size=None, global_batch_size=GLOBAL_BATCH),
        *("--straggler-every", "0", "--device", "cpu", "--run-dir", str(run_dir)),
        *("--venv", "none", "--python", sys.executable),
        *("--env", f"HPC_HSDP_FAULT_SAMPLE_LOG={samples}", "--env", f"HPC_HSDP_FAULT_STEP_DELAY_S={step_delay}"),
        *extra,
    ]
    params = render.make_context("render", argv).params
    return job_spec_from_options(params, environ={}, cwd=run_dir.parent, default_venv=None)


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _launch(spec):
    """The rendered script on the emulator, on the job's nodes and its spares."""
    tasks = spec.tasks_per_node + (spec.gpus_per_node,) * spec.spare_nodes
    return launch_local(
        render_sbatch(spec),
        alloc=allocation_for(tasks_per_node=tasks, gpus_per_node=2, job_name="ft"),
        logs_dir=Path(spec.log_dir),
    )
