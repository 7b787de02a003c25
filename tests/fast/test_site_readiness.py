"""Issue 15's pure and single-process parts: what a first run on real GPU nodes depends on.

The dev-cluster halves are in test_site.py; the GPU halves in benchmarks/gpu_hsdp_step.py.
"""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from hpc_hsdp.cli import cli
from hpc_hsdp.cli.examples import spec_from_argv
from hpc_hsdp.errors import SlurmEnvError
from hpc_hsdp.plan import address
from hpc_hsdp.plan.address import hostfile_lines, node_address, reachable_address
from hpc_hsdp.scheduler.emulator.allocation import EMULATOR_VARIABLE
from hpc_hsdp.submit_host.render import render_sbatch

# ----------------------------------------------------------------------------- torch floor


def _reshard_values_given_to_fully_shard() -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from hpc_hsdp.task.parallelism import hsdp

    seen: list[tuple[str, object]] = []
    real = hsdp.fully_shard

    def recording(module, **kwargs):
        seen.append((type(module).__name__, kwargs["reshard_after_forward"]))
        return real(module, **kwargs)

    hsdp.fully_shard = recording
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        by_option = {}
        for option in (None, True, False):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            seen.clear()
            hsdp.wrap_hsdp(model, mesh, block=nn.Linear, reshard_after_forward=option)
            model(torch.ones(2, 4)).sum().backward()
            by_option[option] = [(name, value, type(value).__name__) for name, value in seen]
        return by_option
    finally:
        dist.destroy_process_group()


def test_wrap_hsdp_gives_fully_shard_a_bool_for_every_unit():
    """torch 2.6/2.7 (the declared floor is 2.6) raise ValueError for reshard_after_forward=None;
    2.8+ read None on the root as False. wrap_hsdp must pass bools: blocks True, root False."""
    from dist_helpers import in_child

    by_option = in_child(_reshard_values_given_to_fully_shard)
    for option, seen in by_option.items():
        assert all(kind == "bool" for _, _, kind in seen), (option, seen)
        assert seen[-1][:2] == ("Sequential", False)
        assert {value for _, value, _ in seen[:-1]} == {option is not False}


# ----------------------------------------------------------------------------- the rendered request


def _render(*argv: str) -> str:
    return render_sbatch(spec_from_argv(["--venv", "none", "--run-dir", "/runs/x", *argv]))


def test_default_request_is_whole_nodes_with_each_ranks_share_of_cpus():
    text = _render("--nodes", "2", "--shard", "4")
    assert "#SBATCH --exclusive\n" in text and "#SBATCH --mem=0\n" in text
    assert "HPC_HSDP_CPUS_PER_TASK=$(( ${SLURM_CPUS_ON_NODE:-1} / 8 ))" in text
    assert '--cpus-per-task="$HPC_HSDP_CPUS_PER_TASK"' in text
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in text  # torch's own default stays


def test_explicit_cpus_and_shared_nodes_are_kept():
    text = _render("--nodes", "2", "--shard", "4", "--cpus-per-task", "12", "--no-exclusive", "--mem", "200G")
    assert "#SBATCH --cpus-per-task=12\n" in text and "#SBATCH --mem=200G\n" in text
    assert "--exclusive" not in text and "HPC_HSDP_CPUS_PER_TASK" not in text
    assert "export OMP_NUM_THREADS=12\n" in text


def test_uneven_ntasks_caps_tasks_per_node_and_places_them_exactly():
    text = _render("--nodes", "2", "--ntasks", "12", "--shard", "4")
    assert "#SBATCH --ntasks-per-node=8\n" in text and "#SBATCH --ntasks=" not in text
    assert "layout --hostfile 8,4 --distribution block" in text and "--distribution=arbitrary" in text


def test_stale_rendezvous_variables_are_unset_unless_passed_on_purpose():
    assert "\nunset MASTER_ADDR MASTER_PORT HPC_HSDP_NODE_SWITCHES\n" in _render("--shard", "8")
    assert "\nunset MASTER_PORT HPC_HSDP_NODE_SWITCHES\n" in _render("--shard", "8", "--pass-env", "MASTER_ADDR")
    text = _render("--shard", "8", "--env", "MASTER_ADDR=10.0.0.1")
    assert text.index("unset MASTER_ADDR") < text.index("export MASTER_ADDR=10.0.0.1")


# ----------------------------------------------------------------------------- the batch shell's address

TWO_NODES = {"SLURM_JOB_NODELIST": "site[1-2]", "SLURMD_NODENAME": "site1"}


def _address(env, *, interface=None, host=(), route=None, one_machine=False):
    return node_address(
        env,
        one_machine=one_machine,
        by_interface=lambda name: interface,
        by_host_name=lambda: list(host),
        by_route=lambda: route,
    )


