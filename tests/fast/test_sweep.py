"""Sweeps (hpc_hsdp.job.sweep, sweep_submission, sweep_handle; submit --sweep): parsing and
expansion of --sweep, the points' specs, refusals (one line, exit 2, nothing written), the
rendered job array (golden file), a sweep point's job id on its tasks, its logs and records.
No processes, no cluster.

The rendered job arrays' golden files are tests/fast/test_render_golden.py's (SWEEPS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_hsdp.cli import main
from hpc_hsdp.cli.job_options import job_spec_resolver
from hpc_hsdp.errors import SchedulerError, SpecError
from hpc_hsdp.job.sweep import (
    array_range,
    check_array_size,
    expand,
    group_by_header,
    header_differences,
    parse_axes,
    parse_axis,
    parse_max_array_size,
)
from hpc_hsdp.plan.slurm_facts import own_job_id
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.rundir.lifecycle.provenance_record import read_provenance
from hpc_hsdp.rundir.lifecycle.sweep_record import SweepPoint, SweepRecord
from hpc_hsdp.scheduler.backends.slurm import SlurmBackend
from hpc_hsdp.scheduler.emulator.slurm_patterns import expand_pattern
from hpc_hsdp.scheduler.failure import task_index
from hpc_hsdp.submit_host.handle import JobHandle
from hpc_hsdp.submit_host.sweep_handle import PointResult, ranked
from hpc_hsdp.submit_host.sweep_submission import dry_run_text, plan_sweep, submit_sweep

GOLDEN = Path(__file__).parents[1] / "golden"
REGEN = os.environ.get("HPC_HSDP_REGEN_GOLDEN") == "1"
HOSTILE_SWEEP_DIR = "/scratch/sweeps/it's $(touch pwned) `id`"
BASE = {"nodes": 2, "gpus_per_node": 2, "shard": 2, "steps": 5, "venv": "/opt/venv"}


def given(**options):
    return {**{k: None for k in ("config", "profile")}, **BASE, **options}


def plan(sweep, *, mode=None, parallelism=None, **options):
    resolve = job_spec_resolver(environ={}, cwd="/work", default_venv=None)
    options = given(sweep=tuple(sweep), sweep_mode=mode, array_parallelism=parallelism, **options)
    return plan_sweep(options, resolve=resolve)


# ----------------------------------------------------------------------------- parsing and expansion


@pytest.mark.parametrize(
    ("text", "key", "values"),
    [
        ("lr=3e-4,1e-3", "lr", ["3e-4", "1e-3"]),
        ("--lr=3e-4", "lr", ["3e-4"]),
        ("global-batch-size=8, 16", "global_batch_size", ["8", "16"]),
        ("seed=0,1,2", "seed", ["0", "1", "2"]),
    ],
)
def test_a_sweep_option_is_a_key_and_its_values(text, key, values):
    assert parse_axis(text) == (key, values)


@pytest.mark.parametrize(
    ("specs", "refusal"),
    [
        (["lr"], "has no '='"),
        (["lr="], "empty value list"),
        (["lr=1e-3,"], "empty value"),
        (["learning_rate=1,2"], "'learning_rate' is not an option of hpc-hsdp submit"),
        (["steps=ten"], "'ten' is not an integer"),
        (["steps=1.5"], "'1.5' is not an integer"),
        (["lr=fast"], "'fast' is not a number"),
        (["lr=1e-3", "lr=1e-4"], "lr is swept twice"),
        (["run_dir=a,b"], "--run-dir cannot be swept"),
        (["config=a.toml"], "--config cannot be swept"),
        (["array_parallelism=1,2"], r"--array-parallelism cannot be swept \(it shapes the sweep itself\)"),
        (["precision=bf16,fp64"], "'fp64' is not one of --precision's choices"),
        ([], "at least one --sweep"),
        (["env=A=1\nrm -rf x"], "a value with a line break"),
    ],
)
def test_bad_sweeps_are_refused_naming_what_is_wrong(specs, refusal):
    with pytest.raises(SpecError, match=refusal):
        parse_axes(specs)


def test_grid_crosses_the_values_and_zip_pairs_them():
    axes = parse_axes(["lr=3e-4,1e-3", "seed=0,1"])
    grid = expand(axes, "grid")
    assert [p.name for p in grid] == ["lr=3e-4,seed=0", "lr=3e-4,seed=1", "lr=1e-3,seed=0", "lr=1e-3,seed=1"]
    assert [p.index for p in grid] == [0, 1, 2, 3]
    assert grid[2].values == {"lr": 1e-3, "seed": 0}  # read as the command line reads them
    zipped = expand(axes, "zip")
    assert [p.name for p in zipped] == ["lr=3e-4,seed=0", "lr=1e-3,seed=1"]
    with pytest.raises(SpecError, match="differ in length"):
        expand(parse_axes(["lr=3e-4,1e-3", "seed=0,1,2"]), "zip")
    with pytest.raises(SpecError, match="--sweep-mode 'cube' is unknown"):
        expand(axes, "cube")


def test_point_names_are_one_safe_directory_each_and_unique():
    points = expand(parse_axes(["entry=a/b:main,a_b:main"]), "grid")
    assert [p.name for p in points] == ["entry=a_b_main", "0001-entry=a_b_main"]
    assert all("/" not in p.name for p in points)
    flags = expand(parse_axes(["compile=yes,no"]), "grid")
    assert [p.values["compile"] for p in flags] == [True, False]


def test_the_api_gives_values_as_python_values():
    axes = parse_axes({"lr": [3e-4, 1e-3], "seed": range(2)})
    assert [p.name for p in expand(axes)] == [
        "lr=0.0003,seed=0",
        "lr=0.0003,seed=1",
        "lr=0.001,seed=0",
        "lr=0.001,seed=1",
    ]
    with pytest.raises(SpecError, match="empty value list"):
        parse_axes({"lr": []})


@pytest.mark.parametrize(
    ("count", "k", "want"),
    [(1, None, "0"), (4, 2, "0-3%2"), (40, None, "0-39"), ([2], 1, "2%1"), ([0, 2, 3, 4, 7], 3, "0,2-4,7%3")],
)
def test_array_range(count, k, want):
    assert array_range(count, k) == want


def test_max_array_size_from_scontrol_show_config():
    config = "Configuration data as of ...\nMaxArraySize            = 4\nMaxJobCount = 10000\n"
    assert parse_max_array_size(config) == 4
    assert parse_max_array_size("nothing") is None
    check_array_size(4, 4)
    with pytest.raises(SpecError, match=r"5 points, more than this cluster's MaxArraySize \(4: array task ids 0-3\)"):
        check_array_size(5, 4)
    runner = _Canned(scontrol=config)
    assert SlurmBackend(runner=runner).max_array_size() == 4
    assert runner.calls == [["scontrol", "show", "config"]]


# ----------------------------------------------------------------------------- the points' specs


def test_every_point_is_a_whole_job_in_its_own_run_directory(tmp_path):
    made = plan(["lr=3e-4,1e-3", "seed=0,1"], parallelism=2, run_dir=str(tmp_path / "sw"))
    assert made.sweep_dir == str(tmp_path / "sw")
    runs = [spec.run.run_dir for spec in made.specs]
    assert runs == [str(tmp_path / "sw" / p.name) for p in made.points]
    assert [(s.run.training.optimizer.lr, s.run.training.optimizer.seed) for s in made.specs] == [
        (3e-4, 0),
        (3e-4, 1),
        (1e-3, 0),
        (1e-3, 1),
    ]
    assert all(s.nodes == 2 and s.run.training.optimizer.steps == 5 for s in made.specs)
    assert "#SBATCH --array=0-3%2" in made.script
    # each point's tasks log as its array task (what its job.json names), not as SLURM's own job id of the task
    assert f"--output={runs[1]}/logs/%A_%a_%t_log.out \\" in made.point_script(1)
    assert "%j_%t_log" not in made.point_script(1)
    assert not (tmp_path / "sw").exists()  # planning writes nothing


@pytest.mark.parametrize(
    ("sweep", "refusal"),
    [
        (["lr=-1,1"], r"sweep point lr=-1: "),
        (["nodes=1,0"], r"sweep point nodes=0: "),
        (["steps=0,5"], r"sweep point steps=0: "),
    ],
)
def test_a_point_its_spec_refuses_is_named(sweep, refusal, tmp_path):
    with pytest.raises(SpecError, match=refusal):
        plan(sweep, run_dir=str(tmp_path / "sw"))
    assert not (tmp_path / "sw").exists()


def test_values_reaching_the_shell_are_quoted(tmp_path):
    made = plan(["env=A=$(touch pwned),A=`id`"], run_dir=HOSTILE_SWEEP_DIR)
    point_dir = made.specs[0].run.run_dir
    assert f"0) point_dir='{HOSTILE_SWEEP_DIR.replace(chr(39), chr(39) + chr(34) + chr(39) + chr(34) + chr(39))}/" in (
        made.script
    )
    # bash reads every point's directory back unchanged, running nothing
    case = made.script.split("case ", 1)[1].split("esac", 1)[0]
    for point, spec in zip(made.points, made.specs):
        shown = subprocess.run(
            ["bash", "-c", f'SLURM_ARRAY_TASK_ID={point.index}; case {case} esac; printf %s "$point_dir"'],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
        assert shown.stdout == spec.run.run_dir, shown.stderr
    assert not list(tmp_path.iterdir())  # nothing ran
    assert "export A='$(touch pwned)'" in made.point_script(0)
    assert point_dir in made.point_script(0)


# ----------------------------------------------------------------------------- the command line


def run_cli(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    return stop.value.code, capsys.readouterr()


@pytest.mark.parametrize(
    ("sweep", "said"),
    [
        (["--sweep", "learning_rate=1,2"], "'learning_rate' is not an option of hpc-hsdp submit"),
        (["--sweep", "lr="], "empty value list"),
        (["--sweep", "steps=1,two"], "'two' is not an integer"),
        (["--sweep", "nodes=1,x"], "sweep point nodes=x: "),
        (["--sweep", "sbatch=array=0-1,comment=x"], "(sweep point sbatch=array=0-1): the sweep makes the job arrays"),
        (["--sweep", "sweep_mode=grid,zip"], "--sweep-mode cannot be swept"),
        (["--sweep", "seed=0,1", "--sbatch", "array=0-9"], "the sweep makes the job arrays itself"),
        (["--sweep", "lr=1e-3", "--array-parallelism", "0"], "array-parallelism"),
    ],
)
def test_submit_refuses_a_bad_sweep_in_one_line_with_exit_2_writing_nothing(sweep, said, tmp_path, capsys):
    argv = ["submit", "--cluster", "local", "--nodes", "2", "--gpus-per-node", "1", "--shard", "1"]
    code, out = run_cli([*argv, "--run-dir", str(tmp_path / "sw"), *sweep], capsys)
    assert code == 2, out
    assert said in out.err and len(out.err.strip().splitlines()) == 1, out.err
    assert out.out == ""
    assert not list(tmp_path.iterdir())


def test_more_points_than_max_array_size_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    from hpc_hsdp.submit_host import sweep_submission

    runner = _Canned(scontrol="MaxArraySize = 3\n", sbatch="99\n")
    monkeypatch.setattr(sweep_submission, "resolve_cluster", lambda cluster: ("slurm", "SLURM"))
    monkeypatch.setattr(sweep_submission, "backend", lambda name: SlurmBackend(runner=runner))
    made = plan(["lr=3e-4,1e-3", "seed=0,1"], run_dir=str(tmp_path / "sw"))
    with pytest.raises(SpecError, match=r"4 points, more than this cluster's MaxArraySize \(3"):
        submit_sweep(made, cluster="slurm")
    assert runner.commands == ["scontrol"] and not list(tmp_path.iterdir())


def test_a_slurm_sweep_is_one_sbatch_of_the_array_and_a_record_per_point(tmp_path, monkeypatch):
    from hpc_hsdp.submit_host import sweep_submission

    runner = _Canned(scontrol="MaxArraySize = 1001\n", sbatch="4242;cluster\n", squeue="", sacct="")
    monkeypatch.setattr(sweep_submission, "resolve_cluster", lambda cluster: ("slurm", "submitting to SLURM"))
    monkeypatch.setattr(sweep_submission, "backend", lambda name: SlurmBackend(runner=runner))
    made = plan(["lr=3e-4,1e-3", "seed=0,1"], parallelism=2, run_dir=str(tmp_path / "sw"))
    record, said = submit_sweep(made, cluster="slurm")
    assert said == "submitting to SLURM"
    # the script goes to sbatch on its stdin, as checked: never read back from a directory others may write
    assert [c for c in runner.calls if c[0] == "sbatch"] == [["sbatch", "--parsable"]]
    assert runner.inputs == [made.script]
    assert (tmp_path / "sw" / "sweep.sbatch").read_text() == made.script
    assert record.job_id == "4242" and [p.name for p in record.points] == [p.name for p in made.points]
    for point, spec in zip(made.points, made.specs):
        run = Path(spec.run.run_dir)
        job = JobRecord.load(str(run))
        assert job.job_id == f"4242_{point.index}" and job.cluster == "slurm"
        assert json.loads((run / "claim.json").read_text())["job_id"] == f"4242_{point.index}"
        assert (run / "point.sbatch").read_text() == made.point_script(point.index)
        assert (run / "logs").is_dir()
        provenance = read_provenance(run)  # what produced the point, as for a job of its own
        assert provenance["job_id"] == f"4242_{point.index}" and provenance["code"][0]["name"] == "hpc_hsdp"
        assert (run / provenance["script"]).read_text() == made.point_script(point.index)
    again = SweepRecord.load(tmp_path / "sw")
    assert again.job_id == "4242" and again.points[3].values == (("lr", "1e-3"), ("seed", "1"))


# ----------------------------------------------------------------------------- on the task, and after


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"SLURM_JOB_ID": "105", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "2"}, "100_2"),
        ({"SLURM_JOB_ID": "105"}, "105"),
        ({}, None),
    ],
)
def test_a_task_of_an_array_belongs_to_its_array_task(env, want):
    assert own_job_id(env) == want


def test_logs_of_an_array_task_are_named_and_ordered_by_it():
    names = {"job_id": "105", "procid": 3, "array_job": "100", "array_task": "2"}
    assert expand_pattern("/r/logs/%A_%a_%t_log.out", **names) == "/r/logs/100_2_3_log.out"
    assert expand_pattern("/r/logs/%A_%a_%t_log.out", job_id="7", procid=1) == "/r/logs/7_0_1_log.out"
    paths = [Path(f"100_2_{t}_log.out") for t in (10, 2, 0)]
    assert sorted(paths, key=task_index) == [Path("100_2_0_log.out"), Path("100_2_2_log.out"), Path("100_2_10_log.out")]
    assert task_index(Path("77_5_log.err")) == 5


@pytest.mark.parametrize(
    ("job_ids", "point_jobs", "task"),
    [
        (("100",), (None, None), "100_1"),  # one array (a record without the points' job ids, as older ones)
        (("100", "200"), ("100_0", "200_0"), "200_0"),  # one array per header: task 0 of the second
    ],
)
def test_slurm_says_a_point_writes_its_own_run_directory(job_ids, point_jobs, task, tmp_path):
    sweep = SweepRecord(
        sweep_dir=str(tmp_path),
        job_ids=job_ids,
        cluster="slurm",
        mode="grid",
        parallelism=None,
        sweep=("nodes=1,2",),
        submitted_at=5.0,
        points=tuple(
            SweepPoint(index=i, name=f"nodes={i + 1}", values=(("nodes", str(i + 1)),), job_id=job)
            for i, job in enumerate(point_jobs)
        ),
    )
    sweep.save()
    array, _, index = task.partition("_")
    shown = f"JobId=301 ArrayJobId={array} ArrayTaskId={index} StdOut={tmp_path}/logs/{task}_batch.out\n"
    point = JobRecord(
        job_id=task,
        cluster="slurm",
        run_dir=str(tmp_path / "nodes=2"),
        logs_dir=str(tmp_path / "nodes=2" / "logs"),
        job_name="t",
        ntasks=2,
        launcher="srun",
        submitted_at=0.0,
    )
    assert SlurmBackend(runner=_Canned(scontrol=shown)).works_in(point) == tmp_path / "nodes=2" / "logs"
    assert SweepRecord.load(tmp_path) == sweep


def test_a_sweep_record_names_points_inside_its_directory(tmp_path):
    (tmp_path / "sweep.json").write_text(
        json.dumps(
            {"job_id": "1", "cluster": "local", "mode": "grid", "points": [{"index": 0, "name": "../x", "values": []}]}
        )
    )
    with pytest.raises(SpecError, match="not a sweep's record"):
        SweepRecord.load(tmp_path)
    with pytest.raises(SpecError, match="holds no sweep.json"):
        SweepRecord.load(tmp_path / "none")


def _result(index, loss, eval_loss=None):
    return PointResult(
        index, f"p{index}", (), "", f"1_{index}", "COMPLETED", 5, loss, eval_loss, 5 if eval_loss else None
    )


def test_points_rank_by_their_last_eval_loss_else_their_loss():
    by_loss = ranked([_result(0, 3.0), _result(1, 2.0), _result(2, None), _result(3, float("nan"))])
    assert [r.index for r in by_loss] == [1, 0, 2, 3]
    by_eval = ranked([_result(0, 1.0, 3.5), _result(1, 2.0, 3.1)])
    assert [r.index for r in by_eval] == [1, 0]


def test_the_sweep_commands_import_no_torch(tmp_path):
    from cli_helpers import assert_cli_imports_no_torch

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    SweepRecord(
        sweep_dir=str(sweep),
        job_ids=("9",),
        cluster="local",
        mode="grid",
        parallelism=None,
        sweep=("seed=0,1",),
        points=tuple(SweepPoint(index=i, name=f"seed={i}", values=(("seed", str(i)),)) for i in range(2)),
    ).save()
    for i in range(2):
        run = sweep / f"seed={i}"
        (run / "logs").mkdir(parents=True)
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0 + i, "wall_time": 1.0}) + "\n")
        JobRecord(
            job_id=f"9_{i}",
            cluster="local",
            run_dir=str(run),
            logs_dir=str(run / "logs"),
            job_name="t",
            ntasks=2,
            launcher="srun",
            submitted_at=0.0,
        ).save()
    with pytest.raises(
        SpecError, match=r"is a sweep's directory, not one job's; give one of its points \(seed=0, seed=1\)"
    ):
        JobHandle.find(str(sweep))  # logs takes one job
    assert_cli_imports_no_torch(
        ["status", str(sweep)],
        ["runs", str(sweep)],
        ["report", str(sweep), "-o", str(tmp_path / "r.html")],
        [
            "submit",
            "--dry-run",
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--shard",
            "1",
            "--run-dir",
            str(tmp_path / "s"),
            "--sweep",
            "seed=0,1",
        ],
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM")},
    )


class _Canned:
    def __init__(self, **answers) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []
        self.inputs: list[str | None] = []  # what each sbatch was sent on its stdin

    def __call__(self, argv, **kwargs):
        self.calls.append(list(argv))
        if argv[0] == "sbatch":
            self.inputs.append(kwargs.get("input"))
        return subprocess.CompletedProcess(list(argv), 0, self.answers[argv[0]], "")

    @property
    def commands(self) -> list[str]:
        return [argv[0] for argv in self.calls]


def test_dry_run_prints_the_points_and_scripts_and_submits_nothing(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_hsdp",
            "submit",
            "--dry-run",
            "--nodes",
            "2",
            "--gpus-per-node",
            "1",
            "--shard",
            "1",
        ]
        + [
            "--run-dir",
            str(tmp_path / "sw"),
            "--sweep",
            "lr=3e-4,1e-3",
            "--sweep",
            "seed=0,1",
            "--array-parallelism",
            "2",
        ],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM")},
    )
    assert out.returncode == 0, out.stderr
    assert f"#   task 3: lr=1e-3 seed=1 -> {tmp_path}/sw/lr=1e-3,seed=1\n" in out.stdout
    assert "#SBATCH --array=0-3%2" in out.stdout and "exec bash /dev/fd/3" in out.stdout
    assert not (tmp_path / "sw").exists()


def test_an_emulated_point_whose_array_runner_died_before_starting_it_failed(tmp_path):
    from hpc_hsdp.scheduler.emulator.emulated_job import LocalJob
    from hpc_hsdp.scheduler.emulator.state_files import state_path

    runner = tmp_path / "1_array_local.json"
    runner.write_text(json.dumps({"job_id": "1", "points": [], "parallelism": 1, "runner_pid": 4242}))
    state_path(tmp_path, "1_0").write_text(
        json.dumps({"job_id": "1_0", "state": "PENDING", "supervisor_pid": None, "array_runner": str(runner)})
    )
    waiting = LocalJob(logs_dir=tmp_path, job_id="1_0", alive=lambda pid: True)
    assert waiting.info()["state"] == "PENDING"  # its runner starts it when a slot is free
    orphan = LocalJob(logs_dir=tmp_path, job_id="1_0", alive=lambda pid: False).info()
    assert orphan["state"] == "FAILED" and "runner of its job array ended" in orphan["reason"]


# ----------------------------------------------------------------------------- one job array per #SBATCH header

A1 = ("nodes", "1")
A2 = ("nodes", "2")
OUT = ("output", "/sw/p/logs/%j.out")


@pytest.mark.parametrize(
    ("headers", "groups", "differs"),
    [
        ([[A1, OUT], [A1, ("output", "/sw/q/logs/%j.out")]], [((A1,), (0, 1))], [""]),  # run-dir lines apart: one
        ([[A1], [A2], [A1], [A2]], [((A1,), (0, 2)), ((A2,), (1, 3))], ["--nodes=1", "--nodes=2"]),
        ([[A2], [A1]], [((A2,), (0,)), ((A1,), (1,))], ["--nodes=2", "--nodes=1"]),  # in order of first appearance
        (
            [[A1, ("time", "1:00:00"), ("exclusive", None)], [A1, ("time", "2:00:00"), ("exclusive", None)]],
            [
                ((A1, ("time", "1:00:00"), ("exclusive", None)), (0,)),
                ((A1, ("time", "2:00:00"), ("exclusive", None)), (1,)),
            ],
            ["--time=1:00:00", "--time=2:00:00"],
        ),
        (
            [[A1], [A1, ("exclusive", None)]],
            [((A1,), (0,)), ((A1, ("exclusive", None)), (1,))],
            ["without --exclusive", "--exclusive"],
        ),
        ([[A1, A2], [A2, A1]], [((A1, A2), (0,)), ((A2, A1), (1,))], ["(the same lines, in another order)"] * 2),
    ],
)
def test_points_group_by_their_header_but_its_run_directory_lines(headers, groups, differs):
    found = group_by_header(headers)
    assert [(g.header, g.members) for g in found] == groups
    assert header_differences(found) == differs


def test_a_sweep_of_header_options_is_one_job_array_per_header(tmp_path):
    made = plan(["nodes=1,2", "seed=0,1"], parallelism=2, run_dir=str(tmp_path / "sw"))
    assert [p.name for p in made.points] == ["nodes=1,seed=0", "nodes=1,seed=1", "nodes=2,seed=0", "nodes=2,seed=1"]
    assert [s.nodes for s in made.specs] == [1, 1, 2, 2]
    assert [g.members for g in made.groups] == [(0, 1), (2, 3)] and len(made.scripts) == 2
    assert [made.task_of(i) for i in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert made.script_names() == ["sweep-1.sbatch", "sweep-2.sbatch"]
    for nodes, script in zip((1, 2), made.scripts):
        assert f"#SBATCH --nodes={nodes}\n" in script and "#SBATCH --array=0-1%2\n" in script
        assert f"this one's: --nodes={nodes} (task ids count within each array)" in script
        # task 0 and 1 of each array: its own points' directories, as bash reads the case back
        case = script.split("case ", 1)[1].split("esac", 1)[0]
        for task, seed in ((0, 0), (1, 1)):
            shown = subprocess.run(
                ["bash", "-c", f'SLURM_ARRAY_TASK_ID={task}; case {case} esac; printf %s "$point_dir"'],
                capture_output=True,
                text=True,
            )
            assert shown.stdout == str(tmp_path / "sw" / f"nodes={nodes},seed={seed}"), shown.stderr
    assert "--array" not in made.point_script(2) and "--nodes=2" in made.point_script(2)
    with pytest.raises(ValueError, match="2 job arrays"):
        _ = made.script
    # a sweep submitted again: the arrays of the points left, their task ids as before
    assert "#SBATCH --array=1%2\n" in made.render(1, [3])
    text = dry_run_text(made)
    assert text.startswith("# hpc-hsdp submit --sweep: 4 points in 2 job arrays, one per distinct #SBATCH header")
    assert "#   sweep-2.sbatch: --nodes=2: 2 point(s): nodes=2,seed=0, nodes=2,seed=1\n" in text
    assert text.count("#!/bin/bash") == 2 and "# ==================== sweep-2.sbatch\n#!/bin/bash" in text


def _slurm_sweep(tmp_path, monkeypatch, runner):
    from hpc_hsdp.submit_host import sweep_submission

    monkeypatch.setattr(sweep_submission, "resolve_cluster", lambda cluster: ("slurm", "submitting to SLURM"))
    monkeypatch.setattr(sweep_submission, "backend", lambda name: SlurmBackend(runner=runner))
    from hpc_hsdp.submit_host import sweep_handle

    monkeypatch.setattr(sweep_handle, "backend", lambda name: SlurmBackend(runner=runner))
    from hpc_hsdp.submit_host import handle

    monkeypatch.setattr(handle, "backend", lambda name: SlurmBackend(runner=runner))


class _Arrays(_Canned):
    """SLURM's answers: each sbatch a new array id (100, 200 ...; ``refuse``: the n-th is refused)."""

    def __init__(self, refuse: int | None = None, writes: dict[str, Path] | None = None, **answers) -> None:
        super().__init__(**{"scontrol": "MaxArraySize = 1001\n", "squeue": "", "sacct": "", "scancel": "", **answers})
        self.refuse = refuse
        self.writes = writes or {}
        """Job id -> the directory of its batch log (``scontrol show job``'s StdOut)."""

    def __call__(self, argv, **kwargs):
        if argv[:3] == ["scontrol", "-o", "show"]:
            self.calls.append(list(argv))
            logs = self.writes.get(argv[-1])
            shown = f"JobId={argv[-1]} StdOut={logs}/{argv[-1]}_batch.out\n" if logs else ""
            return subprocess.CompletedProcess(list(argv), 0 if logs else 1, shown, "" if logs else "Invalid job id")
        if argv[0] != "sbatch":
            return super().__call__(argv, **kwargs)
        self.calls.append(list(argv))
        self.inputs.append(kwargs.get("input"))
        n = self.commands.count("sbatch")
        if n == self.refuse:
            return subprocess.CompletedProcess(list(argv), 1, "", "sbatch: error: Invalid partition name specified")
        return subprocess.CompletedProcess(list(argv), 0, f"{100 * n};c\n", "")


