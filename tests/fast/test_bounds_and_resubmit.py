"""Bad sizes, re-submission, and the small things a new user trips over (issue 13):
sizes beyond any cluster are one line and exit 2 (under a memory limit, so that a regression
fails instead of taking the machine's memory), big plans stay small on screen, one node-name
scheme, whole reason lines, a closed pipe, and dependencies that point one way. Submitting into a
completed or resumable run directory: tests/processes/test_bounds_and_resubmit.py."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import hpc

from hpc_hsdp.errors import SpecError, TopologyError
from hpc_hsdp.plan.topology import MAX_NODES, MAX_TASKS_PER_NODE, MAX_WORLD_SIZE, RankLayout, TopologyPlan, plan_for
from tests.bounds_helpers import limit_memory

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--nodes", "99999999", "--shard", "8"], "--nodes 99999999 is more than the 65,536 nodes"),
        (
            ["plan", "--nodes", "2", "--gpus-per-node", "99999999", "--shard", "1"],
            "--gpus-per-node 99999999 is more than",
        ),
        (["plan", "--nodes", "65536", "--gpus-per-node", "1024", "--shard", "1"], "67,108,864 ranks"),
        (["plan", "--nodelist", "n[1-99999999]", "--shard", "8"], "names 99,999,999 nodes"),
        (["plan", "--nodelist", "a[1-9999],b[1-9999],c[1-99999]", "--shard", "8"], "names 119,997 nodes"),
        (["plan", "--tasks-per-node", "8(x99999999)", "--shard", "8"], "nodes 99999999 is more than"),
        (["plan", "--tasks-per-node", "99999999,8", "--shard", "8"], "'99999999': 99999999 is more than the 1,024"),
        (
            ["render", "--nodes", "99999999", "--shard", "8", "--venv", "none", "--run-dir", "/tmp/x"],
            "--nodes 99999999",
        ),
        (
            ["render", "--nodes", "2", "--ntasks", "99999999", "--shard", "1", "--venv", "none", "--run-dir", "/tmp/x"],
            "--ntasks 99999999",
        ),
        (
            ["submit", "--nodes", "99999999", "--shard", "8", "--dry-run", "--venv", "none", "--run-dir", "/tmp/x"],
            "--nodes 99999999",
        ),
        (
            ["submit", "--cluster", "local", "--nodes", "16", "--shard", "8", "--venv", "none", "--run-dir", "/tmp/x"],
            "the local emulator runs every task as a process on this machine: 128 tasks are more than its 64",
        ),
    ],
)
def test_sizes_beyond_any_cluster_are_one_line_and_exit_2(args, message, tmp_path):
    out = hpc(*args, cwd=tmp_path, preexec_fn=limit_memory)
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("hpc-hsdp: error: ") and message in lines[0], lines[0]
    assert out.stdout == "" and list(tmp_path.iterdir()) == []  # nothing half-written


@pytest.mark.parametrize(
    ("kwargs", "fits"),
    [
        ({"nodes": MAX_NODES, "gpus_per_node": 1}, True),
        ({"nodes": MAX_NODES + 1, "gpus_per_node": 1}, False),
        ({"nodes": 1, "gpus_per_node": MAX_TASKS_PER_NODE}, True),
        ({"nodes": 1, "gpus_per_node": MAX_TASKS_PER_NODE + 1}, False),
        ({"nodes": MAX_WORLD_SIZE // 1024, "gpus_per_node": 1024}, True),
        ({"nodes": MAX_WORLD_SIZE // 1024 + 1, "gpus_per_node": 1024}, False),
    ],
)
def test_size_bounds(kwargs, fits):
    if fits:
        assert plan_for(shard_size=1, **kwargs).world_size == kwargs["nodes"] * kwargs["gpus_per_node"]
    else:
        with pytest.raises(TopologyError, match="check for a typo"):
            plan_for(shard_size=1, **kwargs)


def test_a_4096_node_plan_lists_the_first_and_last_nodes_and_json_every_rank():
    out = hpc("plan", "--nodes", "4096", "--gpus-per-node", "8", "--shard", "8", preexec_fn=limit_memory)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) < 80
    assert "... 4,090 more nodes (n5 to n4094, ranks 32-32751): --json lists every rank" in lines
    last = next(line for line in lines if line.split()[:3] == ["n4096", "7", "32767"])
    assert last.endswith("7: [7,15,23,...,32767]")
    data = json.loads(hpc("plan", "--nodes", "4096", "--shard", "8", "--json", preexec_fn=limit_memory).stdout)
    assert len(data["node_of_rank"]) == 32768 and data["node_names"][-1] == "n4096"
    assert not data["shard_groups_cross_nodes"] and data["replicate_groups_cross_nodes"]


@pytest.mark.parametrize(
    ("tasks_per_node", "shard", "shard_cross", "replicate_cross"),
    [
        ((8, 8), 4, False, True),
        ((8, 8), 16, True, False),
        ((4, 4, 4, 4), 8, True, True),
        ((8,), 2, False, False),
        ((8, 4), 4, False, True),
        ((2, 2), 1, False, True),
    ],
)
def test_groups_cross_nodes_agrees_with_the_groups_themselves(tasks_per_node, shard, shard_cross, replicate_cross):
    plan = TopologyPlan(tasks_per_node=tasks_per_node, shard_size=shard)
    assert (plan.shard_groups_cross_nodes, plan.replicate_groups_cross_nodes) == (shard_cross, replicate_cross)
    assert plan.shard_groups_cross_nodes == any(len(plan.nodes_of_group(g)) > 1 for g in plan.shard_groups)
    assert plan.replicate_groups_cross_nodes == any(len(plan.nodes_of_group(g)) > 1 for g in plan.replicate_groups)


# ----------------------------------------------------------------------------- one node-name scheme


def test_plan_the_emulator_and_the_readme_name_nodes_alike():
    from hpc_hsdp.scheduler.emulator.allocation import allocation_for

    assert plan_for(nodes=3, gpus_per_node=2, shard_size=2).node_names == ("n1", "n2", "n3")
    assert allocation_for(tasks_per_node=(2, 2, 2), gpus_per_node=2, job_name="x").node_names == ("n1", "n2", "n3")
    torchrun_env = {
        "TORCHELASTIC_RUN_ID": "x",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "RANK": "3",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "29500",
    }
    assert RankLayout.from_env(torchrun_env, shard_size=2).node == "n2"
    readme = (ROOT / "README.md").read_text()
    assert "node n1" in readme and "node n2" in readme and "local1" not in readme and "node0" not in readme


# ----------------------------------------------------------------------------- reason lines, pipes


def test_why_slurm_is_not_used_is_said_whole_on_one_line(tmp_path, monkeypatch):
    from hpc_hsdp.errors import SchedulerError
    from hpc_hsdp.scheduler.backends import resolve_cluster

    said = (
        "slurm_load_ctl_conf error: Unable to contact slurm controller (connect failure) at "
        "ctld.example.org:6817 after 3 attempts; check SlurmctldHost and that slurmctld is running on it"
    )
    assert len(said) > 120
    for name, text in (("sbatch", "exit 0"), ("scontrol", f"echo '{said}' >&2\necho second line >&2\nexit 1")):
        (tmp_path / name).write_text(f"#!/bin/sh\n{text}\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    with pytest.raises(SchedulerError) as refused:  # SLURM is here and its controller is silent: no local run
        resolve_cluster("auto")
    reason = str(refused.value)
    assert "\n" not in reason and f"({said} second line); nothing submitted" in reason, reason


def test_logs_into_a_closed_pipe_end_quietly_with_0(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "123_0_log.out").write_text("a line of the log\n" * 200_000)
    record = {
        "job_id": "123",
        "cluster": "local",
        "run_dir": str(tmp_path),
        "logs_dir": str(logs),
        "job_name": "x",
        "ntasks": 1,
        "launcher": "srun",
        "submitted_at": 0.0,
    }
    (tmp_path / "job.json").write_text(json.dumps(record))
    shell = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {sys.executable} -m hpc_hsdp logs {tmp_path} | head -2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shell.returncode == 0 and shell.stderr == "", shell.stderr
    assert shell.stdout.splitlines()[1] == "a line of the log"


# ----------------------------------------------------------------------------- dependencies point one way


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return {name for name in found if name.startswith("hpc_hsdp")}


def test_the_runtime_does_not_import_the_submitting_side():
    """The submitting side hands the runtime's task function to submitit; the runtime asks for
    a requeue through hpc_hsdp.scheduler.backends.slurm_task. Anywhere in a file, function-level imports included."""
    package = ROOT / "hpc_hsdp"
    submitting_side = (
        "hpc_hsdp.submit_host.submission",
        "hpc_hsdp.submit_host.api",
        "hpc_hsdp.submit_host.claims",
        "hpc_hsdp.submit_host.handle",
        "hpc_hsdp.scheduler.backends.slurm",
        "hpc_hsdp.scheduler.backends.submitit_slurm",
        "hpc_hsdp.cli",
        "hpc_hsdp.scheduler.backends.local",
        "hpc_hsdp.scheduler.emulator",
        "hpc_hsdp.submit_host.render",
    )
    packages = tuple(f"{name}." for name in submitting_side)
    for path in sorted((package / "task").rglob("*.py")):
        wrong = sorted(name for name in _imports(path) if name in submitting_side or name.startswith(packages))
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"
    # the requeue runs on the task: the one bounded runner, nothing of the submitting side
    assert _imports(package / "scheduler" / "backends" / "slurm_task.py") == {
        "hpc_hsdp.errors",
        "hpc_hsdp.files",
        "hpc_hsdp.scheduler.backends.job_environment",
        "hpc_hsdp.scheduler.backends.slurm_command",
    }
    assert _imports(package / "scheduler" / "backends" / "job_environment.py") == set()
    assert _imports(package / "scheduler" / "backends" / "slurm_command.py") == {
        "hpc_hsdp.errors",
        "hpc_hsdp.job.options",
    }
    assert _imports(package / "rundir" / "checkpointing" / "state.py") == {
        "hpc_hsdp.errors",
        "hpc_hsdp.files",
        "hpc_hsdp.rundir.lifecycle.attempts",
    }


# ----------------------------------------------------------------------------- run directories


def _fake_checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / "train_state.json").write_text(json.dumps({"step": step}))
    (path / "COMPLETE").write_text(f"step {step}\n")
    return path


def test_the_default_run_directory_is_new_for_each_submit(tmp_path):
    from hpc_hsdp.cli.job_options import job_spec_from_options

    options = {"shard_size": 1, "nodes": 1, "gpus_per_node": 1, "job_name": "my job"}
    rendered = job_spec_from_options(options, cwd=tmp_path, default_venv=None).run.run_dir
    assert rendered == str(tmp_path / "hpc-hsdp-runs" / "my_job")
    first = job_spec_from_options(options, cwd=tmp_path, default_venv=None, new_run_dir=True).run.run_dir
    assert Path(first).parent == tmp_path / "hpc-hsdp-runs" and Path(first).name.startswith("my_job-20")
    Path(first).mkdir(parents=True)
    second = job_spec_from_options(options, cwd=tmp_path, default_venv=None, new_run_dir=True).run.run_dir
    assert second != first and not Path(second).exists()


def test_a_completed_run_directory_refuses_and_a_running_job_too(tmp_path):
    from hpc_hsdp.cli.job_options import job_spec_from_options
    from hpc_hsdp.submit_host.claims import check_run_dir

    run = tmp_path / "run"
    _fake_checkpoint(run, 3)
    spec = job_spec_from_options(
        {"shard_size": 1, "nodes": 1, "gpus_per_node": 1, "run_dir": str(run), "training_steps": 6},
        cwd=tmp_path,
        default_venv=None,
    )
    assert check_run_dir(spec) == (
        f"run directory {run} has a checkpoint at step 3: the job resumes from step 3 and trains to step 6"
    )
    _fake_checkpoint(run, 6)
    with pytest.raises(
        SpecError,
        match=r"already completed step 6 \(--steps 6\): nothing to train, nothing submitted; "
        r"extend the run with --steps N \(N > 6\) or choose a new --run-dir",
    ):
        check_run_dir(spec)

    # a job still running there (an emulated one whose supervisor is this very process)
    logs = run / "logs"
    logs.mkdir()
    (logs / "555_local.json").write_text(json.dumps({"state": "RUNNING", "supervisor_pid": os.getpid()}))
    (run / "job.json").write_text(
        json.dumps(
            {
                "job_id": "555",
                "cluster": "local",
                "run_dir": str(run),
                "logs_dir": str(logs),
                "job_name": "x",
                "ntasks": 1,
                "launcher": "srun",
                "submitted_at": 0.0,
            }
        )
    )
    with pytest.raises(SpecError, match=f"job 555 is still RUNNING in run directory {run}: nothing submitted"):
        check_run_dir(spec)


# ----------------------------------------------------------------------------- the save against the warning


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--nodes", "2", "--model-params", "7B", "--precision", "bf16"],  # fp32 parameters in the checkpoint
            [
                "checkpoint: 78.23 GiB (parameters and optimizer state, replicas stored once), 39.12 GiB per node: about 42 s "
                "at 1 GB/s per node (--write-bandwidth)",
                "fits the 120 s between --signal USR2@120 and the time limit",
            ],
        ),
        (
            ["--nodes", "1", "--model-params", "70B", "--signal", "USR2@300", "--write-bandwidth", "2GB/s"],
            [
                "checkpoint: 782.31 GiB (parameters and optimizer state, replicas stored once), 782.31 GiB per node: about "
                "420 s at 2 GB/s per node (--write-bandwidth)",
                "warning: that is longer than the 300 s between --signal USR2@300 and the time limit: the save on the "
                "warning would not finish; give --signal USR2@660 (1.5x the save and 30 s), or a faster file system",
            ],
        ),
        (
            ["--nodes", "1", "--model-params", "1B", "--signal", "USR1"],
            [
                "checkpoint: 11.18 GiB (parameters and optimizer state, replicas stored once), 11.18 GiB per node: about 12 s "
                "at 1 GB/s per node (--write-bandwidth)",
                "fits the 60 s between --signal USR1 and the time limit",
            ],
        ),
        (
            ["--nodes", "1", "--model-params", "1B", "--signal", "none"],
            [
                "checkpoint: 11.18 GiB (parameters and optimizer state, replicas stored once), 11.18 GiB per node: about 12 s "
                "at 1 GB/s per node (--write-bandwidth)",
                "no warning signal (--signal none): a time limit or preemption ends the job without a save",
            ],
        ),
    ],
)
def test_plan_estimates_the_save_time_against_the_signal_lead(args, expected):
    out = hpc("plan", "--gpus-per-node", "8", "--shard", "8", *args)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-2:] == expected


def test_a_bad_write_bandwidth_or_signal_is_one_line():
    for args, message in (
        (["--write-bandwidth", "fast"], "--write-bandwidth 'fast' is not a size"),
        (["--signal", "USR2@x"], "--signal 'USR2@x' is not SIG@SECONDS"),
    ):
        out = hpc("plan", "--nodes", "1", "--shard", "8", "--model-params", "7B", *args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr


def test_plan_asks_one_signal_lead_of_a_save_and_does_not_contradict_it():
    for params, lead, fits in (("7B", "USR2@120", True), ("13B", "USR2@120", False), ("13B", "USR2@147", True)):
        out = hpc(
            "plan", "--nodes", "2", "--gpus-per-node", "8", "--shard", "8", "--model-params", params, "--signal", lead
        )
        assert out.returncode == 0, out.stderr
        said = [line for line in out.stdout.splitlines() if "KillWait (30 s)" in line or "between --signal" in line]
        assert len(said) == 2, out.stdout
        if fits:
            assert "leaves the save time" in said[0] and said[1].endswith("and the time limit"), said
        else:
            assert "--signal USR2@147: 1.5x the save and 30 s" in said[0] and "--signal USR2@147 leaves" in said[1], (
                said
            )
