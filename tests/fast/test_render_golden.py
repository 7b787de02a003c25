"""Golden files of rendered scripts: every example, hostile values, each launcher and option family.

Regenerate after an intended change:  HPC_HSDP_REGEN_GOLDEN=1 pytest tests/fast/test_render_golden.py
"""

from __future__ import annotations

import difflib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hpc_hsdp.cli.examples import EXAMPLES, spec_from_argv
from hpc_hsdp.submit_host.render import render_sbatch
from tests.render_helpers import HOSTILE

GOLDEN = Path(__file__).parents[1] / "golden"
REGEN = os.environ.get("HPC_HSDP_REGEN_GOLDEN") == "1"
REGEN_COMMAND = "HPC_HSDP_REGEN_GOLDEN=1 pytest tests/fast/test_render_golden.py"


CASES: dict[str, tuple[str, ...]] = {
    **{f"example-{e.name}": e.argv for e in EXAMPLES},
    "hostile-srun": HOSTILE,
    "hostile-torchrun": (*HOSTILE, "--launcher", "torchrun"),
    "minimal-1x8-shard8": ("--shard", "8", "--venv", "none", "--run-dir", "/runs/minimal"),
    "check-spare-2x8-shard8": (
        *("--nodes", "2", "--spare-nodes", "1", "--shard", "8", "--check", "--check-threshold", "0.8"),
        *("--venv", "none", "--run-dir", "/runs/checked"),
    ),
    "check-torchrun-2x8-shard4": (
        *("--nodes", "2", "--shard", "4", "--check", "--launcher", "torchrun", "--venv", "none"),
        *("--run-dir", "/runs/checked-torchrun"),
    ),
    "uneven-ntasks-12-shard4": (
        "--nodes",
        "2",
        "--ntasks",
        "12",
        "--shard",
        "4",
        "--distribution",
        "cyclic",
        "--venv",
        "none",
        "--run-dir",
        "/runs/uneven",
        "--signal",
        "none",
        "--no-requeue",
    ),
    "debug-conda-cpu": (
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--shard",
        "2",
        "--debug",
        "--conda-env",
        "hsdp env",
        "--device",
        "cpu",
        "--python",
        "python3.11",
        "--run-dir",
        "/runs/debug",
        "--mem",
        "64G",
        "--steps",
        "5",
        "--lr",
        "0.001",
        "--timeout",
        "60",
        "--signal",
        "B:TERM@60",
    ),
    "flexible-1-2x8-shard4": (
        "--nodes",
        "1-2",
        "--shard",
        "4",
        "--venv",
        "none",
        "--run-dir",
        "/runs/flexible",
        "--batch-size",
        "2",
        "--time",
        "04:00:00",
    ),
    "flexible-1-2x8-container": (
        "--nodes",
        "1-2",
        "--shard",
        "8",
        "--venv",
        "none",
        "--run-dir",
        "/runs/flexible-container",
        "--container-image",
        "nvcr.io#nvidia/pytorch:24.05-py3",
        "--container-mounts",
        "/runs:/runs",
        "--signal",
        "B:TERM@60",
    ),
    "fault-tolerance-6x8-shard16-spare2": (
        "--nodes",
        "6",
        "--shard",
        "16",
        "--fault-tolerance",
        "replica",
        "--min-replicas",
        "2",
        "--spare-nodes",
        "2",
        "--quorum-timeout",
        "30",
        "--venv",
        "none",
        "--run-dir",
        "/runs/fault tolerant",
    ),
    "switches-4x8-shard16-strict": (
        "--nodes",
        "4",
        "--shard",
        "16",
        "--topology",
        "strict",
        "--switches",
        "1@30:00",
        "--venv",
        "none",
        "--run-dir",
        "/runs/switches",
    ),
    "segment-4x8-shard16-torchrun-strict": (
        "--nodes",
        "4",
        "--shard",
        "16",
        "--launcher",
        "torchrun",
        "--topology",
        "strict",
        "--segment",
        "2",
        "--venv",
        "none",
        "--run-dir",
        "/runs/segment",
    ),
    "topology-off-2x8-shard16": (
        "--nodes",
        "2",
        "--shard",
        "16",
        "--topology",
        "off",
        "--venv",
        "none",
        "--run-dir",
        "/runs/topology-off",
    ),
    "flexible-2-4x8-torchrun": (
        "--nodes",
        "2-4",
        "--shard",
        "8",
        "--launcher",
        "torchrun",
        "--venv",
        "none",
        "--run-dir",
        "/runs/flexible-torchrun",
        "--global-batch-size",
        "256",
    ),
}

