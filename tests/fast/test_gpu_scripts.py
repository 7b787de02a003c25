"""Every Python script benchmarks/gpu_run.sh starts imports and parses its arguments on a
machine without a GPU (the run itself needs one; see benchmarks/RESULTS.md): ``--help`` of
each, and the issue-24 driver's ``--dry-run``, which builds every variant's command."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _scripts_of_gpu_run() -> list[str]:
    text = (BENCH / "gpu_run.sh").read_text()
    return sorted(set(re.findall(r"benchmarks/([a-z0-9_]+\.py)", text)))


def test_gpu_run_starts_the_issue_24_driver_first_and_all_its_scripts_exist():
    scripts = _scripts_of_gpu_run()
    assert "gpu_compile_fp8.py" in scripts and "gpu_llama_1b.py" in scripts
    assert all((BENCH / s).is_file() for s in scripts), scripts


@pytest.mark.parametrize("script", [*_scripts_of_gpu_run(), "handwritten_fsdp2_compile.py"])
def test_each_script_parses_its_arguments_without_a_gpu(script):
    done = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_the_driver_builds_every_variant_and_refuses_an_unknown_kind():
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_compile_fp8.py"), "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split()[:2] for line in done.stdout.splitlines()]
    assert [k for m, k in rows if m == "169m"] == ["eager", "compile", "fp8", "unwrapped", "unwrapped-compile"]
    assert [k for m, k in rows if m == "1.1b"][-1] == "handwritten-compile" and len(rows) == 11
    fp8 = next(line for line in done.stdout.splitlines() if line.split()[1] == "fp8")
    assert "--precision fp8" in fp8 and "--compile" in fp8
    bad = subprocess.run(
        [sys.executable, str(BENCH / "gpu_compile_fp8.py"), "--only", "fast"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--only fast" in bad.stderr
