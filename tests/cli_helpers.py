"""hpc-hsdp's CLI in a fresh interpreter: :func:`hpc` runs one command as a user would, and
:func:`assert_cli_imports_no_torch` checks that commands import neither torch nor transformers (the
CLI path must stay free of them)."""

from __future__ import annotations

import os
import subprocess
import sys

JOB_VARIABLES = ("SLURM", "MASTER_", "HPC_HSDP_NODE_SWITCHES")
"""Variables of a job (SLURM's, the switches its batch script hands its tasks) and of torch.distributed's
rendezvous: a test run inside an allocation must not hand its own to the commands it runs."""


def hpc(
    *args: str, env: dict | None = None, timeout: float = 300, slurm: bool = False, input: str | None = None
) -> subprocess.CompletedProcess:
    """``hpc-hsdp ARGS`` in a new interpreter, outside any job (no :data:`JOB_VARIABLES`), ``env``
    added. ``slurm``: the dev cluster's tests keep ``SLURM_CONF`` (which cluster the commands ask)."""
    base = {k: v for k, v in os.environ.items() if (slurm and k == "SLURM_CONF") or not k.startswith(JOB_VARIABLES)}
    return subprocess.run(
        [sys.executable, "-m", "hpc_hsdp", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
        input=input,
    )


_SCRIPT = """
import sys
from hpc_hsdp.cli import main
for args in ({commands!r}):
    try:
        main(args)
    except SystemExit as exc:
        assert exc.code in (0, None), (args, exc.code)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
assert not heavy, heavy[:5]
print("no torch")
"""


def assert_cli_imports_no_torch(*commands: list[str], env: dict | None = None, timeout: float = 200) -> None:
    """Run ``commands`` (each an argv list for ``hpc-hsdp``) one after another in one new
    interpreter; each must exit 0 and none may import torch or transformers."""
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT.format(commands=list(commands))],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert out.returncode == 0 and "no torch" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
