"""``--model hf:PATH``: transformers causal LMs built on meta, sharded, initialised or loaded
(real gloo processes, tiny Llama- and GPT-2-style models of width 64)."""

from __future__ import annotations

import json

import pytest
from cli_helpers import hpc
from dist_helpers import in_child, launch
from hf_helpers import (
    TINY_BERT,
    TINY_GPT2,
    TINY_LLAMA,
    from_pretrained_loss,
    save_pretrained_tiny,
    shard_and_report,
    unsharded_reference,
    write_config,
)

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import RunSpec, TrainingSpec

pytestmark = pytest.mark.dist


def _launch(tmp_path, model: str, *, tasks_per_node, shard: int, seed: int = 5, shard_unit=None):
    run_dir = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
    training = TrainingSpec.of(model=model, seed=seed, shard_unit=shard_unit)
    spec = RunSpec(shard_size=shard, run_dir=str(run_dir), device="cpu", training=training, timeout_s=120)
    outcomes = launch(spec, tasks_per_node=tasks_per_node, fn=shard_and_report, timeout_s=240)
    return run_dir, {o.value["rank"]: o.value for o in outcomes}


@pytest.mark.parametrize("values", [TINY_LLAMA, dict(TINY_GPT2)], ids=["llama", "gpt2"])
def test_config_only_model_is_sharded_and_initialised_independently_of_the_mesh(tmp_path, values):
    model_dir = write_config(tmp_path / "model", values)
    run_dir, by_rank = _launch(tmp_path, f"hf:{model_dir}", tasks_per_node=[2, 2], shard=2)
    total = by_rank[0]["total_numel"]
    for group in ((0, 1), (2, 3)):
        assert sum(by_rank[r]["local_numel"] for r in group) == total
    assert all(abs(v["local_numel"] - total / 2) <= 0.02 * total for v in by_rank.values())
    expected_unit = {"llama": "LlamaDecoderLayer", "gpt2": "GPT2Block"}[values["model_type"]]
    assert by_rank[0]["units"] == [expected_unit]
    assert len({v["loss"] for v in by_rank.values()}) == 1  # same batch, same model everywhere
    # the unsharded model from the same seed has the very same values, and transformers'
    # own shifted loss equals the adapter's
    ref = in_child(unsharded_reference, f"hf:{model_dir}", 5, run_dir / "full_state.pt")
    assert ref["keys"] and ref["n"] > 10 and ref["differ"] == [], ref["differ"][:5]
    assert abs(ref["hf_loss"] - ref["our_loss"]) < 1e-6
    assert abs(by_rank[0]["loss"] - ref["our_loss"]) < 1e-5
    # the model's own initialisation: weights ~ N(0, initializer_range), GPT-2's residual
    # projections scaled by 1/sqrt(2 * layers)
    for key, std in ref["stds"].items():
        expected = ref["range"] / (2 * 2) ** 0.5 if key.endswith("c_proj.weight") else ref["range"]
        assert 0.8 * expected < std < 1.2 * expected, (key, std, expected)
    if values["model_type"] != "llama":
        return
    # another mesh shape, same values
    run_dir_b, _ = _launch(tmp_path, f"hf:{model_dir}", tasks_per_node=[4], shard=4)
    ref_b = in_child(unsharded_reference, f"hf:{model_dir}", 5, run_dir_b / "full_state.pt")
    assert ref_b["differ"] == []


def test_tied_embeddings_stay_tied_in_the_root_unit(tmp_path):
    model_dir = write_config(tmp_path / "model", dict(TINY_LLAMA, tie_word_embeddings=True))
    run_dir, by_rank = _launch(tmp_path, f"hf:{model_dir}", tasks_per_node=[2], shard=2)
    assert all(v["tied"] == [["model.embed_tokens.weight", "lm_head.weight"]] for v in by_rank.values())
    ref = in_child(unsharded_reference, f"hf:{model_dir}", 5, run_dir / "full_state.pt")
    assert ref["differ"] == []


def test_pretrained_weights_load_into_shards_with_the_unsharded_loss(tmp_path):
    model_dir = in_child(save_pretrained_tiny, str(tmp_path / "pretrained"), TINY_LLAMA)
    run_dir, by_rank = _launch(tmp_path, f"hf:{model_dir}", tasks_per_node=[2, 2], shard=2)
    expected = in_child(from_pretrained_loss, model_dir)
    for value in by_rank.values():
        assert abs(value["loss"] - expected) < 1e-6, (value["loss"], expected)
    ref = in_child(unsharded_reference, f"hf:{model_dir}", 5, run_dir / "full_state.pt")
    assert ref["differ"] == []


