"""hpc-hsdp's CLI in a fresh interpreter: :func:`hpc` runs one command as a user would (in
:func:`env_outside_job`, the environment of a child outside any job), and :func:`assert_cli_imports_no_torch`
checks that commands import neither torch nor transformers (the CLI path must stay free of them)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

JOB_VARIABLES = ("SLURM", "MASTER_", "HPC_HSDP_NODE_SWITCHES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC")
"""Variables of a job (SLURM's, the switches its batch script hands its tasks) and of torch.distributed's
rendezvous and launcher: a test run inside an allocation must not hand its own to the commands it runs."""


def env_outside_job(env: dict | None = None, *, slurm: bool = False) -> dict:
    """This process's environment without :data:`JOB_VARIABLES`, ``env`` added (a None value leaves that
    variable out): a child's, as outside any job. ``slurm``: ``SLURM_CONF`` kept (the dev cluster's)."""
    base = {k: v for k, v in os.environ.items() if (slurm and k == "SLURM_CONF") or not k.startswith(JOB_VARIABLES)}
    return {k: v for k, v in {**base, **(env or {})}.items() if v is not None}


_MAIN = "import sys\nfrom hpc_hsdp.cli import main\nsys.argv[0] = 'hpc-hsdp'\nmain()\n"


def hpc(
    *args: str,
    env: dict | None = None,
    timeout: float = 300,
    slurm: bool = False,
    input: str | None = None,
    cwd: str | os.PathLike | None = None,
    prelude: str = "",
    python_options: tuple[str, ...] = (),
    preexec_fn: Callable[[], object] | None = None,
) -> subprocess.CompletedProcess:
    """``hpc-hsdp ARGS`` in a new interpreter, in :func:`env_outside_job` with ``env`` added. ``slurm``:
    the dev cluster's tests keep ``SLURM_CONF`` (which cluster the commands ask). ``prelude``: Python
    that interpreter runs before the CLI; ``python_options``: the interpreter's own (``-X importtime``);
    ``preexec_fn``: run in the child before it starts (a resource limit)."""
    entry = ("-c", prelude + _MAIN) if prelude else ("-m", "hpc_hsdp")
    return subprocess.run(
        [sys.executable, *python_options, *entry, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_outside_job(env, slurm=slurm),
        input=input,
        cwd=cwd,
        preexec_fn=preexec_fn,
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