def test_a_slurm_sweep_of_two_headers_is_two_arrays_each_point_its_task_status_and_cancel_all(tmp_path, monkeypatch):
    from hpc_hsdp.submit_host.sweep_handle import SweepHandle

    runner = _Arrays(
        squeue="100_0|RUNNING|None\n100_1|PENDING|JobArrayTaskLimit\n200_0|RUNNING|None\n",
        sacct="200_1|COMPLETED|0:0\n",
        writes={task: tmp_path / "sw" / "logs" for task in ("100_0", "100_1", "200_0", "200_1")},
    )
    _slurm_sweep(tmp_path, monkeypatch, runner)
    made = plan(["nodes=1,2", "seed=0,1"], parallelism=1, run_dir=str(tmp_path / "sw"))
    record, _ = submit_sweep(made, cluster="slurm")
    sweep = tmp_path / "sw"
    assert [c for c in runner.calls if c[0] == "sbatch"] == [["sbatch", "--parsable"]] * 2
    assert runner.inputs == list(made.scripts)
    assert [(sweep / n).read_text() for n in made.script_names()] == list(made.scripts)
    assert not (sweep / "sweep.sbatch").exists()
    tasks = ["100_0", "100_1", "200_0", "200_1"]
    again = SweepRecord.load(sweep)
    assert again == record and again.job_ids == ("100", "200") and record.job_id == "100,200"
    assert [again.task_id(p) for p in again.points] == tasks
    assert json.loads((sweep / "sweep.json").read_text())["job_id"] == "100"  # as one array's record has it
    for task, spec in zip(tasks, made.specs):
        assert JobRecord.load(spec.run.run_dir).job_id == task
        assert read_provenance(spec.run.run_dir)["job_id"] == task

    handle = SweepHandle.find(sweep)
    runner.calls.clear()
    states = [r.state for r in handle.results()]
    assert states == ["RUNNING", "PENDING", "RUNNING", "COMPLETED"], states
    assert runner.commands == ["squeue", "sacct"]  # every point of both arrays in one question each
    assert [r.job_id for r in handle.results(states=False)] == tasks
    assert handle.point("200_0").name == "nodes=2,seed=0"

    runner.calls.clear()
    assert handle.cancel() == tasks[:3]  # the points not ended
    assert [c for c in runner.calls if c[0] == "scancel"] == [["scancel", "100"], ["scancel", "200"]]
    runner.calls.clear()
    assert handle.cancel("nodes=2,seed=0") == ["200_0"]
    assert [c for c in runner.calls if c[0] == "scancel"] == [["scancel", "200_0"]]


