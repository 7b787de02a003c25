"""Tensor parallelism (``--tp``) with real gloo processes: the built-in model split over tp groups
under FSDP2 trains the same losses as without tensor parallelism, on the (replicate, shard, tp)
mesh; its checkpoints resume across tp sizes."""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal

import pytest
from dist_helpers import launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec

# a global batch of 8 on any mesh; heads, 4 x width, vocabulary and sequence all divide by 2
TRAIN = TrainingSpec.of(
    layers=2,
    width=32,
    heads=4,
    seq_len=16,
    batch_size=4,
    global_batch_size=8,
    vocab_size=64,
    steps=10,
    seed=5,
    lr=3e-3,
    clip_grad=0.5,
    precision="fp32",
    eval_every=5,
    eval_batches=2,
)


def _losses(outcomes) -> list[float]:
    return outcomes[0].value["losses"]


def train_recording(ctx, *, stop_after=None):
    """train() recording each step's loss and gradient norm; with ``stop_after`` K, a SIGUSR2 on the
    last rank during step K - 1, so that every rank stops after step K and saves."""
    from hpc_hsdp.task.training.loop import train

    norms = {}

    def on_step(number, record):
        norms[number] = record["grad_norm"]
        if stop_after is not None and number == stop_after - 1 and ctx.rank == ctx.world_size - 1:
            os.kill(os.getpid(), signal.SIGUSR2)

    result = train(ctx, ctx.spec.training, verbose=False, on_step=on_step)
    ordered = sorted(result.losses)
    return {
        "losses": [result.losses[n] for n in ordered],
        "grad_norms": [norms[n] for n in ordered],
        "eval": [result.eval_losses[n] for n in sorted(result.eval_losses)],
    }


