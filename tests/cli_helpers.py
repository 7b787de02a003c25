"""Run CLI commands in a fresh interpreter and check that none of them imported torch or
transformers (the CLI path must stay free of them)."""

from __future__ import annotations

import subprocess
import sys

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
