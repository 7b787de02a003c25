"""Memory and traffic per GPU with tensor parallelism, and `plan --recommend` choosing T and S
(pure arithmetic, table-driven; the formulas are those of hpc_hsdp/plan/estimates.py's docstring)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_hsdp.cli import cli
from hpc_hsdp.plan.estimates import (
    ActivationShape,
    estimate,
    llama_like_shape,
    recommend,
    recommend_tp,
    save_time,
    smallest_fitting_shard,
)
from hpc_hsdp.plan.topology import plan_for

GiB = 2**30
P = 7 * 10**9


def _by_axis(est):
    return {(t.kind, t.axis): t for t in est.traffic}


# (nodes, gpus, shard, tp) -> replicas; fp32 AdamW: 4 + 4 + 8 bytes per parameter over S x T
@pytest.mark.parametrize(
    ("nodes", "gpus", "shard", "tp"),
    [(2, 8, 4, 1), (2, 8, 2, 4), (2, 8, 4, 2), (4, 8, 16, 2), (4, 8, 4, 8), (1, 8, 1, 8), (2, 4, 1, 2)],
)
def test_states_and_fsdp_traffic_are_over_shard_times_tp(nodes, gpus, shard, tp):
    plan = plan_for(nodes=nodes, gpus_per_node=gpus, shard_size=shard, tp_size=tp)
    est = estimate(plan, model_params=P, root_params=10**8)
    copy = shard * tp
    assert (est.param_bytes, est.grad_bytes, est.optimizer_bytes) == (4 * P // copy, 4 * P // copy, 8 * P // copy)
    assert est.tp_size == tp and est.activation_bytes is None and est.tp_wire_bytes == 0
    traffic = _by_axis(est)
    if shard > 1:
        gathered = 4 * (2 * P - 10**8) // tp
        assert traffic["all_gather", "shard"].tensor_bytes == gathered
        assert traffic["all_gather", "shard"].wire_bytes == gathered * (shard - 1) // shard
        assert traffic["reduce_scatter", "shard"].tensor_bytes == 4 * P // tp
    else:
        assert ("all_gather", "shard") not in traffic
    replicas = nodes * gpus // copy
    if replicas > 1:
        assert traffic["all_reduce", "replicate"].tensor_bytes == 4 * P // copy
        assert traffic["all_reduce", "replicate"].wire_bytes == 2 * (4 * P // copy) * (replicas - 1) // replicas


# layers, width, seq, batch, checkpointing, element bytes, tp -> activations per GPU, TP tensor bytes
# (all-gather, reduce-scatter)
ONE_70B = 2 * 8192 * 8192
SHAPES = [
    # 70B-like, bf16, no checkpointing: 80 x 17 x 2 x 8192 x 8192 over T; (4*80+2) tensors per kind
    (80, 8192, 8192, 1, False, 2, 8, 80 * 17 * ONE_70B // 8, (322 * ONE_70B, 322 * ONE_70B)),
    (80, 8192, 8192, 1, False, 2, 1, 80 * 17 * ONE_70B, None),
    # checkpointing: each block's input plus one block's set; the recomputed forward gathers 2 x 80 and
    # reduce-scatters 80 more (torch's checkpoint stops before the feed-forward's reduce-scatter)
    (80, 8192, 8192, 1, True, 2, 8, (80 + 17) * ONE_70B // 8, (482 * ONE_70B, 402 * ONE_70B)),
    # the tiny built-in model, fp32, T = 2
    (2, 64, 32, 4, False, 4, 2, 2 * 17 * 4 * 4 * 32 * 64 // 2, (10 * 4 * 4 * 32 * 64,) * 2),
]


@pytest.mark.parametrize(("layers", "width", "seq", "batch", "ac", "b", "tp", "act", "tp_tensor"), SHAPES)
def test_activations_and_tp_bytes(layers, width, seq, batch, ac, b, tp, act, tp_tensor):
    shape = ActivationShape(layers=layers, width=width, seq_len=seq, batch_size=batch, checkpointing=ac)
    assert shape.bytes_per_gpu(element_bytes=b, tp_size=tp) == act
    traffic = shape.tp_traffic(element_bytes=b, tp_size=tp, grad_accum=1, inter_node=False)
    assert [t.tensor_bytes for t in traffic] == (list(tp_tensor) if tp > 1 else [])
    assert [t.kind for t in traffic] == (["all_gather", "reduce_scatter"] if tp > 1 else [])
    assert all(t.wire_bytes == t.tensor_bytes * (tp - 1) // tp and t.axis == "tp" for t in traffic)
    twice = shape.tp_traffic(element_bytes=b, tp_size=tp, grad_accum=2, inter_node=False)
    assert [t.tensor_bytes for t in twice] == [2 * t.tensor_bytes for t in traffic]


# a transformers model's own plan (no sequence parallelism): layers, width, seq, batch, vocabulary, tied,
# checkpointing, element bytes, tp -> activations per GPU, all-reduce tensor bytes, logits all-gathered
ONE_TINY = 4 * 16 * 64 * 4  # the tiny Llama of the processes test: 4 rows x 16 tokens x width 64, fp32
TRANSFORMERS = [
    # (5 + 12/T) per block; 7 all-reduces per block and 2 at the ends; the logits 4 x 16 x 96 gathered
    (2, 64, 16, 4, 96, False, False, 4, 2, 2 * 11 * ONE_TINY, 16 * ONE_TINY, 4 * 16 * 96 * 4),
    # tied: the embedding and the head whole, nothing at the ends
    (2, 64, 16, 4, 96, True, False, 4, 2, 2 * 11 * ONE_TINY, 14 * ONE_TINY, None),
    # checkpointing: each block's input whole, one block's set; the forward again adds 1 per block
    (2, 64, 16, 4, 96, False, True, 4, 2, (2 + 11) * ONE_TINY, 18 * ONE_TINY, 4 * 16 * 96 * 4),
    # 70B-like at T = 8: 5 + 12/8 = 6.5 per block, against 17/8 with sequence parallelism
    (80, 8192, 8192, 1, 128256, False, False, 2, 8, 80 * 13 * ONE_70B // 2, 562 * ONE_70B, 2 * 8192 * 128256),
]


@pytest.mark.parametrize(("layers", "width", "seq", "batch", "vocab", "tied", "ac", "b", "tp", "act", "reduced", "logits"),
                         TRANSFORMERS)  # fmt: skip
def test_a_transformers_plan_is_not_sequence_parallel(layers, width, seq, batch, vocab, tied, ac, b, tp, act, reduced,
                                                      logits):  # fmt: skip
    shape = ActivationShape(layers=layers, width=width, seq_len=seq, batch_size=batch, checkpointing=ac,
                            sequence_parallel=False, vocab_size=vocab, tied=tied)  # fmt: skip
    assert shape.bytes_per_gpu(element_bytes=b, tp_size=tp) == act
    assert shape.bytes_per_gpu(element_bytes=b, tp_size=1) == layers * 17 * b * batch * seq * width or ac
    traffic = {t.kind: t for t in shape.tp_traffic(element_bytes=b, tp_size=tp, grad_accum=1, inter_node=False)}
    assert traffic["all_reduce"].tensor_bytes == reduced
    assert traffic["all_reduce"].wire_bytes == 2 * reduced * (tp - 1) // tp
    assert (traffic["all_gather"].tensor_bytes if "all_gather" in traffic else None) == logits


def test_estimate_with_activations_counts_them_and_the_tp_bytes():
    shape = ActivationShape(layers=80, width=8192, seq_len=8192, batch_size=1)
    plan = plan_for(nodes=4, gpus_per_node=8, shard_size=4, tp_size=8)
    est = estimate(plan, model_params=70 * 10**9, precision="bf16", activations=shape)
    assert est.activation_bytes == shape.bytes_per_gpu(element_bytes=2, tp_size=8)
    assert est.needed_bytes == est.total_bytes + est.working_bytes + est.activation_bytes
    tp = [t for t in est.traffic if t.axis == "tp"]
    assert len(tp) == 2 and not any(t.inter_node for t in tp)
    assert est.tp_wire_bytes == 2 * (322 * 2 * 8192 * 8192) * 7 // 8
    assert est.to_dict()["tp_wire_bytes"] == est.tp_wire_bytes
    assert "tp_size" not in estimate(plan_for(nodes=1, gpus_per_node=8, shard_size=8), model_params=P).to_dict()


@pytest.mark.parametrize(
    ("params", "layers", "width"),
    [(70 * 10**9, 80, 8192), (8 * 10**9, 32, 4096), (7 * 10**9, 32, 4096), (10**9, 16, 2048), (10**12, 126, 16384)],
)
def test_a_bare_count_takes_the_nearest_llama_shape(params, layers, width):
    shape = llama_like_shape(params, seq_len=4096, batch_size=2)
    assert (shape.layers, shape.width, shape.seq_len, shape.batch_size) == (layers, width, 4096, 2)


# (nodes, gpus, params, precision, memory, seq, batch, checkpointing) -> (T, S) recommended (None: nothing fits)
RECOMMEND = [
    # 70B bf16 on 4 x 8 H100s, 8192 tokens: only TP 8 splits the 170 GiB of activations enough
    ((4, 8), 70 * 10**9, "bf16", 80 * GiB, 8192, 1, False, (8, 4)),
    # activation checkpointing: 12 GiB of activations, no TP needed (S=32: 33 GiB of fp32 states)
    ((4, 8), 70 * 10**9, "bf16", 80 * GiB, 8192, 1, True, (1, 32)),
    # ... unless the micro-batch grows: 4 x 8192 tokens need TP 2
    ((4, 8), 70 * 10**9, "bf16", 80 * GiB, 8192, 4, True, (2, 16)),
    # short sequences: the states decide alone, no TP
    ((4, 8), 70 * 10**9, "fp32", 80 * GiB, 128, 1, False, (1, 32)),
    # 7B on one node, 4096 tokens x 4: TP 2 (34 GiB of activations); S = 2 fits too, but S = 4 leaves no
    # replicate all-reduce (fp32 gradients) to add to the node's traffic
    ((1, 8), 7 * 10**9, "bf16", 80 * GiB, 4096, 4, False, (2, 4)),
    # nothing fits
    ((1, 8), 70 * 10**9, "fp32", 80 * GiB, 8192, 1, False, None),
]


@pytest.mark.parametrize(("nodes_gpus", "params", "precision", "memory", "seq", "batch", "ac", "expected"), RECOMMEND)
def test_recommend_chooses_the_smallest_tp_that_fits(nodes_gpus, params, precision, memory, seq, batch, ac, expected):
    plan = plan_for(nodes=nodes_gpus[0], gpus_per_node=nodes_gpus[1], shard_size=1)
    shape = llama_like_shape(params, seq_len=seq, batch_size=batch, checkpointing=ac)
    rec = recommend_tp(
        plan, gpu_memory=memory, precision=precision, params_for_shard=lambda _s: (params, 0), activations=shape
    )
    got = (rec.chosen_tp, rec.chosen.chosen.shard_size) if rec.chosen else None
    assert got == expected
    assert [t for t, _ in rec.by_tp] == [1, 2, 4, 8][: len(rec.by_tp)]
    for t, at_t in rec.by_tp:
        assert all(c.tp_size == t and c.fits == (c.needed_bytes <= at_t.budget_bytes) for c in at_t.candidates)
        if expected is not None and t < expected[0]:
            assert at_t.chosen is None  # a smaller T fits nowhere
    if expected is not None:
        at_t = dict(rec.by_tp)[expected[0]]
        fitting = [c for c in at_t.candidates if c.fits]
        assert rec.chosen.chosen.estimate.inter_node_wire_bytes == min(
            c.estimate.inter_node_wire_bytes for c in fitting
        )
        assert rec.to_dict()["recommended_tp_size"] == expected[0]


@pytest.mark.parametrize(
    ("precision", "batch", "ac", "ways"),
    [
        (
            "fp32",
            4,
            False,
            "more GPUs, --precision bf16, --activation-checkpointing, a shorter sequence or a smaller micro-batch",
        ),
        ("bf16", 4, False, "more GPUs, --activation-checkpointing, a shorter sequence or a smaller micro-batch"),
        ("bf16", 1, True, "more GPUs or a shorter sequence"),
        # plan's default: bf16 on a GPU (it was a KeyError: 'auto')
        ("auto", 4, False, "more GPUs, --activation-checkpointing, a shorter sequence or a smaller micro-batch"),
    ],
)
def test_when_no_tp_fits_it_names_only_what_is_not_done_already(precision, batch, ac, ways):
    plan = plan_for(nodes=1, gpus_per_node=8, shard_size=1)
    shape = llama_like_shape(405 * 10**9, seq_len=131072, batch_size=batch, checkpointing=ac)
    rec = recommend_tp(
        plan,
        gpu_memory=80 * 2**30,
        precision=precision,
        params_for_shard=lambda _s: (405 * 10**9, 0),
        activations=shape,
    )
    assert rec.chosen is None
    assert rec.reasons[0].endswith(f"at every shard size; use {ways}")


def test_recommend_and_smallest_shard_at_a_given_tp():
    plan = plan_for(nodes=2, gpus_per_node=8, shard_size=1, tp_size=4)
    rec = recommend(plan, model_params=P, gpu_memory=40 * GiB)
    assert [c.shard_size for c in rec.candidates] == [1, 2, 4]  # S x 4 ranks: 4, 8, 16
    assert all(c.tp_size == 4 for c in rec.candidates)
    # 16 bytes x 7e9 = 104 GiB of states over 4 x S: S = 1 needs 26 GiB, within 80% of 40 GiB; on 24 GiB S = 2
    fit = smallest_fitting_shard(plan, model_params=P, gpu_memory=40 * GiB)
    block = P // 32  # the 7B Llama model's 32 blocks: two gathered, one's gradients in flight, over T
    assert fit.shard_size == 1 and fit.needed_bytes == 16 * P // 4 + (4 * 2 * block + 8 * block) // 4
    assert smallest_fitting_shard(plan, model_params=P, gpu_memory=24 * GiB).shard_size == 2


def test_a_checkpoint_holds_one_copy_of_s_times_t_shards():
    plan = plan_for(nodes=2, gpus_per_node=8, shard_size=2, tp_size=4)
    est = estimate(plan, model_params=P)
    assert save_time(plan, est).checkpoint_bytes == (4 + 8) * P


def _plan(*args):
    return CliRunner().invoke(cli, ["plan", *args])


def test_cli_recommend_with_seq_len_chooses_tp():
    out = _plan("--nodes", "4", "--recommend", "--model-params", "70B", "--gpu-memory", "80GiB", "--precision", "bf16",
                "--seq-len", "8192", "--batch-size", "1")  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "recommended: --tp 8 --shard 4" in out.output
    rows = [line.split() for line in out.output.splitlines() if line.rstrip().endswith("<- recommended")]
    assert len(rows) == 1 and rows[0][:2] == ["8", "4"]


def test_cli_estimates_at_tp_name_activations_and_tp_bytes():
    out = _plan("--nodes", "4", "--shard", "4", "--tp", "8", "--model-params", "70B", "--precision", "bf16",
                "--seq-len", "8192", "--batch-size", "1", "--gpu-memory", "80GiB")  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "(over shard x tp = 32)" in out.output
    assert "activations 21.25 GiB over tp 8 (sequence parallel)" in out.output
    assert "all_gather     over tp" in out.output and "smallest shard size that fits 80.00 GiB at tp 8: 4" in out.output
    builtin = _plan("--nodes", "1", "--shard", "2", "--tp", "2", "--model-params", "builtin:layers=2,width=64")
    assert "the built-in model's 2 blocks, width 64" in builtin.output  # its own seq_len, no --seq-len needed
    bare = _plan("--nodes", "1", "--shard", "2", "--tp", "2", "--model-params", "7B")
    assert "give --seq-len" in bare.output


def test_cli_recommend_with_seq_len_and_tp_is_refused():
    out = _plan("--nodes", "1", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB", "--seq-len", "1024",
                "--tp", "2")  # fmt: skip
    assert out.exit_code != 0 and "chooses --tp itself" in str(out.exception or out.output)


def test_cli_hf_model_gives_its_blocks_and_width(tmp_path):
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "intermediate_size": 512,
        "vocab_size": 1024,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = _plan("--nodes", "1", "--gpus-per-node", "4", "--shard", "2", "--tp", "2", "--model", f"hf:{tmp_path}",
                "--seq-len", "128", "--batch-size", "2", "--json")  # fmt: skip
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert (data["activations"]["layers"], data["activations"]["width"]) == (3, 256)
    # --precision auto: bf16 activations, as a GPU run keeps them; the working set counts the config's 3 blocks;
    # transformers' plan is not sequence parallel: 5 + 12/T per block, not 17/T
    assert data["activations"]["sequence_parallel"] is False and data["activations"]["vocab_size"] == 1024
    assert data["estimate"]["activation_bytes"] == 3 * (5 + 12 // 2) * 2 * 2 * 128 * 256
    assert data["estimate"]["blocks"] == 3 and data["estimate"]["precision"] == "bf16"
    one = 2 * 2 * 128 * 256
    tp = {t["kind"]: t["tensor_bytes"] for t in data["estimate"]["per_step_per_gpu"] if t["axis"] == "tp"}
    assert tp == {"all_reduce": (7 * 3 + 2) * one, "all_gather": 2 * 2 * 128 * 1024}  # and the logits gathered
    text = _plan("--nodes", "1", "--gpus-per-node", "4", "--shard", "2", "--tp", "2", "--model", f"hf:{tmp_path}",
                 "--seq-len", "128", "--batch-size", "2").output  # fmt: skip
    assert "over tp 2 (no sequence parallelism)" in text and "all_reduce     over tp" in text


def test_cli_recommend_at_a_given_tp_names_it():
    out = _plan("--nodes", "2", "--tp", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB")
    assert out.exit_code == 0, out.output
    assert "recommended: --tp 2 --shard 4" in out.output
    shards = [line.split()[0] for line in out.output.splitlines() if line.split()[3:4] in (["yes"], ["no"])]
    assert shards == ["1", "2", "4", "8"]  # S x 2 ranks: 2, 4, 8, 16


def test_docs_recommend_output_is_what_plan_prints():
    """Issue 43 (new user 8): docs/tensor-parallel.md showed a --recommend table (a shard size of 32,
    24.45 GiB per GPU, --reshard-after-forward) that the program no longer printed. Every line the
    page shows is one plan prints, in the same order."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "tensor-parallel.md").read_text()
    shown = page.split("```\nrecommended:", 1)[1].split("```", 1)[0]
    shown_lines = [line for line in ("recommended:" + shown).splitlines() if line and line.strip() != "..."]
    out = _plan("--nodes", "4", "--recommend", "--model-params", "70B", "--gpu-memory", "80GiB",
                "--seq-len", "8192", "--batch-size", "1")  # fmt: skip
    assert out.exit_code == 0, out.output
    printed = out.output.splitlines()
    positions = [printed.index(line) for line in shown_lines]
    assert positions == sorted(positions), positions


def test_tp_help_says_what_a_shard_group_is():
    """Issue 43 (new user 8): --tp's help said a shard group is S x T ranks; plan shows shard groups
    of S ranks (T apart), S x T consecutive ranks holding one copy of the model."""
    out = CliRunner().invoke(cli, ["submit", "--help"], terminal_width=400)
    assert "A shard group is then S x T ranks" not in out.output
    assert "a shard group is S of them, T apart" in " ".join(out.output.split())
