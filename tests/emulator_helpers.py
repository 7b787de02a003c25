"""Helpers shared by tests (moved out of tests/processes/test_local.py: no test module imports another)."""

from __future__ import annotations

TEARDOWN_PROBE = """\
import atexit, os
from pathlib import Path

class _Teardown:
    def __init__(self, path):
        self.path = path
    def __del__(self):  # runs only while the interpreter tears the modules down
        Path(self.path).write_text("torn down")

def main(ctx):
    out = Path(ctx.run_dir) / f"rank{ctx.rank}"
    atexit.register(lambda: Path(f"{out}.atexit").write_text("ran"))
    globals()["_probe"] = _Teardown(f"{out}.teardown")
"""