def _adapter_errors(cases):
    """In a child (transformers imported once): construct each adapter and take its shard
    units; the SpecError message of each case, or "no error"."""
    from hpc_hsdp.models.hf import HFAdapter

    messages = []
    for model, shard_unit, data_vocab_size in cases:
        try:
            adapter = HFAdapter(TrainingSpec.of(model=model, shard_unit=shard_unit), data_vocab_size=data_vocab_size)
            adapter.shard_units(adapter.build_meta())
            messages.append("no error")
        except SpecError as exc:
            messages.append(str(exc))
    return messages


def test_bad_models_are_one_clear_error(tmp_path):
    llama = write_config(tmp_path / "llama", TINY_LLAMA)
    t5 = write_config(tmp_path / "t5", TINY_BERT)
    tied = write_config(tmp_path / "tied", dict(TINY_LLAMA, tie_word_embeddings=True))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((llama / "config.json").read_text())
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    cases = {
        (f"hf:{tmp_path / 'absent'}", None, None): "does not exist",
        ("hf:meta-llama/Llama-3.2-1B", None, None): "looks like a hub model id, and nothing is downloaded",
        (f"hf:{t5}", None, None): "is not a causal language model",
        (f"hf:{llama}", "LlamaBlock", None): "'LlamaBlock', which matches no module of LlamaForCausalLM",
        (f"hf:{llama}", "LlamaForCausalLM", None): "names the model's own class",
        (f"hf:{llama}", None, 500): "vocabulary of 96 tokens but the data's tokenizer has 500",
        (f"hf:{tied}", "LlamaDecoderLayer,Embedding", None): "would be in different FSDP units",
        (f"hf:{tmp_path / 'bin'}", None, None): "are pytorch_model.bin",
        (f"hf:{llama / 'config.json'}", "LlamaDecoderLayer,LlamaMLP", None): "no error",
    }
    messages = in_child(_adapter_errors, list(cases))
    for (case, expected), message in zip(cases.items(), messages):
        assert expected in message, (case, message)
        assert "\n" not in message


def test_pretrained_load_holds_one_shard_per_rank_not_the_model(tmp_path):
    """Peak host memory a pretrained load adds to each rank (kernel high-water mark), a 20M
    parameter Llama sharded over 4 ranks: each rank reads only its rows of the file (its
    quarter, written into its shard, plus one tensor's rows at a time); a naive full read
    (every rank loads model.safetensors) adds at least the whole model."""
    from hf_helpers import MEDIUM_LLAMA, load_memory_report

    model_dir = in_child(save_pretrained_tiny, str(tmp_path / "medium"), MEDIUM_LLAMA)
    spec = RunSpec(
        shard_size=4,
        run_dir=str(tmp_path / "run"),
        device="cpu",
        training=TrainingSpec.of(model=f"hf:{model_dir}"),
        timeout_s=120,
    )
    reports = [o.value for o in launch(spec, tasks_per_node=[4], fn=load_memory_report, timeout_s=300)]
    size = reports[0]["model_bytes"]
    print(
        {
            r["rank"]: {k: (round(v / size, 3) if k in ("sharded", "naive") else v) for k, v in r.items()}
            for r in reports
        }
    )
    for report in reports:
        assert report["sharded"] < 0.5 * size, (report["sharded"] / size, report)
        assert report["naive"] > 0.95 * size, (report["naive"] / size, report)
    expected = in_child(from_pretrained_loss, model_dir)
    assert all(abs(r["loss"] - expected) < 1e-5 for r in reports)


_OWN_LINES = ("[hpc-hsdp] ", "hpc-hsdp: ", "note: ", "step ")


def test_a_tensor_parallel_run_and_its_export_log_only_hpc_hsdp_lines(tmp_path):
    """An hf: model on the emulator (4 tasks, --tp 2, synthetic tokens: the model's 96-token
    vocabulary, not --vocab-size's) trains, and every line its tasks log is hpc-hsdp's: no torchao
    kernel-load failures, pytree deprecations or FSDP view warnings; export prints no progress bars
    or single-process warnings."""
    model_dir = write_config(tmp_path / "model", TINY_LLAMA)
    run_dir = tmp_path / "run"
    done = hpc(
        "submit", "--cluster", "local", "--nodes", "1", "--gpus-per-node", "4", "--shard", "2", "--tp", "2",
        "--model", f"hf:{model_dir}", "--steps", "2", "--device", "cpu", "--seq-len", "8", "--batch-size", "2",
        "--venv", "none", "--run-dir", str(run_dir), "--wait",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = [
        line
        for log in sorted((run_dir / "logs").glob("*_log.*"))
        if log.suffix in (".out", ".err")
        for line in log.read_text().splitlines()
    ]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    foreign = [line for line in lines if line.strip() and not line.startswith(_OWN_LINES)]
    assert foreign == [], foreign[:10]
    exported = hpc("export", str(run_dir), "-o", str(tmp_path / "exported"))
    assert exported.returncode == 0, exported.stderr
    assert exported.stderr == ""
    assert exported.stdout.startswith("exported step 2 (hf)")
