"""``--precision fp8`` refused on the submit host where the job's GPUs are known: the rule of
GPU names (pure, table-driven), what sinfo says about a node (pure), this machine's GPUs for
the local emulator (``nvidia-smi``, read without torch), ``submit`` and the API refusing in one
line with nothing written. The real dev cluster's partitions: tests/cluster/test_fp8_submit.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hpc_hsdp
from hpc_hsdp.cli import main
from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.float8_support import NodeGpus, can_train_fp8, fp8_local_refusal, fp8_slurm_refusal, gpu_capability
from hpc_hsdp.plan.slurm_facts import parse_gpu_gres, parse_sinfo_nodes, satisfies_constraint
from hpc_hsdp.scheduler.backends import backend
from hpc_hsdp.scheduler.emulator.allocation import DRIVER_MARKERS, local_gpus
from hpc_hsdp.submit_host.api import api_job_spec
from hpc_hsdp.submit_host.preflight import check_fp8_gpus

HAS_GPU_DRIVER = shutil.which("nvidia-smi") is not None or any(Path(m).exists() for m in DRIVER_MARKERS)

# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(
    ("name", "capability"),
    [
        # known new (>= 8.9): SLURM GRES types, node features, the driver's names
        ("h100", (9, 0)),
        ("H100", (9, 0)),
        ("h100_80gb", (9, 0)),
        ("nvidia_h100_80gb_hbm3", (9, 0)),
        ("NVIDIA H100 80GB HBM3", (9, 0)),
        ("h100nvl", (9, 0)),
        ("h200", (9, 0)),
        ("NVIDIA H200", (9, 0)),
        ("h20", (9, 0)),
        ("gh200", (9, 0)),
        ("NVIDIA GH200 480GB", (9, 0)),
        ("b100", (10, 0)),
        ("b200", (10, 0)),
        ("gb200", (10, 0)),
        ("l4", (8, 9)),
        ("NVIDIA L4", (8, 9)),
        ("l40", (8, 9)),
        ("l40s", (8, 9)),
        ("rtx4090", (8, 9)),
        ("rtx_4090", (8, 9)),
        ("NVIDIA GeForce RTX 4090", (8, 9)),
        ("rtx6000ada", (8, 9)),
        ("NVIDIA RTX 6000 Ada Generation", (8, 9)),
        # known older (< 8.9)
        ("a100", (8, 0)),
        ("A100-SXM4-80GB", (8, 0)),
        ("nvidia_a100_3g.40gb", (8, 0)),  # a MIG slice of an A100
        ("a30", (8, 0)),
        ("a40", (8, 6)),
        ("a10", (8, 6)),
        ("a10g", (8, 6)),
        ("a16", (8, 6)),
        ("v100", (7, 0)),
        ("Tesla V100-SXM2-16GB", (7, 0)),
        ("t4", (7, 5)),
        ("p100", (6, 0)),
        ("rtx3090", (8, 6)),
        ("a6000", (8, 6)),
        ("NVIDIA RTX A6000", (8, 6)),
        ("Quadro RTX 6000", (7, 5)),  # Turing: not the Ada "RTX 6000 Ada"
        # unknown: decided at task start
        ("gpu", None),
        ("tesla", None),
        ("1g.10gb", None),
        ("mi300x", None),
        ("h2000", None),  # a known name followed by digits is another name
        ("a1000", None),
        ("", None),
        (None, None),
    ],
)
def test_gpu_names_and_their_compute_capability(name, capability):
    assert gpu_capability(name) == capability
    assert can_train_fp8(gpu_capability(name)) == (None if capability is None else capability >= (8, 9))


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [
        ("gpu:h100:8(S:0-1)", (("h100", 8),)),
        ("gpu:h100:8(S:0-1),nic:1", (("h100", 8),)),
        ("gpu:a100:4(S:0),gpu:h100:4(S:1)", (("a100", 4), ("h100", 4))),
        ("gpu:8", ((None, 8),)),
        ("gpu", ((None, 1),)),
        ("gpu:h100", (("h100", 1),)),
        ("gpu:0", ((None, 0),)),
        ("(null)", ()),
        ("nic:2,bandwidth:100", ()),
        ("", ()),
    ],
)
def test_gpu_gres_as_sinfo_shows_it(gres, gpus):
    assert parse_gpu_gres(gres) == gpus


def test_sinfo_lines_name_partition_default_node_gres_and_features():
    rows = parse_sinfo_nodes("gpu*|g1|gpu:h100:8(S:0-1)|h100,ib\nold|o1|gpu:4|a100\ncpu|c1|(null)|(null)\nnoise\n")
    assert [(r.partition, r.default, r.node, r.gpus, r.features) for r in rows] == [
        ("gpu", True, "g1", (("h100", 8),), ("h100", "ib")),
        ("old", False, "o1", ((None, 4),), ("a100",)),
        ("cpu", False, "c1", (), ()),
    ]


@pytest.mark.parametrize(
    ("constraint", "features", "can"),
    [
        ("h100", ("h100", "ib"), True),
        ("h100&ib", ("h100", "ib"), True),
        ("h100&ib", ("h100",), False),
        ("h100,ib", ("h100",), False),
        ("a100|h100", ("h100",), True),
        ("a100|h100", ("v100",), False),
        ("[a100|h100]", ("v100",), None),  # matching OR: decided over the whole allocation
        ("h100*2", ("h100",), None),
    ],
)
def test_which_nodes_a_constraint_can_get(constraint, features, can):
    assert satisfies_constraint(constraint, features) is can


A100 = ((("a100", 8),), ())
H100 = ((("h100", 8),), ())
UNTYPED = (((None, 8),), ())
UNTYPED_A100 = (((None, 8),), ("a100", "ib"))
UNTYPED_H100 = (((None, 8),), ("h100",))
NO_GPU = ((), ())
ZERO_GPU = (((None, 0),), ())


@pytest.mark.parametrize(
    ("nodes", "refused"),
    [
        ([], None),  # no node known: the scheduler says what is wrong
        ([H100], None),
        ([UNTYPED], None),  # unknown: the tasks decide
        ([UNTYPED_H100], None),
        ([A100, H100], None),  # some node may train it
        ([A100, UNTYPED], None),
        ([A100], "has only a100 (8.0): use --precision bf16"),
        ([A100, A100], "has only a100 (8.0): use"),
        ([UNTYPED_A100], "has only a100 (8.0)"),  # the type from the node's features
        ([A100, NO_GPU], "has only a100 (8.0): use"),  # the nodes without GPUs take no GPU job
        ([((("v100", 4), ("a100", 4)), ())], "has only a100 (8.0), v100 (7.0)"),
        ([NO_GPU], "have no GPUs (no gpu GRES), so the job's tasks would train on CPU"),
        ([NO_GPU, ZERO_GPU], "have no GPUs"),
    ],
)
def test_which_partitions_refuse_fp8(nodes, refused):
    said = fp8_slurm_refusal([NodeGpus(f"n{i}", *node) for i, node in enumerate(nodes)], where="partition 'p'")
    if refused is None:
        assert said is None
    else:
        assert said is not None and refused in said and "\n" not in said, said
        assert said.startswith("--precision fp8 needs GPUs of compute capability >= 8.9") and "partition 'p'" in said
        assert said.endswith("; nothing submitted")


@pytest.mark.parametrize(
    ("nodes", "gpus_per_node", "refused"),
    [
        ([((("a100", 8),), ()), ((("h100", 4),), ())], 8, "has only a100 (8.0):"),  # no H100 node has 8 GPUs
        ([((("a100", 8),), ()), ((("h100", 4),), ())], 4, None),
        ([((("a100", 4), ("h100", 4)), ())], 8, None),  # one node, both kinds: 8 in all
        ([((("a100", 4),), ()), ((("h100", 4),), ())], 8, None),  # none has 8: sbatch decides, not fp8
        ([((("a100", 8),), ()), NO_GPU], 8, "has only a100 (8.0):"),
        ([((("a100", 4),), ()), NO_GPU], 8, "has only a100 (8.0) and nodes without GPUs:"),
    ],
)
def test_only_nodes_with_the_gpus_a_node_asks_for_count(nodes, gpus_per_node, refused):
    said = fp8_slurm_refusal(
        [NodeGpus(f"n{i}", *node) for i, node in enumerate(nodes)], where="partition 'p'", gpus_per_node=gpus_per_node
    )
    assert said is None if refused is None else refused in said, said


@pytest.mark.parametrize(
    ("gpus", "refused"),
    [
        (None, None),
        ([("NVIDIA H100 80GB HBM3", (9, 0))], None),
        ([("Some Future GPU", None)], None),
        ([("NVIDIA H100 80GB HBM3", None)], None),  # an old driver: the capability from the name
        ([("NVIDIA A100-SXM4-80GB", (8, 0)), ("NVIDIA L4", (8, 9))], None),
        ([("NVIDIA A100-SXM4-80GB", (8, 0))], "are NVIDIA A100-SXM4-80GB (8.0): use --precision bf16"),
        ([("Tesla V100-SXM2-16GB", None)], "are Tesla V100-SXM2-16GB (7.0)"),
        ([], "this machine has no GPU, so the local emulator's tasks train on CPU: use --precision bf16 or fp32"),
    ],
)
def test_which_machines_refuse_fp8_on_the_emulator(gpus, refused):
    said = fp8_local_refusal(gpus)
    assert said is None if refused is None else (refused in said and "\n" not in said), said


# ----------------------------------------------------------------------------- this machine's GPUs


def _fake_nvidia_smi(tmp_path: Path, body: str) -> str:
    """A PATH with an ``nvidia-smi`` that runs ``body`` (this machine has no GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{body}\n")
    smi.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_this_machines_gpus_from_nvidia_smi(tmp_path):
    path = _fake_nvidia_smi(
        tmp_path,
        'case "$1" in --query-gpu=name,compute_cap) printf "NVIDIA H100 80GB HBM3, 9.0\\nNVIDIA A100-SXM4-80GB, 8.0\\n";; '
        "*) exit 9;; esac",
    )
    assert local_gpus(which=lambda name: shutil.which(name, path=path)) == [
        ("NVIDIA H100 80GB HBM3", (9, 0)),
        ("NVIDIA A100-SXM4-80GB", (8, 0)),
    ]


def test_an_old_driver_says_names_only_and_a_failing_one_says_nothing(tmp_path):
    old = _fake_nvidia_smi(
        tmp_path,
        'case "$1" in --query-gpu=name) echo "Tesla V100-SXM2-16GB";; *) echo "Field compute_cap is not valid"; exit 2;; esac',
    )
    assert local_gpus(which=lambda name: shutil.which(name, path=old)) == [("Tesla V100-SXM2-16GB", None)]
    (tmp_path / "bin" / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed'; exit 9\n")
    assert local_gpus(which=lambda name: shutil.which(name, path=old)) is None


@pytest.mark.skipif(HAS_GPU_DRIVER, reason="this machine has a GPU driver")
def test_no_nvidia_smi_and_no_driver_is_no_gpu():
    assert local_gpus(which=lambda name: None) == []


# ----------------------------------------------------------------------------- submit and the API


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.count("\n") == 1, err
    return err


@pytest.mark.skipif(HAS_GPU_DRIVER, reason="this machine has a GPU driver: the emulator's tasks would get it")
@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_submit_on_the_emulator_without_a_gpu_refuses_fp8_writing_nothing(tmp_path, capsys, device):
    run_dir = tmp_path / "run"
    argv = ["submit", "--cluster", "local", "--shard", "1", "--precision", "fp8", "--device", device]
    err = _refused([*argv, "--run-dir", str(run_dir)], capsys)
    assert "this machine has no GPU, so the local emulator's tasks train on CPU" in err, err
    assert not run_dir.exists()
    with pytest.raises(SpecError, match="this machine has no GPU"):
        hpc_hsdp.submit(cluster="local", shard=1, precision="fp8", run_dir=str(tmp_path / "api"))
    assert not (tmp_path / "api").exists()


def test_submit_on_the_emulator_with_an_old_gpu_names_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, 'echo "NVIDIA A100-SXM4-80GB, 8.0"'))
    run_dir = tmp_path / "run"
    err = _refused(
        ["submit", "--cluster", "local", "--shard", "1", "--precision", "fp8", "--run-dir", str(run_dir)], capsys
    )
    assert "this machine's GPUs, where the local emulator's tasks run, are NVIDIA A100-SXM4-80GB (8.0)" in err, err
    assert not run_dir.exists()