def test_a_sweeps_cancel_and_status_act_only_on_jobs_that_run_in_its_own_directories(tmp_path, monkeypatch):
    """A point's directory may be writable by others: a job.json (and sweep.json) forged to name
    another job of the user's is neither shown as the point's nor cancelled (SECURITY.md)."""
    import dataclasses

    from hpc_hsdp.submit_host.sweep_handle import SweepHandle

    victim = tmp_path / "victim" / "logs"
    runner = _Arrays(
        squeue="100_0|RUNNING|None\n100_1|PENDING|JobArrayTaskLimit\n200_0|RUNNING|None\n999|RUNNING|None\n",
        sacct="200_1|COMPLETED|0:0\n",
        writes={"100_0": tmp_path / "sw" / "logs", "100_1": tmp_path / "sw" / "logs", "999": victim},
    )
    _slurm_sweep(tmp_path, monkeypatch, runner)
    made = plan(["nodes=1,2", "seed=0,1"], parallelism=1, run_dir=str(tmp_path / "sw"))
    submit_sweep(made, cluster="slurm")
    sweep = tmp_path / "sw"
    forged = sweep / "nodes=2,seed=0" / "job.json"
    data = json.loads(forged.read_text())
    forged.write_text(json.dumps({**data, "job_id": "999"}))
    handle = SweepHandle.find(sweep)
    assert [r.state for r in handle.results()][2] == (
        "UNKNOWN (its job.json is broken or names another job than the sweep's)"
    )
    runner.calls.clear()
    assert handle.cancel() == ["100_0", "100_1"]
    assert [c for c in runner.calls if c[0] == "scancel"] == [["scancel", "100"]]

    record = SweepRecord.load(sweep)  # sweep.json forged as well: the scheduler's word decides
    points = tuple(dataclasses.replace(p, job_id="999") if p.index == 2 else p for p in record.points)
    dataclasses.replace(record, points=points).save()
    handle = SweepHandle.find(sweep)
    runner.calls.clear()
    assert handle.cancel() == ["100_0", "100_1"]
    assert [c for c in runner.calls if c[0] == "scancel"] == [["scancel", "100"]]
    assert len(handle.refused) == 1 and handle.refused[0].startswith("nodes=2,seed=0: ")
    assert f"the scheduler says it writes {victim.parent}" in handle.refused[0]
    with pytest.raises(SpecError, match=f"is not where job 999 runs: the scheduler says it writes {victim.parent}"):
        handle.cancel("nodes=2,seed=0")
    assert [c for c in runner.calls if c[0] == "scancel"] == [["scancel", "100"]]