def _run(run_dir, *, shard, tp, tasks_per_node, training=TRAIN, stop_after=None, extra_env=None):
    spec = RunSpec(shard_size=shard, tp_size=tp, device="cpu", run_dir=str(run_dir), training=training, timeout_s=120)
    fn = functools.partial(train_recording, stop_after=stop_after)
    return launch(spec, tasks_per_node=tasks_per_node, fn=fn, timeout_s=240, extra_env=extra_env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Shard 2 on one node of 2 ranks, no tensor parallelism: 10 steps (its run directory: ``.run_dir``)."""
    run_dir = tmp_path_factory.mktemp("tp") / "s2"
    outcomes = _run(run_dir, shard=2, tp=1, tasks_per_node=[2])
    outcomes[0].value["run_dir"] = run_dir
    return outcomes


def test_shard_2_tp_2_trains_the_losses_of_shard_2_alone(reference, tmp_path):
    split = _run(tmp_path / "s2t2", shard=2, tp=2, tasks_per_node=[4])
    want, got = _losses(reference), _losses(split)
    assert len(got) == len(want) == 10
    assert got == pytest.approx(want, rel=1e-5)
    assert split[0].value["grad_norms"] == pytest.approx(reference[0].value["grad_norms"], rel=1e-4)
    assert split[0].value["eval"] == pytest.approx(reference[0].value["eval"], rel=1e-5)
    assert all(o.value["losses"] == got for o in split)  # every rank agrees
    layout = json.loads((tmp_path / "s2t2" / "layout.json").read_text())
    assert [r["tp_group"] for r in layout["ranks"]] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["shard_group"] for r in layout["ranks"]] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert layout["plan"]["tp_size"] == 2


def train_warned(ctx):
    """train_recording, and every deprecation torch.distributed warned of on this rank."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = train_recording(ctx)
    out["deprecated"] = sorted({str(w.message) for w in caught if "deprecated" in str(w.message).lower()})
    return out


def test_replicate_2_shard_2_tp_2_on_8_processes_trains_the_same_losses(reference, tmp_path):
    spec = RunSpec(shard_size=2, tp_size=2, device="cpu", run_dir=str(tmp_path / "r2s2t2"), training=TRAIN)
    split = launch(spec, tasks_per_node=[4, 4], fn=train_warned, timeout_s=240)
    assert not [o.value["deprecated"] for o in split if o.value["deprecated"]]  # quiet logs: no deprecated calls
    assert _losses(split) == pytest.approx(_losses(reference), rel=1e-5)
    assert split[0].value["grad_norms"] == pytest.approx(reference[0].value["grad_norms"], rel=1e-4)
    layout = json.loads((tmp_path / "r2s2t2" / "layout.json").read_text())
    assert layout["plan"]["mesh_shape"] == [2, 2, 2]
    assert [r["replicate_group"] for r in layout["ranks"][:4]] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert {r["node"] for r in layout["ranks"][:4]} == {"n1"}  # a copy (S x T ranks) on one node


def test_a_checkpoint_resumes_across_tp_2_to_1_to_2_where_the_run_left_off(reference, tmp_path):
    run = tmp_path / "run"
    first = _run(run, shard=2, tp=2, tasks_per_node=[4], stop_after=3)
    middle = _run(run, shard=2, tp=1, tasks_per_node=[2], stop_after=6, extra_env={"SLURM_RESTART_COUNT": "1"})
    last = _run(run, shard=2, tp=2, tasks_per_node=[4], extra_env={"SLURM_RESTART_COUNT": "2"})
    assert len(_losses(first)) == 3 and len(_losses(middle)) == 3 and len(_losses(last)) == 4
    resumed = _losses(first) + _losses(middle) + _losses(last)
    assert resumed == pytest.approx(_losses(reference), rel=1e-5)
    # the optimizer's state and the data position too: each step's gradient norm, and the held-out
    # losses at steps 5 and 10, are those of the run that never stopped
    norms = [n for part in (first, middle, last) for n in part[0].value["grad_norms"]]
    assert norms == pytest.approx(reference[0].value["grad_norms"], rel=1e-4)
    assert middle[0].value["eval"] + last[0].value["eval"] == pytest.approx(reference[0].value["eval"], rel=1e-5)


def test_a_checkpoint_of_the_earlier_qkv_layout_is_refused_at_resume_not_misread(reference, tmp_path):
    run = tmp_path / "old"
    shutil.copytree(reference[0].value["run_dir"] / "checkpoints", run / "checkpoints")
    state_file = run / "checkpoints" / "step-000010" / "train_state.json"
    state = json.loads(state_file.read_text())
    assert state.pop("model_layout") == "qkv head-major"
    state_file.write_text(json.dumps(state))
    spec = RunSpec(shard_size=2, device="cpu", run_dir=str(run), training=TRAIN.replace(steps=12))
    failed = launch(spec, tasks_per_node=[2], fn=train_recording, timeout_s=120, expect_failure=True)
    assert all(not o.ok for o in failed)
    assert "holds the built-in model in an earlier layout" in failed[0].value
    assert "start a new --run-dir" in failed[0].value


def test_compiled_blocks_under_tensor_parallelism_train_the_eager_losses(reference, tmp_path):
    compiled = TRAIN.replace(steps=4, eval_every=0, compile=True)
    eager = _losses(reference)[:4]
    got = _losses(_run(tmp_path / "compiled", shard=2, tp=2, tasks_per_node=[4], training=compiled))
    assert got == pytest.approx(eager, rel=2e-2)
    assert got == pytest.approx(eager, abs=1e-4)  # the embeddings get their gradients (a wait() would cut them off)


@pytest.mark.parametrize(
    ("options", "rel"),
    [
        ({"activation_checkpointing": True, "grad_accum": 2, "batch_size": 2}, 1e-5),
        ({"precision": "bf16", "grad_accum": 2, "batch_size": 2}, 2e-2),
    ],
    ids=["fp32 checkpointed activations, 2 micro-batches", "bf16, 2 micro-batches"],
)
def test_tensor_parallel_composes_with_the_step_options(tmp_path, options, rel):
    training = TRAIN.replace(steps=4, eval_every=0, **options)
    alone = _losses(_run(tmp_path / "s2", shard=2, tp=1, tasks_per_node=[2], training=training))
    split = _losses(_run(tmp_path / "s2t2", shard=2, tp=2, tasks_per_node=[4], training=training))
    assert split == pytest.approx(alone, rel=rel)


def test_a_model_tp_cannot_split_is_refused_on_every_rank_before_training(tmp_path):
    spec = RunSpec(shard_size=1, tp_size=4, device="cpu", run_dir=str(tmp_path / "r"), training=TRAIN.replace(heads=2))
    failed = launch(spec, tasks_per_node=[4], fn=train_recording, timeout_s=120, expect_failure=True)
    assert all(not o.ok for o in failed)
    assert "--tp 4 does not divide the built-in model's 2 attention heads (--heads)" in failed[0].value
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


@pytest.mark.parametrize("tied", [False, True], ids=["own head", "head tied to the embedding (left whole)"])
def test_a_transformers_llama_splits_by_its_own_plan_and_trains_the_losses_of_shard_2(tmp_path, tied):
    from hf_helpers import TINY_LLAMA, write_config

    model = write_config(tmp_path / "llama", dict(TINY_LLAMA, tie_word_embeddings=tied))
    # 15 tokens: transformers' plan is not sequence parallel, so T need not divide the sequence
    training = TRAIN.replace(model=f"hf:{model}", vocab_size=96, seq_len=15, steps=4, eval_every=0)
    alone = _losses(_run(tmp_path / "s2", shard=2, tp=1, tasks_per_node=[2], training=training))
    split = _losses(_run(tmp_path / "s2t2", shard=2, tp=2, tasks_per_node=[4], training=training))
    assert split == pytest.approx(alone, rel=1e-5)


def test_a_model_without_a_plan_is_refused_naming_it(tmp_path):
    from hf_helpers import TINY_GPT2, write_config

    model = write_config(tmp_path / "gpt2", TINY_GPT2)
    training = TRAIN.replace(model=f"hf:{model}", vocab_size=96, steps=2, eval_every=0)
    spec = RunSpec(shard_size=1, tp_size=2, device="cpu", run_dir=str(tmp_path / "r"), training=training)
    failed = launch(spec, tasks_per_node=[2], fn=train_recording, timeout_s=120, expect_failure=True)
    assert all(not o.ok for o in failed)
    assert f"--tp 2: --model 'hf:{model}' has no tensor-parallel plan" in failed[0].value


def test_a_factory_model_gives_its_own_plan_and_trains_the_losses_of_shard_2(tmp_path):
    training = TRAIN.replace(model="tp_factory:build", steps=4, eval_every=5)
    alone = _run(tmp_path / "s2", shard=2, tp=1, tasks_per_node=[2], training=training)
    split = _run(tmp_path / "s2t2", shard=2, tp=2, tasks_per_node=[4], training=training)
    assert _losses(split) == pytest.approx(_losses(alone), rel=1e-5)
    assert split[0].value["eval"] == pytest.approx(alone[0].value["eval"], rel=1e-5)


def own_loop_main(ctx):
    """examples/own_loop.py's loop (its own loss on the model's logits, TrainingRun.clip_grad_norm)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import own_loop

    own_loop.main(ctx)
    return {"losses": [], "grad_norms": [], "eval": []}


def test_an_own_loop_trains_a_transformers_llama_under_tensor_parallelism_as_without(tmp_path):
    from hf_helpers import TINY_LLAMA, write_config

    model = write_config(tmp_path / "llama", TINY_LLAMA)
    training = TRAIN.replace(model=f"hf:{model}", vocab_size=96, steps=4, eval_every=0)
    metrics = {}
    for tp, tasks in ((1, [2]), (2, [4])):
        run_dir = tmp_path / f"tp{tp}"
        spec = RunSpec(shard_size=2, tp_size=tp, device="cpu", run_dir=str(run_dir), training=training)
        launch(spec, tasks_per_node=tasks, fn=own_loop_main, timeout_s=240)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        metrics[tp] = [r[key] for r in rows for key in ("loss", "grad_norm")]
    assert len(metrics[2]) == 8
    assert metrics[2] == pytest.approx(metrics[1], rel=1e-5)


def test_comm_stats_count_tensor_parallel_traffic_on_its_own_axis(tmp_path):
    """Per step and rank, the built-in model at tp 2 gathers and reduce-scatters (4L + 2) activations
    of (rows, seq_len, width) plus the positions' (seq_len, width) once each, inside the node."""
    training = TRAIN.replace(steps=2, eval_every=0)
    spec = RunSpec(
        shard_size=2, tp_size=2, device="cpu", run_dir=str(tmp_path / "r"), comm_stats=True, training=training
    )
    launch(spec, tasks_per_node=[4], fn=train_recording, timeout_s=240)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    tp = rows[-1]["comm"]["tp"]
    rows_per_rank = TRAIN.dataset.global_batch_size // 2  # the data-parallel ranks: R x S = 2
    activation = rows_per_rank * TRAIN.dataset.seq_len * TRAIN.model.width * 4
    positions = TRAIN.dataset.seq_len * TRAIN.model.width * 4
    expected = (4 * TRAIN.model.layers + 2) * activation + positions
    assert (tp["group_size"], tp["inter_node"]) == (2, False)
    assert tp["all_gather"]["tensor_bytes"] == tp["reduce_scatter"]["tensor_bytes"] == expected
    assert tp["all_gather"]["calls"] == tp["reduce_scatter"]["calls"] == 4 * TRAIN.model.layers + 3
    assert rows[0]["comm"]["tp"]["all_gather"] == tp["all_gather"]  # every step the same


def _exported_tensors(run_dir: str, out_dir: str) -> dict:
    from safetensors.torch import load_file

    from hpc_hsdp.task.checkpointing.export import export

    export(run_dir, out_dir)
    return {name: tensor.flatten().tolist() for name, tensor in load_file(f"{out_dir}/model.safetensors").items()}


def test_export_of_a_tensor_parallel_run_holds_the_full_tensors(reference, tmp_path):
    from dist_helpers import in_child

    split_dir = tmp_path / "s2t2"
    _run(split_dir, shard=2, tp=2, tasks_per_node=[4])
    split = in_child(_exported_tensors, str(split_dir), str(tmp_path / "split-export"))
    alone = in_child(_exported_tensors, str(reference[0].value["run_dir"]), str(tmp_path / "alone-export"))
    assert split.keys() == alone.keys() and "blocks.0.attn.qkv.weight" in split
    for name in split:
        assert split[name] == pytest.approx(alone[name], abs=2e-3), name  # AdamW magnifies 1e-10 noise


@pytest.mark.timeout(420)
def test_replica_groups_of_s_x_t_ranks_train_as_the_same_groups_without_tensor_parallelism(tmp_path):
    """--fault-tolerance replica on the emulator (the supervisor, a lighthouse, one job step per
    group): two groups of (shard 1, tp 2) train the losses of two groups of (shard 2)."""
    from tests.fault_tolerance_helpers import _launch, _metrics, _spec

    losses = {}
    for name, mesh in (("shard2", ("--shard", "2")), ("tp2", ("--shard", "1", "--tp", "2"))):
        run_dir, samples = tmp_path / name, tmp_path / f"{name}-samples"
        samples.mkdir()
        (run_dir / "logs").mkdir(parents=True)
        spec = _spec(run_dir, samples, *mesh, "--steps", "6")
        job = _launch(spec)
        try:
            state = job.wait(timeout_s=240)
        finally:
            job.cancel()
        assert state == "COMPLETED", (run_dir / "logs" / f"{job.job_id}_0_log.err").read_text()[-3000:]
        records = _metrics(run_dir)
        assert [r["step"] for r in records] == list(range(1, 7)) and all(r["replica_groups"] == 2 for r in records)
        losses[name] = [r["loss"] for r in records]
    assert losses["tp2"] == pytest.approx(losses["shard2"], rel=1e-5)


def test_the_straggler_probe_names_a_slow_rank_not_its_tp_peer(tmp_path):
    """A TP group's ranks wait for a slow peer in the functional collectives' waits (DTensor's
    redistributions); counted as their own time, the peer looked as slow as the straggler and no
    rank stood out (spread about 1.0-1.2, the slowest rank any of three)."""
    from hpc_hsdp.rundir.training.stragglers import SLOW_THRESHOLD

    training = TRAIN.replace(layers=1, steps=8, eval_every=0, straggler_every=2)
    spec = RunSpec(shard_size=2, tp_size=2, device="cpu", run_dir=str(tmp_path / "r"), training=training)
    launch(spec, tasks_per_node=[4], fn=train_recording, timeout_s=240, extra_env={"HPC_HSDP_FAULT_SLOW_RANK": "3:0.2"})
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    entries = [r["stragglers"] for r in rows if "stragglers" in r]
    assert len(entries) == 4
    # on a loaded 2-core machine another rank may be descheduled in one probe, not in most
    named = [e for e in entries if e["slowest_rank"] == 3 and e["spread"] >= SLOW_THRESHOLD]
    assert len(named) >= 3, entries
    assert all(e["own_time_s"][2] < e["own_time_s"][3] / 2 for e in named), entries  # its TP peer: its own time


@pytest.mark.parametrize(
    ("model", "tied", "checkpointing"),
    [("builtin", False, True), ("llama", False, False), ("llama", True, True)],
    ids=["built-in, checkpointed", "transformers Llama", "transformers Llama, tied, checkpointed"],
)
def test_comm_stats_measure_the_tp_bytes_plan_estimates(tmp_path, model, tied, checkpointing):
    """The TP group's tensor bytes per step, as --comm-stats measures them, are plan's estimate
    (plan.estimates.ActivationShape.tp_traffic): the built-in model's sequence-parallel gathers and
    reduce-scatters with a checkpointed forward again, a transformers Llama's all-reduces and gathered
    logits (its plan is not sequence parallel)."""
    from hf_helpers import TINY_LLAMA, write_config

    from hpc_hsdp.plan.estimates import ActivationShape

    training = TRAIN.replace(steps=2, eval_every=0, activation_checkpointing=checkpointing)
    style = {}
    if model == "llama":
        path = write_config(tmp_path / "llama", dict(TINY_LLAMA, tie_word_embeddings=tied))
        training = training.replace(model=f"hf:{path}", vocab_size=96, width=64)
        style = {"sequence_parallel": False, "vocab_size": 96, "tied": tied}
    spec = RunSpec(
        shard_size=2, tp_size=2, device="cpu", run_dir=str(tmp_path / "r"), comm_stats=True, training=training
    )
    launch(spec, tasks_per_node=[4], fn=train_recording, timeout_s=240)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    measured = rows[-1]["comm"]["tp"]
    rows_per_rank = TRAIN.dataset.global_batch_size // 2  # the data-parallel ranks: R x S = 2
    shape = ActivationShape(layers=TRAIN.model.layers, width=training.model.width, seq_len=TRAIN.dataset.seq_len, batch_size=rows_per_rank,
                            checkpointing=checkpointing, **style)  # fmt: skip
    for t in shape.tp_traffic(element_bytes=4, tp_size=2, grad_accum=1, inter_node=False):
        got = measured[t.kind]["tensor_bytes"]
        if model == "builtin":  # and the positions' (seq_len, width), once each way
            got -= TRAIN.dataset.seq_len * TRAIN.model.width * 4
        assert got == t.tensor_bytes, (t.kind, measured)