@pytest.mark.parametrize(
    ("env", "kwargs", "expected"),
    [
        ({"SLURM_JOB_NODELIST": "n1"}, {"route": "10.1.1.1"}, "127.0.0.1"),  # one node: loopback is enough
        (TWO_NODES, {"one_machine": True}, "127.0.0.1"),  # the emulator: every node is this machine
        ({**TWO_NODES, "NCCL_SOCKET_IFNAME": "^docker,lo"}, {"interface": "10.9.9.9", "route": "10.1.1.1"}, "10.1.1.1"),
        ({**TWO_NODES, "NCCL_SOCKET_IFNAME": "ib0"}, {"interface": "10.9.9.9", "route": "10.1.1.1"}, "10.9.9.9"),
        (TWO_NODES, {"host": ["127.0.1.1", "10.2.2.2"], "route": "10.1.1.1"}, "10.2.2.2"),  # Debian's 127.0.1.1 skipped
        (TWO_NODES, {"host": ["127.0.0.1"], "route": "10.1.1.1"}, "10.1.1.1"),
    ],
)
def test_node_address(env, kwargs, expected):
    assert _address(env, **kwargs) == expected


def _emulated(emulated: bool) -> dict[str, str]:
    """A batch shell's or a task's environment on n1 of a two-node job: the emulator's, or SLURM's."""
    return {**TWO_NODES, "SLURM_JOB_ID": "77", **({EMULATOR_VARIABLE: "1"} if emulated else {})}


@pytest.mark.parametrize("emulated", [True, False], ids=["emulator", "separate-machines"])
def test_the_emulators_nodes_are_this_machine_by_its_backends_word(monkeypatch, emulated):
    """The rendezvous address the batch shell asks for and a replica group's heal address: this
    machine's loopback on the emulator, whose backend says its nodes are no machines of their own;
    the reachable address (here a stand-in) on SLURM. Nothing outside the backends reads the
    emulator's mark in the environment."""
    from hpc_hsdp.task.training.replica_coordinator import heal_address  # noqa: PLC0415 - torch, only here

    for name in [k for k in os.environ if k.startswith(("SLURM", "HPC_HSDP", "NCCL_SOCKET", "GLOO_SOCKET"))]:
        monkeypatch.delenv(name)
    for name, value in _emulated(emulated).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(address, "interface_address", lambda name: None)
    monkeypatch.setattr(address, "host_name_addresses", lambda: ["10.2.2.2"])
    monkeypatch.setattr(address, "reachable_address", lambda env, **kw: "10.3.3.3")
    rendezvous = CliRunner().invoke(cli, ["layout", "--field", "rendezvous"])
    assert rendezvous.exit_code == 0, rendezvous.output
    expected = "127.0.0.1" if emulated else "10.3.3.3"
    assert rendezvous.output.split()[0] == expected
    assert heal_address(_emulated(emulated)) == expected


@pytest.mark.parametrize(
    ("env", "kwargs", "message"),
    [
        (TWO_NODES, {"host": ["127.0.0.1"], "route": None}, "no address the other nodes can reach"),
        ({**TWO_NODES, "GLOO_SOCKET_IFNAME": "eth9"}, {"interface": None}, "GLOO_SOCKET_IFNAME names interface 'eth9'"),
        (
            {**TWO_NODES, "SLURMD_NODENAME": "site2"},
            {"route": "10.1.1.1"},
            "rank 0's node's, site1, but this runs on site2",
        ),
    ],
)
def test_node_address_refusals_name_the_fix(env, kwargs, message):
    with pytest.raises(SlurmEnvError, match=message):
        _address(env, **kwargs)


def test_reachable_address_is_the_rule_on_any_node_of_the_job():
    """A replica group's first node (not the job's first) asks the same rule for its own address;
    node_address refuses there, as the batch shell's address is rank 0's node's."""
    on_site2 = {**TWO_NODES, "SLURMD_NODENAME": "site2", "NCCL_SOCKET_IFNAME": "=ib0"}
    asked = []
    address = reachable_address(
        on_site2,
        by_interface=lambda name: asked.append(name) or "10.9.9.2",
        by_host_name=lambda: [],
        by_route=lambda: "10.1.1.2",
    )
    assert (address, asked) == ("10.9.9.2", ["=ib0"])
    assert (
        reachable_address({"SLURMD_NODENAME": "site2"}, by_host_name=lambda: ["127.0.1.1"], by_route=lambda: "10.1.1.2")
        == "10.1.1.2"
    )
    with pytest.raises(SlurmEnvError, match="no IPv4 address on node site2"):
        reachable_address(on_site2, by_interface=lambda name: None)
    with pytest.raises(SlurmEnvError, match="this runs on site2"):
        node_address(on_site2, by_interface=lambda name: "10.9.9.2")