def test_a_later_array_refused_cancels_the_arrays_submitted_before_it_and_records_nothing(tmp_path, monkeypatch):
    runner = _Arrays(refuse=2)
    _slurm_sweep(tmp_path, monkeypatch, runner)
    made = plan(["nodes=1,2"], run_dir=str(tmp_path / "sw"))
    with pytest.raises(SchedulerError, match=r"Invalid partition.*\(100\) were cancelled: nothing of the sweep runs"):
        submit_sweep(made, cluster="slurm")
    assert ["scancel", "100"] in runner.calls
    assert not (tmp_path / "sw" / "sweep.json").exists()
    assert not any((tmp_path / "sw").glob("*/job.json"))


def test_max_array_size_bounds_each_array_of_the_sweep(tmp_path, monkeypatch):
    runner = _Arrays()
    runner.answers["scontrol"] = "MaxArraySize = 3\n"
    _slurm_sweep(tmp_path, monkeypatch, runner)
    made = plan(["nodes=1,2", "seed=0,1,2"], run_dir=str(tmp_path / "sw"))  # 6 points: 2 arrays of 3
    record, _ = submit_sweep(made, cluster="slurm")
    assert record.job_ids == ("100", "200") and max(int(record.task_id(p).split("_")[1]) for p in record.points) == 2
    runner.answers["scontrol"] = "MaxArraySize = 2\n"
    with pytest.raises(
        SpecError, match=r"job array 1 \(--nodes=1\) of the sweep has 3 points, more than .*MaxArraySize \(2"
    ):
        submit_sweep(plan(["nodes=1,2", "seed=0,1,2"], run_dir=str(tmp_path / "other")), cluster="slurm")
    assert not (tmp_path / "other").exists()


