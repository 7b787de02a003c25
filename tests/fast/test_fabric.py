"""The fabric check's pure parts: the rounds of node pairs, the verdict against the peers' median,
NCCL's transport from its own debug lines, and what the batch shell does with a verdict."""

from __future__ import annotations

import pytest
from cli_helpers import hpc

from hpc_hsdp.batch_shell.fabric_check_verdict import decide
from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.fabric_check_rounds import check_threshold, nccl_transport, pair_rounds, transport_warning, verdict


@pytest.mark.parametrize("nodes", [2, 3, 4, 5, 8, 9, 16, 255, 256])
def test_every_node_measures_two_links_in_at_most_three_rounds_of_disjoint_pairs(nodes):
    rounds = pair_rounds(nodes)
    assert len(rounds) <= 3
    links = [pair for pairs in rounds for pair in pairs]
    assert len(set(links)) == len(links)
    for pairs in rounds:
        members = [n for pair in pairs for n in pair]
        assert len(members) == len(set(members))  # a node in one pair per round: the pairs run at once
    for node in range(nodes):
        assert sum(node in pair for pair in links) == (1 if nodes == 2 else 2)


def test_one_node_has_no_link():
    assert pair_rounds(1) == []


def _nodes(**matmul):
    return {name: {"matmul_tflops": value, "memory_gib": 80.0} for name, value in matmul.items()}


@pytest.mark.parametrize(
    ("nodes", "links", "threshold", "bad_nodes", "bad_links"),
    [
        # all alike
        (_nodes(a=100, b=98, c=101, d=99), {}, 0.7, [], []),
        # one GPU throttled: its node below 0.7 x the median
        (_nodes(a=100, b=40, c=101, d=99), {}, 0.7, ["b"], []),
        # at 0.3 the same node passes
        (_nodes(a=100, b=40, c=101, d=99), {}, 0.3, [], []),
        # one node's two links slow: the node is blamed
        (
            _nodes(a=100, b=100, c=100, d=100),
            {"a-b": {"busbw_gbps": 20}, "c-d": {"busbw_gbps": 21}, "b-c": {"busbw_gbps": 5}, "d-a": {"busbw_gbps": 4}},
            0.7,
            [],
            ["b-c", "d-a"],
        ),
        (
            _nodes(a=100, b=100, c=100, d=100),
            {"a-b": {"busbw_gbps": 20}, "c-d": {"busbw_gbps": 4}, "b-c": {"busbw_gbps": 21}, "d-a": {"busbw_gbps": 5}},
            0.7,
            ["d"],
            [],
        ),
        # one link slow alone: named as a link, neither node left out
        (
            _nodes(a=100, b=100, c=100, d=100),
            {"a-b": {"busbw_gbps": 20}, "c-d": {"busbw_gbps": 20}, "b-c": {"busbw_gbps": 3}, "d-a": {"busbw_gbps": 21}},
            0.7,
            [],
            ["b-c"],
        ),
        # latency is shown, not judged
        (
            _nodes(a=100, b=100),
            {"a-b": {"busbw_gbps": 20, "latency_us": 900}},
            0.7,
            [],
            [],
        ),
    ],
)
def test_verdict(nodes, links, threshold, bad_nodes, bad_links):
    found = verdict(nodes, links, threshold=threshold)
    assert list(found.bad_nodes) == bad_nodes
    assert list(found.bad_links) == bad_links
    for finding in found.findings:
        assert finding.value < threshold * finding.median
        assert f"{finding.value / finding.median:.0%} of its peers' median" in finding.line()


NCCL_SOCKET_LOG = """\
gpu-a01:12345:12345 [0] NCCL INFO Bootstrap : Using eth0:10.1.2.3<0>
gpu-a01:12345:12345 [0] NCCL INFO NET/Plugin: No plugin found (libnccl-net.so), using internal implementation
gpu-a01:12345:12345 [0] NCCL INFO NET/IB : No device found.
gpu-a01:12345:12345 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.2.3<0>
gpu-a01:12345:12345 [0] NCCL INFO Using network Socket
gpu-a01:12345:12401 [0] NCCL INFO Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0
"""
NCCL_IB_LOG = """\
gpu-b07:2211:2211 [3] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.9.0.7<0>
gpu-b07:2211:2211 [3] NCCL INFO Using network IB
gpu-b07:2211:2290 [3] NCCL INFO Channel 00/0 : 3[3] -> 11[3] [send] via NET/IB/0/GDRDMA
"""


def test_a_saved_nccl_log_that_says_sockets_gives_the_warning():
    assert nccl_transport(NCCL_SOCKET_LOG.splitlines()) in ("Socket",)
    warning = transport_warning(nccl_transport(NCCL_SOCKET_LOG.splitlines()))
    assert warning and "NCCL_IB_HCA" in warning and "NCCL_SOCKET_IFNAME" in warning