@pytest.mark.parametrize(
    ("counts", "distribution", "expected"),
    [
        ((3, 1), "block", ["a1", "a1", "a1", "a2"]),
        ((3, 1), "cyclic", ["a1", "a2", "a1", "a1"]),
        ((2, 2, 1), "cyclic", ["a1", "a2", "a3", "a1", "a2"]),
    ],
)
def test_hostfile_lines(counts, distribution, expected):
    env = {"SLURM_JOB_NODELIST": "a[1-3]" if len(counts) == 3 else "a[1-2]"}
    assert hostfile_lines(env, counts, distribution) == expected


def test_hostfile_needs_one_count_per_node():
    with pytest.raises(SlurmEnvError, match="submit with --nodes 2"):
        hostfile_lines({"SLURM_JOB_NODELIST": "a[1-3]"}, (8, 4), "block")


# ----------------------------------------------------------------------------- plan: the request and KillWait


def _plan(*args: str):
    from click.testing import CliRunner

    from hpc_hsdp.cli import cli

    return CliRunner().invoke(cli, ["plan", *args])


def test_plan_shows_each_ranks_share_of_the_node():
    out = _plan("--nodes", "2", "--shard", "4")
    assert out.exit_code == 0, out.output
    assert (
        "request: whole nodes (--exclusive, --mem=0), 8 task(s) and GPU(s) per node: each rank gets 1/8" in out.output
    )


def test_plan_warns_when_a_save_cannot_fit_kill_wait():
    """70B bf16 + AdamW on 2 x 8, shard 8: 782 GiB (fp32 parameters and AdamW's two states) at 1 GB/s
    per node is 420 s, not 30."""
    big = _plan("--nodes", "2", "--shard", "8", "--model-params", "70B", "--precision", "bf16")
    assert big.exit_code == 0, big.output
    assert "warning: a checkpoint of 782.31 GiB takes about 420 s" in big.output and "KillWait (30 s)" in big.output
    small = _plan("--nodes", "2", "--shard", "8", "--model-params", "1B", "--precision", "bf16", "--kill-wait", "30")
    assert "a save on SIGTERM (about 6 s at 1 GB/s per node) fits KillWait (30 s)" in small.output
    assert "KillWait" not in small.output.split("fits KillWait")[1]
    fast = _plan(
        "--nodes",
        "2",
        "--shard",
        "8",
        "--model-params",
        "70B",
        "--precision",
        "bf16",
        "--write-bandwidth",
        "20GiB/s",
        "--json",
    )
    import json

    assert json.loads(fast.output)["save_on_sigterm"] == {
        "checkpoint_bytes": 840000000000,
        "seconds": 19.6,
        "kill_wait_s": 30,
        "rate_bytes_per_s": 20 * 2**30,
        "fits": True,
    }


# ----------------------------------------------------------------------------- containers


def test_container_job_runs_layout_in_the_image_and_requeues_from_the_host():
    text = _render(
        "--nodes",
        "2",
        "--shard",
        "4",
        "--container-image",
        "nvcr.io#nvidia/pytorch:24.05-py3",
        "--container-mounts",
        "/runs:/runs",
    )
    rendezvous = next(line for line in text.splitlines() if line.startswith("rendezvous="))
    assert (
        rendezvous.startswith('rendezvous="$(srun --nodes=1 --ntasks=1') and "--container-name=hpc-hsdp" in rendezvous
    )
    assert "export HPC_HSDP_REQUEUE_FILE=/runs/x/logs/requeue." in text
    assert text.index("|| status=$?") < text.index('scontrol requeue "$SLURM_JOB_ID"')


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--container-image", "img"], "--run-dir '/runs/x' is not mounted into the container at the same path"),
        (["--container-image", "img", "--container-mounts", "/runs:/mnt"], "not mounted into the container"),
    ],
)
def test_container_without_the_run_dir_mounted_is_refused(argv, message):
    from hpc_hsdp.errors import SpecError

    with pytest.raises(SpecError, match=message):
        _render("--shard", "8", *argv)


def test_requeue_without_scontrol_asks_the_batch_shell(tmp_path):
    from hpc_hsdp.scheduler.backends.slurm_task import requeue_job

    request = tmp_path / "requeue.77"
    ok, said = requeue_job("77", env={"PATH": str(tmp_path), "HPC_HSDP_REQUEUE_FILE": str(request)})
    assert ok and request.read_text() == "77\n" and "asked the batch shell" in said


def test_submit_with_a_container_is_refused_before_submitting(tmp_path):
    from hpc_hsdp.errors import SpecError
    from hpc_hsdp.submit_host.submission import submit_spec

    spec = spec_from_argv(
        [
            "--shard",
            "8",
            "--venv",
            "none",
            "--run-dir",
            str(tmp_path),
            "--container-image",
            "img",
            "--container-mounts",
            f"{tmp_path}:{tmp_path}",
        ]
    )
    with pytest.raises(SpecError, match="submit --container-image 'img': submit runs this machine's interpreter"):
        submit_spec(spec, cluster="local")
    assert not (tmp_path / "job.json").exists()