def test_a_swept_partition_the_cluster_lacks_is_refused_before_any_array_is_submitted(tmp_path, monkeypatch):
    class _Partitions(_Arrays):
        def __call__(self, argv, **kwargs):
            if argv[:3] == ["scontrol", "show", "partition"]:
                self.calls.append(list(argv))
                return subprocess.CompletedProcess(list(argv), int(argv[3] != "debug"), "", "")
            if argv[0] == "sinfo":
                self.calls.append(list(argv))
                return subprocess.CompletedProcess(list(argv), 0, "debug\nsite\n", "")
            return super().__call__(argv, **kwargs)

    runner = _Partitions()
    _slurm_sweep(tmp_path, monkeypatch, runner)
    made = plan(["partition=debug,nosuch"], run_dir=str(tmp_path / "sw"))
    assert len(made.groups) == 2  # one array per partition
    with pytest.raises(
        SchedulerError, match=r"--partition 'nosuch' does not exist on this cluster; choose one of debug"
    ):
        submit_sweep(made, cluster="slurm")
    assert "sbatch" not in runner.commands and not (tmp_path / "sw").exists()


def test_a_point_is_found_by_its_values_however_they_are_written(tmp_path):
    from hpc_hsdp.submit_host.sweep_handle import SweepHandle  # noqa: PLC0415

    values = [(("lr", "0.001"), ("seed", "1")), (("lr", "0.0003"), ("seed", "1"))]  # as the Python API names them
    sweep = SweepRecord(
        sweep_dir=str(tmp_path),
        job_ids=("100",),
        cluster="local",
        mode="grid",
        parallelism=None,
        sweep=("lr=1e-3,3e-4", "seed=1"),
        submitted_at=5.0,
        points=tuple(
            SweepPoint(index=i, name=",".join(f"{k}={v}" for k, v in pair), values=pair)
            for i, pair in enumerate(values)
        ),
    )
    handle = SweepHandle(sweep)
    assert handle.point("lr=1e-3,seed=1").index == 0 and handle.point("seed=1, lr=3e-4").index == 1
    assert handle.point("lr=0.001,seed=1").index == 0 and handle.point("1").index == 1
    for ref in ("lr=1e-3", "lr=1e-3,seed=2", "lr=1e-3,seed=1,steps=3", "lr=fast,seed=1", "bogus"):
        with pytest.raises(SpecError, match="has no point"):
            handle.point(ref)