SUBMITIT_COMMAND = "/opt/venvs/hsdp/bin/python -u -m hpc_hsdp.task.submitit_job '/scratch/hsdp/runs/it'\"'\"'s/logs'"
OVERRIDES = {
    "override-srun": (CASES["example-thread-2x8-shard4"], SUBMITIT_COMMAND),
    "override-torchrun": (CASES["example-torchrun-2x8-shard4"], SUBMITIT_COMMAND),
}


SWEEPS: dict[str, tuple[str, ...]] = {
    # submit --sweep: the job array's script (hostile run directory and values), then its first point's
    "sweep-2x2-parallel2-hostile": (
        *HOSTILE,
        "--sweep",
        "lr=3e-4,1e-3",
        "--sweep",
        "env=X=$(touch /tmp/pwned),X='`id`'",
        "--array-parallelism",
        "2",
    ),
    "sweep-zip-3": (
        "--nodes",
        "2",
        "--shard",
        "4",
        "--run-dir",
        "/scratch/sweeps/zip",
        "--sweep-mode",
        "zip",
        "--sweep",
        "lr=1e-4,3e-4,1e-3",
        "--sweep",
        "seed=0,1,2",
    ),
}


def rendered_sweep(argv) -> str:
    """What ``hpc-hsdp render <argv>`` prints for a sweep (machine-independent)."""
    from hpc_hsdp.cli.job_options import given_options, job_spec_resolver
    from hpc_hsdp.cli.render_cmd import render
    from hpc_hsdp.submit_host.sweep_submission import dry_run_text, plan_sweep

    params = render.make_context("render", list(argv)).params
    resolve = job_spec_resolver(environ={}, cwd=Path(__file__).parents[2], default_venv=None)
    return dry_run_text(plan_sweep(given_options(params), resolve=resolve, new_run_dir=False))


def rendered(name: str) -> str:
    if name in SWEEPS:
        return rendered_sweep(SWEEPS[name])
    if name in OVERRIDES:
        argv, command = OVERRIDES[name]
        return render_sbatch(spec_from_argv(argv), launch_command=command)
    return render_sbatch(spec_from_argv(CASES[name]))


ALL = sorted([*CASES, *OVERRIDES, *SWEEPS])


@pytest.mark.parametrize("name", ALL)
def test_golden(name: str) -> None:
    path = GOLDEN / f"{name}.sbatch"
    text = rendered(name)
    if REGEN:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    assert path.is_file(), f"no golden file {path}; create it with: {REGEN_COMMAND}"
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=f"golden/{path.name}",
                tofile="rendered now",
            )
        )
        pytest.fail(f"rendered script differs from its golden file:\n{diff}\nIf intended, regenerate: {REGEN_COMMAND}")


def test_no_orphan_golden_files() -> None:
    orphans = sorted(p.name for p in GOLDEN.glob("*.sbatch") if p.stem not in ALL)
    assert not orphans, f"golden files without a case: {orphans}; delete them"


def test_override_changes_only_the_launch_command() -> None:
    for argv, _ in OVERRIDES.values():
        spec = spec_from_argv(argv)
        plain, submitted = render_sbatch(spec), render_sbatch(spec, launch_command=SUBMITIT_COMMAND)
        changed = [(a, b) for a, b in zip(plain.splitlines(), submitted.splitlines()) if a != b]
        assert len(plain.splitlines()) == len(submitted.splitlines())
        assert len(changed) == 1, changed
        before, after = changed[0]
        assert after == f"    {SUBMITIT_COMMAND} || status=$?"
        assert before.startswith("    python -m hpc_hsdp run ") or before.startswith(
            """    bash -c 'trap "" "$HPC_HSDP_WARNING_SIGNAL" QUIT; PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP exec torchrun """
        )


@pytest.mark.parametrize("name", ALL)
def test_bash_syntax(name: str, tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(rendered(name))
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ALL)
def test_shellcheck(name: str, tmp_path: Path) -> None:
    if shutil.which("shellcheck") is None:
        message = (
            "shellcheck is not installed (scripts/bootstrap installs Debian's as root: apt-get install shellcheck)"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the shellcheck tests: {message}")
        pytest.skip(message)
    script = tmp_path / "job.sbatch"
    script.write_text(rendered(name))
    result = subprocess.run(["shellcheck", "--severity=warning", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