def test_a_new_gpu_or_another_precision_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, 'echo "NVIDIA H100 80GB HBM3, 9.0"'))
    fp8 = api_job_spec({"shard": 1, "precision": "fp8"}, environ={}, cwd=tmp_path, default_venv=None)
    check_fp8_gpus(fp8, backend("local"))  # the task checks its own GPU at its start
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path / "old", 'echo "NVIDIA A100-SXM4-80GB, 8.0"'))
    with pytest.raises(SpecError, match="A100"):
        check_fp8_gpus(fp8, backend("local"))
    bf16 = api_job_spec({"shard": 1, "precision": "bf16"}, environ={}, cwd=tmp_path, default_venv=None)
    check_fp8_gpus(bf16, backend("local"))  # nothing asked
    assert not list(tmp_path.glob("**/job.json"))


def test_the_refusal_imports_no_torch(tmp_path):
    script = (
        "import sys\nfrom hpc_hsdp.cli import main\n"
        f"try:\n    main(['submit', '--cluster', 'local', '--shard', '1', '--precision', 'fp8', '--run-dir', {str(tmp_path / 'r')!r}])\n"
        "except SystemExit as exc:\n    assert exc.code == 2, exc.code\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "assert not heavy, heavy[:5]\nprint('no torch')\n"
    )
    env = {**os.environ, "PATH": _fake_nvidia_smi(tmp_path, 'echo "NVIDIA A100-SXM4-80GB, 8.0"')}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and "no torch" in out.stdout, out.stdout + out.stderr
