"""The switches wired into a job: ``--topology``, ``--switches``, ``--segment`` (one declaration each,
on every command, config file and the Python API), the script's switches block, ``layout --field
node_switches`` (SLURM's topology asked, the emulator not), ``plan --node-switches``, the replica
groups' placement and their refusals. Pure or mocked SLURM; no processes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpc_hsdp.batch_shell import replica_supervisor as replicas
from hpc_hsdp.cli import main
from hpc_hsdp.cli.examples import spec_from_argv
from hpc_hsdp.job.config import build_job_spec
from hpc_hsdp.job.options import RUN_ARGUMENTS, option, options_of
from hpc_hsdp.job.spec import RunSpec
from hpc_hsdp.plan.replica_layout import groups_on_switches
from hpc_hsdp.plan.slurm_env import task_environments
from hpc_hsdp.plan.switches import NODE_SWITCHES_ENV, parse_node_switches
from hpc_hsdp.submit_host.render import render_sbatch, switches_command

DATA = Path(__file__).resolve().parents[1] / "data"
SCONTROL = (DATA / "slurm-topology" / "scontrol-show-topology.txt").read_text()
"""The dev cluster's ``scontrol show topology`` when it was captured: n1, n3 under leaf1; n2 under leaf2."""


def hpc(capsys, *argv: str) -> tuple[int, str, str]:
    """``hpc-hsdp ARGV`` in this process: (exit code, stdout, stderr)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------------------ the options


def test_each_option_is_declared_once_and_reaches_every_face(tmp_path):
    for key in ("topology", "switches", "segment"):
        declared = option(key)
        for command in ("render", "submit"):
            assert declared in options_of(command), (key, command)
    assert option("topology") in options_of("run") and option("topology") in options_of("plan")
    assert "topology" in RUN_ARGUMENTS
    spec = build_job_spec(
        {"shard": 16, "nodes": 4, "run_dir": "/runs/x", "topology": "strict", "switches": "2@1:00", "segment": 2},
        cwd=tmp_path,
    )
    assert (spec.run.topology, spec.scheduler.switches, spec.scheduler.segment) == ("strict", "2@1:00", 2)
    assert RunSpec(shard_size=4, run_dir="/runs/x", topology="strict").to_args()[-2:] == ["--topology", "strict"]
    assert "--topology" not in RunSpec(shard_size=4, run_dir="/runs/x").to_args()  # the default is not written


def test_config_file_and_python_api_take_them(capsys, tmp_path):
    config = tmp_path / "job.toml"
    config.write_text('shard = 16\nnodes = 4\ntopology = "off"\nswitches = "1"\nsegment = 4\n')
    script = tmp_path / "job.sbatch"
    code, _, err = hpc(capsys, "render", "--config", str(config), "--run-dir", str(tmp_path / "r"), "-o", str(script))
    assert code == 0, err
    text = script.read_text()
    assert "#SBATCH --switches=1\n" in text and "#SBATCH --segment=4\n" in text
    assert "--topology off" in text and "layout --field node_switches" not in text
    from hpc_hsdp.submit_host.api import api_job_spec

    spec = api_job_spec(
        {
            "nodes": 4,
            "shard": 16,
            "run_dir": str(tmp_path / "api"),
            "topology": "strict",
            "switches": "1",
            "segment": 2,
        },
        environ={},
        cwd=tmp_path,
        default_venv=None,
    )
    assert (spec.run.topology, spec.scheduler.switches, spec.scheduler.segment) == ("strict", "1", 2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--switches", "0"], "--switches '0' is not COUNT[@MAX_WAIT]"),
        (["--switches", "1@99:99:99"], "--switches '1@99:99:99' is not COUNT[@MAX_WAIT]"),
        (["--switches", "one"], "--switches 'one' is not COUNT[@MAX_WAIT]"),
        (["--segment", "0"], "--segment 0 is not a node count"),
        (["--segment", "70000"], "--segment 70000 is not a node count"),
        (["--topology", "tree"], "'tree' is not one of 'auto', 'off', 'strict'"),
    ],
)
def test_bad_values_are_one_line_exit_2_nothing_written(capsys, tmp_path, argv, message):
    script = tmp_path / "job.sbatch"
    code, out, err = hpc(
        capsys, "render", "--nodes", "2", "--shard", "8", "--run-dir", str(tmp_path), "-o", str(script), *argv
    )
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not script.exists()


# ------------------------------------------------------------------------------ the script


def _spec(*argv: str):
    return spec_from_argv(("--venv", "none", "--run-dir", "/runs/s", *argv))


def test_the_switches_block_is_set_by_the_script_itself():
    text = render_sbatch(_spec("--nodes", "4", "--shard", "16"))
    assert "unset MASTER_ADDR MASTER_PORT HPC_HSDP_NODE_SWITCHES\n" in text  # the submitting shell's: gone
    unset_at = text.index("unset MASTER_ADDR")
    set_at = text.index('HPC_HSDP_NODE_SWITCHES="$(python -m hpc_hsdp layout --field node_switches)"')
    assert unset_at < set_at < text.index("export HPC_HSDP_NODE_SWITCHES") < text.index("\nsrun ")


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (("--nodes", "1", "--shard", "8"), None),  # one node: nothing to order
        (("--nodes", "4", "--shard", "16", "--topology", "off"), None),
        (("--nodes", "4", "--shard", "16"), "python -m hpc_hsdp layout --field node_switches"),
        (
            ("--nodes", "4", "--shard", "16", "--topology", "strict"),
            "python -m hpc_hsdp layout --field node_switches --topology strict --shard 16 --tasks-per-node 8",
        ),
        (
            ("--nodes", "2", "--ntasks", "12", "--shard", "4", "--topology", "strict"),
            "python -m hpc_hsdp layout --field node_switches --topology strict --shard 4 --tasks-per-node 8,4",
        ),
        (
            ("--nodes", "2-4", "--shard", "8", "--global-batch-size", "64", "--topology", "strict"),
            "python -m hpc_hsdp layout --field node_switches --topology strict --shard 8 --tasks-per-node 8",
        ),
        (
            ("--nodes", "4", "--shard", "4", "--tp", "4", "--topology", "strict"),
            "python -m hpc_hsdp layout --field node_switches --topology strict --shard 4 --tasks-per-node 8 --tp 4",
        ),
    ],
)
def test_switches_command(argv, command):
    assert switches_command(_spec(*argv)) == command


def test_an_env_value_is_kept_deliberately_and_pass_env_is_not_unset():
    given = render_sbatch(_spec("--nodes", "2", "--shard", "16", "--env", "HPC_HSDP_NODE_SWITCHES=s.l1:n[1-2]"))
    assert given.index("export HPC_HSDP_NODE_SWITCHES='s.l1:n[1-2]'") < given.index("layout --field node_switches")
    passed = render_sbatch(_spec("--nodes", "2", "--shard", "16", "--pass-env", "HPC_HSDP_NODE_SWITCHES"))
    assert "unset MASTER_ADDR MASTER_PORT\n" in passed


def test_torchrun_node_rank_follows_the_same_topology():
    text = render_sbatch(_spec("--nodes", "4", "--shard", "16", "--launcher", "torchrun", "--topology", "strict"))
    assert "layout --shard 16 --nproc-per-node 8 --topology strict --field node_rank" in text
    assert "-m hpc_hsdp run --shard 16 --run-dir /runs/s --topology strict'" in text


# ------------------------------------------------------------------------------ layout --field node_switches


def _batch_env(nodelist: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "HPC_HSDP"))}
    return {**env, "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": nodelist, **more}


@pytest.fixture
def scontrol(monkeypatch):
    """``scontrol show topology`` answered with the captured text; records how often it was asked."""
    asked = []

    def show_topology(**kwargs):
        asked.append(kwargs)
        return SCONTROL

    monkeypatch.setattr("hpc_hsdp.cli.layout_cmd.show_topology", show_topology)
    return asked


def _set_env(monkeypatch, env):
    for name in [k for k in os.environ if k.startswith(("SLURM", "HPC_HSDP"))]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_node_switches_from_scontrol_on_slurm(capsys, monkeypatch, scontrol):
    _set_env(monkeypatch, _batch_env("n[1-3]"))
    code, out, err = hpc(capsys, "layout", "--field", "node_switches")
    assert (code, err) == (0, "")
    assert out.strip() == "spine.leaf1:n[1,3];spine.leaf2:n2"
    assert parse_node_switches(out.strip()) == {
        "n1": ("spine", "leaf1"),
        "n2": ("spine", "leaf2"),
        "n3": ("spine", "leaf1"),
    }
    assert len(scontrol) == 1


def test_the_emulator_asks_no_scontrol(capsys, monkeypatch, scontrol):
    """The emulator's nodes (n1, n2, ...) are this machine; a SLURM here (the dev cluster's n1..n3)
    must not lend them its switches."""
    _set_env(monkeypatch, _batch_env("n[1-3]", HPC_HSDP_EMULATOR="1"))
    code, out, _ = hpc(capsys, "layout", "--field", "node_switches")
    assert (code, out) == (0, "\n")
    assert scontrol == []


def test_a_given_value_wins_and_is_normalised(capsys, monkeypatch, scontrol):
    _set_env(monkeypatch, _batch_env("n[1-4]", HPC_HSDP_EMULATOR="1", **{NODE_SWITCHES_ENV: "s.a:n1,n3 ; s.b:n[2,4]"}))
    code, out, _ = hpc(capsys, "layout", "--field", "node_switches")
    assert (code, out.strip()) == (0, "s.a:n[1,3];s.b:n[2,4]")
    assert scontrol == []


def test_strict_refuses_in_one_line_before_training(capsys, monkeypatch, scontrol):
    # 2 nodes, a shard group over both, n1 under leaf1 and n2 under leaf2: it must cross
    _set_env(monkeypatch, _batch_env("n[1-2]"))
    argv = ("layout", "--field", "node_switches", "--topology", "strict", "--shard", "4", "--tasks-per-node", "2")
    code, out, err = hpc(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--topology strict: shard group 0 (ranks 0-3 on n1,n2 under leaf1,leaf2)" in err
    # n1 and n3 share leaf1: the same check passes and prints the value
    _set_env(monkeypatch, _batch_env("n[1,3]"))
    code, out, err = hpc(capsys, *argv)
    assert (code, out.strip()) == (0, "spine.leaf1:n[1,3]")


def test_strict_counts_a_shard_group_as_s_x_t_ranks(capsys, monkeypatch, scontrol):
    # 2 tasks a node, shard 1: each group on one node; with --tp 2 and shard 2 a copy spans n1 and n2
    _set_env(monkeypatch, _batch_env("n[1-2]"))
    argv = ("layout", "--field", "node_switches", "--topology", "strict", "--tasks-per-node", "2")
    code, _, err = hpc(capsys, *argv, "--shard", "2", "--tp", "2")
    assert code == 2 and "--topology strict: shard group 0 (ranks 0-3 on n1,n2 under leaf1,leaf2)" in err
    code, out, _ = hpc(capsys, *argv, "--shard", "1", "--tp", "2")
    assert code == 0 and "leaf1" in out and "leaf2" in out


def test_strict_without_any_switch_refuses_groups_spanning_nodes(capsys, monkeypatch):
    monkeypatch.setattr("hpc_hsdp.cli.layout_cmd.show_topology", lambda **kw: "")
    _set_env(monkeypatch, _batch_env("n[1-2]"))
    code, _, err = hpc(
        capsys, "layout", "--field", "node_switches", "--topology", "strict", "--shard", "4", "--tasks-per-node", "2"
    )
    assert code == 2 and "SLURM gave no leaf switch for n1, n2" in err
    code, out, _ = hpc(capsys, "layout", "--field", "node_switches")  # auto: the node-list order
    assert (code, out) == (0, "\n")


def test_a_task_layout_uses_the_exported_switches_and_topology(capsys, monkeypatch):
    task = task_environments(tasks_per_node=(2, 2, 2), node_names=("n1", "n2", "n3"), job_id="5")[2]
    _set_env(monkeypatch, {**task, NODE_SWITCHES_ENV: "s.a:n[1,3];s.b:n2"})
    code, out, _ = hpc(capsys, "layout", "--shard", "2")
    derived = json.loads(out)
    assert code == 0
    assert derived["nodes"] == ["n1", "n3", "n2"] and derived["node"] == "n2"
    assert (derived["rank"], derived["node_switch"], derived["node_switches"]) == (4, "b", ["a", "a", "b"])
    code, out, _ = hpc(capsys, "layout", "--shard", "2", "--topology", "off")
    assert json.loads(out)["nodes"] == ["n1", "n2", "n3"] and "node_switch" not in json.loads(out)
    code, out, _ = hpc(capsys, "layout", "--shard", "2", "--field", "node_switch")
    assert out.strip() == "b"


# ------------------------------------------------------------------------------ plan --node-switches


def test_plan_shows_each_nodes_switch_and_the_groups(capsys):
    switches = "spine.leaf1:n[1,3];spine.leaf2:n[2,4]"
    code, out, _ = hpc(
        capsys, "plan", "--nodes", "4", "--gpus-per-node", "2", "--shard", "4", "--node-switches", switches
    )
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.startswith("n") and not line.startswith("node")]
    assert [(r[0], r[1], r[3]) for r in rows[::2]] == [
        ("n1", "leaf1", "0"),
        ("n3", "leaf1", "2"),
        ("n2", "leaf2", "4"),
        ("n4", "leaf2", "6"),
    ]
    assert "shard groups spanning nodes: each under one leaf switch: copy 0 on n1,n3 (under leaf1)" in out
    assert "replicate groups cross leaf switches" in out
    code, out, _ = hpc(
        capsys, "plan", "--nodes", "4", "--gpus-per-node", "2", "--shard", "4", "--node-switches", switches, "--json"
    )
    data = json.loads(out)
    assert data["node_names"] == ["n1", "n3", "n2", "n4"] and data["node_switches"] == [
        "leaf1",
        "leaf1",
        "leaf2",
        "leaf2",
    ]
    assert data["shard_groups_cross_switches"] is False
    code, out, _ = hpc(
        capsys,
        "plan",
        "--nodes",
        "4",
        "--gpus-per-node",
        "2",
        "--shard",
        "4",
        "--node-switches",
        switches,
        "--topology",
        "off",
    )
    assert "switch" not in out.splitlines()[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--node-switches", "spine.leaf1:n[1,3,4];spine.leaf2:n2", "--topology", "strict"),
            "must cross leaf switches",
        ),
        (("--topology", "strict"), "SLURM gave no leaf switch for n1, n2, n3, n4"),
        (("--node-switches", "spine.leaf1:gpu[1-4]"), "--node-switches names none of the job's nodes (n[1-4])"),
        (("--node-switches", "leaf 1:n1"), "is not 'SWITCH.SWITCH:NODELIST'"),
    ],
)
def test_plan_refusals(capsys, argv, message):
    code, out, err = hpc(capsys, "plan", "--nodes", "4", "--gpus-per-node", "2", "--shard", "4", *argv)
    assert code == 2 and message in err and err.count("\n") == 1, err


# ------------------------------------------------------------------------------ replica groups


@pytest.mark.parametrize(
    ("names", "switches", "groups", "per", "spare", "expected_groups", "expected_spares"),
    [
        # no switches: the node-list order, as replica_shape numbers them
        ("n[1-6]", "", 2, 2, 2, ((0, 1), (2, 3)), ((4, 5),)),
        # interleaved leaves: each group under one leaf, --nodelist needed
        ("n[1-4]", "s.a:n[1,3];s.b:n[2,4]", 2, 2, 0, ((0, 2), (1, 3)), ()),
        # 3 under a, 3 under b, groups of 2: the crossing pair becomes the spare
        ("n[1-6]", "s.a:n[1-3];s.b:n[4-6]", 2, 2, 2, ((0, 1), (3, 4)), ((2, 5),)),
        # one node per group: every group under one switch; switch order kept
        ("n[1-3]", "s.a:n[1,3];s.b:n2", 3, 1, 0, ((0,), (2,), (1,)), ()),
    ],
)
def test_replica_groups_on_switches(names, switches, groups, per, spare, expected_groups, expected_spares):
    from hpc_hsdp.plan.topology import expand_nodelist

    placed, spares = groups_on_switches(
        expand_nodelist(names), parse_node_switches(switches), groups=groups, nodes_per_group=per, spare_nodes=spare
    )
    assert (placed, spares) == (expected_groups, expected_spares)


def test_a_replica_groups_step_is_placed_by_relative_or_nodelist():
    supervisor = replicas.Supervisor(
        command=[],
        groups=[],
        spares=[],
        tasks_per_node=8,
        min_replicas=1,
        address="a",
        lighthouse_port=1,
        base_port=1,
        node_names=["n1", "n2", "n3", "n4"],
    )
    assert supervisor.where(replicas.Group(replica_id=0, nodes=[2, 3])) == "--relative=2"
    assert supervisor.where(replicas.Group(replica_id=0, nodes=[1, 3])) == "--nodelist=n[2,4]"


def test_the_scripts_plan_line_and_run_line_carry_the_tp_size():
    text = render_sbatch(_spec("--nodes", "2", "--shard", "2", "--tp", "4"))
    assert (
        "# see every rank and group before submitting: hpc-hsdp plan --nodes 2 --gpus-per-node 8 --shard 2 --tp 4\n"
        in text
    )
    assert "-m hpc_hsdp run --shard 2 --tp 4 --run-dir /runs/s" in text


def test_a_container_job_hands_the_hosts_topology_into_the_image(capsys, monkeypatch, scontrol):
    """Inside the image there is no scontrol: the batch shell on the host asks it and passes the text."""
    command = switches_command(
        _spec("--nodes", "2", "--shard", "16", "--container-image", "img", "--container-mounts", "/runs:/runs")
    )
    assert command.startswith("srun --nodes=1 --ntasks=1")
    assert command.endswith(' --scontrol-topology "$(scontrol show topology 2>/dev/null)"')
    _set_env(monkeypatch, _batch_env("n[1,3]"))
    argv = ("layout", "--field", "node_switches", "--topology", "strict", "--shard", "2", "--tasks-per-node", "1")
    code, out, _ = hpc(capsys, *argv, "--scontrol-topology", SCONTROL)
    assert (code, out.strip()) == (0, "spine.leaf1:n[1,3]")
    assert scontrol == []  # the text given, scontrol never asked
    code, _, err = hpc(capsys, *argv, "--scontrol-topology", "")  # the host's SLURM has no topology plugin
    assert code == 2 and "SLURM gave no leaf switch" in err
