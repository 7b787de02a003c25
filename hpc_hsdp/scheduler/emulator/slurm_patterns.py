"""What the emulator reads of a batch script as sbatch and srun would: ``#SBATCH`` values and
SLURM's filename patterns."""

from __future__ import annotations

import os
import re


def sbatch_value(script: str, key: str) -> str | None:
    """The value of ``#SBATCH --KEY=VALUE`` as sbatch reads it: a double-quoted one (what
    :func:`hpc_hsdp.submit_host.render.sbatch_quote` writes for a path with spaces) unescaped."""
    match = re.search(rf'^#SBATCH\s+--{key}[= ]("(?:[^"\\]|\\.)*"|\S+)\s*$', script, re.MULTILINE)
    if not match:
        return None
    value = match.group(1)
    if value[:1] == value[-1:] == '"' and len(value) > 1:
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value[1:-1] if value[:1] == value[-1:] == "'" and len(value) > 1 else value


def expand_pattern(
    pattern: str,
    *,
    job_id: str,
    procid: int = 0,
    node_id: int = 0,
    node: str = "",
    array_job: str | None = None,
    array_task: str | None = None,
) -> str:
    """SLURM's filename pattern: %j job id, %t task id, %n node id, %N node name, %A/%a a job array's
    id and task (the job id and 0 outside an array), %% a percent."""
    table = {
        "j": job_id,
        "J": job_id,
        "A": array_job or job_id,
        "a": array_task or "0",
        "t": str(procid),
        "n": str(node_id),
        "N": node,
        "x": "job",
        "u": os.environ.get("USER", "user"),
        "%": "%",
    }
    return re.sub(r"%(\w|%)", lambda m: table.get(m.group(1), m.group(0)), pattern)