def test_infiniband_gives_none():
    assert nccl_transport(NCCL_IB_LOG.splitlines()) == "IB"
    assert transport_warning("IB") is None and transport_warning(None) is None
    assert nccl_transport(["nothing about the network"]) is None


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.2, True])
def test_a_threshold_out_of_range_is_refused(value):
    with pytest.raises(SpecError, match="--check-threshold"):
        check_threshold(value)


N = ["n1", "n2", "n3", "n4"]


@pytest.mark.parametrize(
    ("bad", "nodes", "requeued_before", "action", "train", "spares"),
    [
        ([], 3, False, "train", ["n1", "n2", "n3"], []),
        (["n2"], 3, False, "train", ["n1", "n3", "n4"], ["n4"]),
        (["n2"], 4, False, "requeue", [], []),
        (["n2"], 4, True, "train", ["n1", "n2", "n3", "n4"], []),  # requeued once already: no second requeue
        (["n9"], 3, False, "train", ["n1", "n2", "n3"], []),  # not ours
    ],
)
def test_the_batch_shell_decides(bad, nodes, requeued_before, action, train, spares):
    decision = decide({"bad_nodes": bad}, allocated=N, nodes=nodes, requeued_before=requeued_before)
    assert decision["action"] == action and decision["nodes"] == train and decision["spares_used"] == spares


def test_a_hostile_check_record_is_read_without_a_traceback(tmp_path):
    """check.json is the run directory's, so anyone who can write there can write it: wrong types,
    huge nesting, a symlink or a FIFO in its place give no table, never a traceback."""
    import os

    from hpc_hsdp.rundir.observation.fabric_check_record import check_lines, check_summary, read_check, read_decisions

    (tmp_path / "check.json").write_text(
        '{"nodes": {"n1": "fast", "<b>": {"matmul_tflops": "x"}}, "links": [], "findings": [{"value": "1"}, 3],'
        ' "bad_nodes": "n1", "seconds": "soon"}'
    )
    assert read_check(tmp_path) is None  # fields of other types than the check writes: no record
    (tmp_path / "check.json").write_text(
        '{"nodes": {"n1": "fast", "<b>": {"matmul_tflops": "x"}}, "links": {"n1-<b>": 7}, "findings": [{"value": "1"}, 3],'
        ' "bad_nodes": ["n1"], "seconds": 1}'
    )
    record = read_check(tmp_path)
    lines = check_lines(record)
    assert any("<b>" in line for line in lines) and "node(s)" in check_summary(record, {"action": 7})
    (tmp_path / "check.json").write_text("[" * 100000)
    assert read_check(tmp_path) is None
    (tmp_path / "check.json").unlink()
    (tmp_path / "check.json").symlink_to("/etc/passwd")
    assert read_check(tmp_path) is None
    os.mkfifo(tmp_path / "checks.jsonl")
    assert read_decisions(tmp_path) == []


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--check-threshold", "1.5"], "--check-threshold"),
        (["--check-threshold", "0"], "--check-threshold"),
        (["--check-threshold", "nan"], "--check-threshold"),
        (["--spare-nodes", "1", "--fault-tolerance", "replica"], "--check does not work with --fault-tolerance"),
        (["--nodes", "1-2"], "--check does not work with --nodes 1-2"),
    ],
)
def test_bad_check_values_are_one_line_and_exit_2(args, needle, tmp_path):
    argv = ["render", "--nodes", "2", "--shard", "4", "--check", "--run-dir", str(tmp_path / "r"), *args]
    out = hpc(*argv)
    assert out.returncode == 2, out.stdout + out.stderr
    assert needle in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_on_gpus_the_check_step_asks_nccl_which_network_it_uses():
    from hpc_hsdp.cli.job_options import job_spec_from_options
    from hpc_hsdp.cli.render_cmd import render
    from hpc_hsdp.submit_host.render import render_sbatch

    def script(*extra):
        argv = ["--nodes", "2", "--shard", "4", "--check", "--run-dir", "/r", "--venv", "none", *extra]
        params = render.make_context("render", argv).params
        return render_sbatch(job_spec_from_options(params, environ={}, cwd="/", default_venv=None))

    assert "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE=/r/logs/nccl-check.%h.%p srun" in script()
    assert "NCCL_DEBUG=INFO" not in script("--device", "cpu")


def test_check_of_a_sweep_is_refused_before_anything_is_submitted(tmp_path):
    run_dir = tmp_path / "r"
    argv = ["check", "--cluster", "local", "--nodes", "2", "--sweep", "lr=1e-3,3e-4", "--run-dir", str(run_dir)]
    out = hpc(*argv)
    assert out.returncode == 2 and "No such option '--sweep'" in out.stderr and out.stderr.count("\n") == 1
    (tmp_path / "job.toml").write_text('sweep = ["lr=1e-3,3e-4"]\n')
    argv = [
        "check",
        "--cluster",
        "local",
        "--nodes",
        "2",
        "--config",
        str(tmp_path / "job.toml"),
        "--run-dir",
        str(run_dir),
    ]
    out = hpc(*argv)
    assert out.returncode == 2 and "the config file sweeps" in out.stderr and out.stderr.count("\n") == 1, out.stderr
    assert not run_dir.exists()
