"""`hpc-hsdp plan --recommend`: the fitting shard size with the least inter-node traffic."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from cli_helpers import hpc

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.estimates import recommend
from hpc_hsdp.plan.shapes import parameter_counts
from hpc_hsdp.plan.topology import TopologyPlan, plan_for

GiB = 2**30


def topo(nodes: int, gpus: int) -> TopologyPlan:
    return plan_for(nodes=nodes, gpus_per_node=gpus, shard_size=1)


# (topology, params, gpu memory, precision, optimizer) -> recommended shard size (None: nothing fits)
CASES = [
    # 2 x 8: a node-sized shard group keeps the all-gathers inside the node; only 1/8 of the grads cross
    ((2, 8), 7 * 10**9, 80 * GiB, "fp32", "adamw", 8),
    ((2, 8), 7 * 10**9, 80 * GiB, "bf16", "adamw", 8),
    # fits without sharding on one node: DDP moves least (all nodes tie at 0 inter-node bytes)
    ((1, 8), 10**8, 80 * GiB, "fp32", "adamw", 1),
    # one node, too big for S=1 and S=2: the smallest fitting shard moves least inside the node
    ((1, 8), 7 * 10**9, 40 * GiB, "fp32", "adamw", 4),
    # 4 x 8, 70B fp32 AdamW (1.12 TB of states): only shard groups spanning nodes fit
    ((4, 8), 70 * 10**9, 80 * GiB, "fp32", "adamw", 32),
    ((4, 8), 40 * 10**9, 80 * GiB, "fp32", "adamw", 16),
    ((4, 8), 30 * 10**9, 80 * GiB, "fp32", "adamw", 8),
    # nothing fits
    ((2, 8), 10**12, 80 * GiB, "fp32", "adamw", None),
    # sgd keeps no state: S=2 fits where AdamW needs S=4
    ((1, 8), 7 * 10**9, 40 * GiB, "fp32", "sgd", 2),
]


@pytest.mark.parametrize(("nodes_gpus", "params", "memory", "precision", "optimizer", "expected"), CASES)
def test_recommendation_table(nodes_gpus, params, memory, precision, optimizer, expected):
    rec = recommend(topo(*nodes_gpus), model_params=params, gpu_memory=memory, precision=precision, optimizer=optimizer)
    assert (rec.chosen.shard_size if rec.chosen else None) == expected
    fitting = [c for c in rec.candidates if c.fits]
    assert all(c.needed_bytes <= rec.budget_bytes for c in fitting)
    assert all(c.needed_bytes > rec.budget_bytes for c in rec.candidates if not c.fits)
    if rec.chosen is not None:
        assert rec.chosen.estimate.inter_node_wire_bytes == min(c.estimate.inter_node_wire_bytes for c in fitting)
        assert rec.reasons[0].startswith(f"--shard {expected}:")
    else:
        assert rec.reasons[0].startswith("no shard size fits")


# (topology, params, gpu memory) -> reshard_after_forward (False: keep the gathered parameters;
# None: nothing fits or shard size 1, where nothing is gathered)
RESHARD_CASES = [
    # 7B fp32 on 2 x 8, S=8: 13 GiB of state + 26 GiB gathered fit in 64 GiB
    ((2, 8), 7 * 10**9, 80 * GiB, False),
    # the same on 40 GiB GPUs: 39 GiB do not fit in 32 GiB
    ((2, 8), 7 * 10**9, 40 * GiB, True),
    # 30B on 4 x 8, S=8: 56 GiB of state leave no room for 112 GiB gathered
    ((4, 8), 30 * 10**9, 80 * GiB, True),
    ((1, 8), 10**8, 80 * GiB, None),
    ((2, 8), 10**12, 80 * GiB, None),
]


@pytest.mark.parametrize(("nodes_gpus", "params", "memory", "expected"), RESHARD_CASES)
def test_keeps_the_gathered_parameters_only_when_they_fit(nodes_gpus, params, memory, expected):
    rec = recommend(topo(*nodes_gpus), model_params=params, gpu_memory=memory)
    assert rec.reshard_after_forward is expected
    if expected is not None:
        assert rec.gathered_bytes == 4 * params
        fits = rec.chosen.needed_bytes + rec.gathered_bytes <= rec.budget_bytes
        assert fits is (not expected)
        assert rec.reasons[-1].startswith("keep resharding" if expected else "--reshard-after-forward never")
    assert rec.to_dict()["reshard_after_forward"] is expected


def test_candidates_are_every_valid_shard_size_with_numbers():
    rec = recommend(topo(2, 8), model_params=10**9, gpu_memory=80 * GiB)
    assert [c.shard_size for c in rec.candidates] == [1, 2, 4, 8, 16]
    by_size = {c.shard_size: c.to_dict() for c in rec.candidates}
    assert by_size[16]["intra_node_wire_bytes"] == 0  # the shard group spans both nodes
    assert by_size[1]["intra_node_wire_bytes"] == 0  # DDP: only the all-reduce over 16, across nodes
    # 2(R-1)/R * 4P/S over the replicate group: S=8, R=2 -> 4P/8
    assert by_size[8]["inter_node_wire_bytes"] == 4 * 10**9 // 8


def test_builtin_counts_pad_per_shard_size():
    rec = recommend(
        topo(2, 8),
        gpu_memory=GiB,
        params_for_shard=lambda s: (lambda c: (c.params, c.root_params))(
            parameter_counts(vocab_size=64, seq_len=12, width=32, layers=2, shard_size=s)
        ),
    )
    params = {c.shard_size: c.estimate.model_params for c in rec.candidates}
    assert params[1] == params[4] == 29952 and params[8] == params[16] == 29952 + 4 * 32


def test_unknown_precision_is_a_spec_error():
    with pytest.raises(SpecError, match="--precision 'fp16'"):
        recommend(topo(1, 8), model_params=10, gpu_memory=GiB, precision="fp16")


# ----------------------------------------------------------------------------- the command


def test_recommend_text_and_json():
    text = hpc("plan", "--nodes", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB")
    assert text.returncode == 0, text.stderr
    assert "recommended: --shard 8 --reshard-after-forward never" in text.stdout
    rows = [r for r in (line.split() for line in text.stdout.splitlines()) if len(r) >= 7 and r[3] in ("yes", "no")]
    assert [r[0] for r in rows] == ["1", "2", "4", "8", "16"]
    assert "<-" in " ".join(next(r for r in rows if r[0] == "8"))
    data = json.loads(
        hpc("plan", "--nodes", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB", "--json").stdout
    )
    assert data["recommendation"]["recommended_shard_size"] == 8
    assert data["plan"]["shard_size"] == 8 and data["estimate"]["model_params"] == 7 * 10**9
    assert [c["fits"] for c in data["recommendation"]["candidates"]] == [False, True, True, True, True]


def test_recommend_builtin_model_and_no_torch():
    code = (
        "import sys; from hpc_hsdp.cli import main\n"
        "try:\n main(['plan','--nodes','2','--recommend','--model-params','builtin:layers=2,width=32',"
        "'--gpu-memory','1GiB','--json'])\nexcept SystemExit as e:\n assert e.code in (0, None), e.code\n"
        "assert 'torch' not in sys.modules, 'plan imported torch'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["recommendation"]["recommended_shard_size"] == 8


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nodes", "2", "--recommend", "--gpu-memory", "80GiB"], "--recommend needs --model-params"),
        (["--nodes", "2", "--recommend", "--model-params", "7B"], "--recommend needs --gpu-memory"),
        (["--nodes", "2", "--recommend", "--model-params", "seven", "--gpu-memory", "80GiB"], "is not a count"),
        (["--nodes", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "lots"], "is not a size"),
        (
            ["--nodes", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB", "--dtype", "fp16"],
            "--dtype",
        ),
        (
            ["--nodes", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB", "--precision", "fp16"],
            "--precision",
        ),
        (
            ["--nodes", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB", "--optimizer", "lion"],
            "--optimizer",
        ),
        (["--nodes", "2"], "Missing option '--shard'"),
        (["--nodes", "2", "--shard", "4", "--root-params", "1M"], "--root-params needs --model-params"),
        (["--nodes", "2", "--shard", "4", "--model-params", "1M", "--root-params", "2M"], "more than --model-params"),
        (["--nodes", "2", "--recommend", "--model-params", "builtin:depth=3", "--gpu-memory", "1GiB"], "builtin"),
        (
            ["--nodes", "2", "--recommend", "--model-params", "builtin:width=30,heads=4", "--gpu-memory", "1GiB"],
            "--width",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(args, needle):
    out = hpc("plan", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert needle in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("params", "memory", "kept"),
    [
        # 7B at --precision auto (bf16 on a GPU): 14 GB of fp32 state at shard 8, 14 GB gathered in bf16
        ("7B", "80GiB", True),  # fits in 64 GiB
        ("7B", "24GiB", False),  # does not fit in 19.2 GiB
    ],
)
def test_plan_estimates_what_the_default_auto_does_with_that_memory(params, memory, kept):
    """With --gpu-memory, plan counts the backward re-gather only when --reshard-after-forward
    auto (the run's default) would reshard on a GPU of that memory."""
    args = ("plan", "--nodes", "2", "--shard", "8", "--model-params", params, "--gpu-memory", memory)
    data = json.loads(hpc(*args, "--json").stdout)
    p = 7 * 10**9
    gathered = next(t["tensor_bytes"] for t in data["estimate"]["per_step_per_gpu"] if t["kind"] == "all_gather")
    assert data["estimate"]["reshard_after_forward"] is not kept
    assert gathered == (2 * p if kept else 2 * 2 * p)
    assert ("--reshard-after-forward auto keeps the gathered parameters" in hpc(*args).stdout) is kept
    assert (
        "reshard_after_forward"
        in json.loads(hpc("plan", "--nodes", "2", "--shard", "8", "--model-params", params, "--json").stdout)[
            "estimate"
        ]
    )
