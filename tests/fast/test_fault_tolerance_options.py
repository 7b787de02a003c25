"""--fault-tolerance replica: the options, the replica groups' shape and the row split (pure, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_hsdp.cli.job_options import job_spec_from_options
from hpc_hsdp.cli.render_cmd import render
from hpc_hsdp.errors import SpecError, TopologyError
from hpc_hsdp.job.spec import JobSpec, RunSpec, TrainingSpec
from hpc_hsdp.plan.replica_layout import group_rows, replica_shape, split_evenly
from hpc_hsdp.plan.topology import TopologyPlan, plan_for


def spec(argv: list[str], tmp_path: Path) -> JobSpec:
    params = render.make_context("render", ["--run-dir", "/r", *argv]).params
    return job_spec_from_options(params, environ={}, cwd=tmp_path, default_venv=None)


SHAPES = [
    # (nodes, gpus per node, shard, groups (node indices), tasks per group)
    (3, 2, 2, [[0], [1], [2]], 2),
    (2, 8, 4, [[0], [1]], 8),  # two shard groups inside each node: the node is the replica group
    (4, 2, 4, [[0, 1], [2, 3]], 4),  # a shard group spans two nodes: so does its replica group
    (6, 4, 8, [[0, 1], [2, 3], [4, 5]], 8),
]


@pytest.mark.parametrize(("nodes", "gpus", "shard", "groups", "tasks"), SHAPES)
def test_replica_groups_are_whole_nodes_holding_one_copy(nodes, gpus, shard, groups, tasks) -> None:
    shape = replica_shape(plan_for(nodes=nodes, gpus_per_node=gpus, shard_size=shard), min_replicas=2)
    assert [list(g) for g in shape.groups] == groups
    assert shape.tasks_per_group == tasks
    assert shape.spares == ()
    assert shape.lighthouse_node == 0


def test_spares_follow_the_groups_and_count_in_the_allocation() -> None:
    shape = replica_shape(plan_for(nodes=4, gpus_per_node=2, shard_size=4), spare_nodes=2)
    assert shape.spares == (4, 5)
    assert shape.total_nodes == 6
    lines = "\n".join(shape.describe(("a", "b", "c", "d", "e", "f")))
    assert "replica group 1: c, d" in lines and "spare nodes: e, f" in lines and "lighthouse: on a" in lines


@pytest.mark.parametrize(
    ("plan", "kwargs", "error", "words"),
    [
        (plan_for(nodes=1, gpus_per_node=4, shard_size=2), {}, TopologyError, "at least 2"),
        (plan_for(nodes=2, gpus_per_node=2, shard_size=4), {}, TopologyError, "at least 2"),
        (plan_for(nodes=3, gpus_per_node=2, shard_size=2), {"min_replicas": 4}, SpecError, "at most 3"),
        (plan_for(nodes=4, gpus_per_node=2, shard_size=4), {"spare_nodes": 1}, SpecError, "multiple of 2"),
        (TopologyPlan(tasks_per_node=(2, 1), shard_size=1), {}, TopologyError, "same tasks on every node"),
    ],
)
def test_shapes_that_cannot_lose_a_group_are_refused_with_the_fix(plan, kwargs, error, words) -> None:
    with pytest.raises(error, match=words):
        replica_shape(plan, **kwargs)


@pytest.mark.parametrize("global_batch", [12, 13, 7, 4])
@pytest.mark.parametrize("group_world", [1, 2, 3])
def test_every_row_of_a_step_is_trained_once_whichever_groups_live(global_batch, group_world) -> None:
    for participants in (1, 2, 3):
        rows, micro_counts = [], set()
        for index in range(participants):
            for rank in range(group_world):
                spans = group_rows(
                    global_batch,
                    participants=participants,
                    group_index=index,
                    group_world=group_world,
                    rank=rank,
                    max_rows=2,
                )
                micro_counts.add(len(spans))
                assert all(stop - start <= 2 for start, stop in spans)
                rows += [row for start, stop in spans for row in range(start, stop)]
        assert sorted(rows) == list(range(global_batch))
        assert len(micro_counts) == 1, "every rank of every group runs as many micro-batches"


def test_split_evenly_differs_by_at_most_one() -> None:
    parts = [split_evenly(10, 3, i) for i in range(3)]
    assert parts == [(0, 4), (4, 7), (7, 10)]


def test_the_options_reach_the_spec_the_run_arguments_and_the_plan(tmp_path: Path) -> None:
    job = spec(
        [
            "--nodes",
            "3",
            "--gpus-per-node",
            "2",
            "--shard",
            "2",
            "--fault-tolerance",
            "replica",
            "--min-replicas",
            "2",
            "--quorum-timeout",
            "20",
            "--spare-nodes",
            "1",
        ],
        tmp_path,
    )
    assert job.spare_nodes == 1
    assert job.replicas.num_groups == 3 and job.replicas.spares == (3,)
    args = job.run.training.to_args()
    assert args == ["--fault-tolerance", "replica", "--min-replicas", "2", "--quorum-timeout", "20.0"]
    config = tmp_path / "ft.toml"
    config.write_text(
        textwrap.dedent("""\
        nodes = 3
        gpus_per_node = 2
        shard = 2
        fault_tolerance = "replica"
        min_replicas = 2
        quorum_timeout = 20.0
        spare_nodes = 1
        """)
    )
    assert spec(["--config", str(config)], tmp_path) == job


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--spare-nodes", "1"], "needs --fault-tolerance replica"),
        (["--fault-tolerance", "replica", "--launcher", "torchrun"], "--launcher torchrun"),
        (["--fault-tolerance", "replica", "--entry", "pkg.mod:fn"], "--entry"),
        (["--fault-tolerance", "replica", "--nodes", "2-3"], "flexible"),
        (["--fault-tolerance", "replica", "--min-replicas", "5"], "at most 3"),
        (["--fault-tolerance", "replica", "--data", "web=/data/web:0.7,code=/data/code:0.3"], "--data mixture"),
    ],
)
def test_combinations_that_do_not_work_are_refused(tmp_path: Path, extra, words) -> None:
    base = ["--nodes", "3", "--gpus-per-node", "2", "--shard", "2"]
    with pytest.raises((SpecError, TopologyError), match=words):
        spec([*base, *extra], tmp_path)


BLOCK_TORCHFT = """
import sys
sys.modules["torchft"] = None  # what the import system says of a package that is not installed
from hpc_hsdp.cli import main
sys.exit(main())
"""


def _without_torchft(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCHFT, *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_without_torchft_the_option_is_refused_in_one_line_before_anything_is_written(tmp_path: Path) -> None:
    script, run_dir = tmp_path / "job.sh", tmp_path / "run"
    common = ["--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--fault-tolerance", "replica"]
    for command in (
        ["render", *common, "--run-dir", str(run_dir), "-o", str(script)],
        ["submit", *common, "--run-dir", str(run_dir), "--cluster", "local"],
    ):
        done = _without_torchft(command, tmp_path)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "needs torchft" in lines[0] and "hpc-hsdp[ft]" in lines[0], done.stderr
    assert not script.exists() and not run_dir.exists()
    plain = _without_torchft(["render", "--nodes", "2", "--gpus-per-node", "2", "--shard", "2"], tmp_path)
    assert plain.returncode == 0, plain.stderr  # without the option torchft is not needed


def test_a_run_spec_with_replica_fault_tolerance_round_trips_through_run_arguments() -> None:
    training = TrainingSpec.of(fault_tolerance="replica", min_replicas=2, quorum_timeout=15.0)
    run = RunSpec(shard_size=2, run_dir="/r", training=training)
    assert "--fault-tolerance" in run.to_args()
    assert json.loads(json.dumps(run.to_args()))  # plain strings, as the rendered script passes them


def test_membership_changes_are_shown_with_time_and_cause_once_per_step(tmp_path: Path) -> None:
    from hpc_hsdp.report.data import load_run
    from hpc_hsdp.report.summary import summary_rows
    from hpc_hsdp.rundir.observation.replica_membership import membership_changes, read_membership

    events = [
        {"time": 100.0, "event": "lighthouse started", "address": "10.0.0.1:20001"},
        {"time": 100.1, "event": "replica group started", "replica_id": 1, "nodes": ["n2"], "cause": "job start"},
        {"time": 101.0, "step": 1, "replicas": 2, "of": 2, "replica_id": 0, "cause": "start"},
        {
            "time": 130.0,
            "event": "replica group lost",
            "replica_id": 1,
            "cause": "its job step ended with exit code -9",
        },
        {"time": 130.1, "event": "replica group started", "replica_id": 1, "nodes": ["n3"], "cause": "on a spare"},
        {"time": 131.0, "step": 9, "replicas": 1, "of": 2, "replica_id": 0, "cause": "a replica group was lost"},
        {"time": 131.0, "step": 9, "replicas": 1, "of": 2, "replica_id": 0, "cause": "a replica group was lost"},
        {"time": 140.0, "step": 14, "replicas": 2, "of": 2, "replica_id": 1, "cause": "healed from a live peer"},
    ]
    (tmp_path / "replicas.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    lines = membership_changes(read_membership(tmp_path))
    assert len(lines) == 5, lines
    assert "replica group 1 lost (its job step ended with exit code -9)" in lines[1]
    assert "replica group 1 started on n3 (on a spare)" in lines[2]
    assert lines[3].endswith("step 9: 1/2 replica groups (a replica group was lost)")
    records = [{"step": s, "loss": 1.0, "replicas": r, "replica_groups": 2} for s, r in ((1, 2), (9, 1), (14, 2))]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = summary_rows(load_run(tmp_path))["replica groups"]
    assert row.startswith("2 -> 1 -> 2 (5 changes; last: ") and "healed from a live peer" in row


def test_the_supervisor_reads_the_last_step_past_a_torn_line_and_a_long_record(tmp_path):
    """A group step that ended with 0 finished the training only if the run's last step was
    written; a torn last line (a writer killed mid-record) or a record longer than 4 KiB (many
    ranks' straggler times) was read as no step at all, and the group as not finished."""
    from hpc_hsdp.batch_shell.replica_supervisor import Group, Supervisor

    supervisor = Supervisor(
        command=[], groups=[Group(0, [0])], spares=[], tasks_per_node=1, min_replicas=1, address="127.0.0.1",
        lighthouse_port=1, base_port=1, node_names=["n1"], run_dir=str(tmp_path),
    )  # fmt: skip
    assert supervisor.last_step() == 0  # no metrics.jsonl yet
    metrics = tmp_path / "metrics.jsonl"
    long = {"step": 7, "straggler": {f"rank{r}": 0.123456789 for r in range(400)}}
    metrics.write_text(json.dumps({"step": 6}) + "\n" + json.dumps(long) + "\n")
    assert len(metrics.read_bytes()) > 4096 and supervisor.last_step() == 7
    with metrics.open("a") as out:
        out.write('{"step": 8, "lo')
    assert supervisor.last_step() == 7
