"""Issue 15 on a real GPU: the rendered script, with its new defaults, runs an HSDP step in bf16.

One process on one GPU, mesh (1, 1) (shard 1): two processes on the same GPU are not a
valid NCCL job, so this is the most one GPU can show. The script is the very text
``hpc-hsdp render`` writes; ``srun`` is a shim that starts its one task with the variables
SLURM would give it (one GPU visible, ``SLURM_GPUS_ON_NODE=1``). Skipped without CUDA.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_hsdp.cli.examples import spec_from_argv
from hpc_hsdp.submit_host.render import render_sbatch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SRUN_SHIM = r"""#!/bin/bash
# one task of one node, as slurmstepd starts it; srun's own options are dropped
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
echo "shim srun: task with HPC_HSDP_CPUS_PER_TASK=$HPC_HSDP_CPUS_PER_TASK OMP_NUM_THREADS=$OMP_NUM_THREADS" >&2
export SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NODEID=0 SLURM_STEP_ID=0 SLURM_STEP_NUM_TASKS=1
export SLURM_STEP_TASKS_PER_NODE=1 SLURM_STEP_NODELIST="$SLURM_JOB_NODELIST" SLURM_GPUS_ON_NODE=1
export SLURM_CPUS_PER_TASK="$HPC_HSDP_CPUS_PER_TASK" CUDA_VISIBLE_DEVICES="$SHIM_GPU"
exec "$@"
"""


def test_rendered_script_runs_bf16_hsdp_on_one_gpu_with_the_new_defaults(tmp_path: Path) -> None:
    import torch

    run = tmp_path / "run"
    spec = spec_from_argv(
        [
            "--nodes",
            "1",
            "--gpus-per-node",
            "1",
            "--shard",
            "1",
            "--venv",
            "none",
            "--python",
            sys.executable,
            "--run-dir",
            str(run),
            "--precision",
            "bf16",
            "--steps",
            "20",
            "--layers",
            "4",
            "--width",
            "512",
            "--heads",
            "8",
            "--seq-len",
            "512",
            "--batch-size",
            "8",
            "--vocab-size",
            "4096",
            "--timeout",
            "120",
        ]
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    text = script.read_text()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in text and "#SBATCH --exclusive" in text
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "srun").write_text(SRUN_SHIM)
    (shims / "srun").chmod(0o755)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    host = socket.gethostname().split(".")[0]
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCH_NCCL"))
    }
    env.update(
        {
            "PATH": f"{shims}:{env.get('PATH', '')}",
            "SHIM_GPU": visible,
            "SLURM_JOB_ID": "15",
            "SLURM_JOB_NODELIST": host,
            "SLURMD_NODENAME": host,
            "SLURM_TASKS_PER_NODE": "1",
            "SLURM_NTASKS": "1",
            "SLURM_CPUS_ON_NODE": str(len(os.sched_getaffinity(0))),
            "SLURM_JOB_NUM_NODES": "1",
            "MASTER_ADDR": "stale.invalid",
        }
    )
    (run / "logs").mkdir(parents=True)
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rendezvous at 127.0.0.1:" in done.stdout
    layout = json.loads((run / "layout.json").read_text())
    assert layout["backend"] == "nccl" and layout["ranks"][0]["device"] == "cuda:0"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == list(range(1, 21))
    assert records[-1]["loss"] < records[0]["loss"]
    rates = [r.get("tokens_per_s") for r in records[5:] if r.get("tokens_per_s")]
    name = torch.cuda.get_device_name(0)
    print(
        f"\n{name}: bf16 HSDP mesh (1,1), 4 x 512 model, 8 x 512 tokens: "
        f"{sorted(rates)[len(rates) // 2]:,.0f} tokens/s (median of steps 6-20); {done.stderr.splitlines()[0]}"
    )
