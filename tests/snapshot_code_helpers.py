"""Helpers shared by tests (moved out of tests/processes/test_snapshot_code.py: no test module imports another)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ENTRY = '''\
import os
import time
from pathlib import Path


def main(ctx):
    """Waits for the test's go (it edits the code on disk first), then imports the marker."""
    if ctx.rank == 0:
        go = Path(os.environ["SNAP_GO"])
        deadline = time.monotonic() + 120
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        from snapmod import marker
        import hpc_hsdp.job.task_call as task

        line = f"MARKER={marker.MARKER} restart={os.environ.get('SLURM_RESTART_COUNT', '0')} from={task.__file__}"
        print(line, flush=True)
        with open(Path(ctx.run_dir) / "markers.txt", "a") as f:
            f.write(line + "\\n")
        if os.environ.get("SNAP_HOLD_FIRST") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
            time.sleep(240)  # the first attempt runs until the test requeues the job
'''


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def package(root: Path) -> str:
    """snapmod (entry + marker 'old') in a fresh git checkout at ``root``; its commit."""
    (root / "snapmod").mkdir(parents=True)
    (root / "snapmod" / "__init__.py").write_text("")
    (root / "snapmod" / "entry.py").write_text(ENTRY)
    (root / "snapmod" / "marker.py").write_text('MARKER = "old"\n')
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "first")
    return git(root, "rev-parse", "HEAD").strip()
