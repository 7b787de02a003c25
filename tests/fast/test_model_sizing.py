"""job/model_sizing.py: the model `hpc-hsdp plan` costs, read from --model, --model-params and
--root-params without the command."""

from __future__ import annotations

import re

import pytest
from hf_helpers import write_config

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.model_sizing import (
    builtin_counts,
    builtin_training,
    model_options,
    model_summary,
    params_for_shard,
    tp_training,
)
from hpc_hsdp.job.spec import TrainingSpec


@pytest.mark.parametrize(
    ("model_params", "root_params", "expected"),
    [
        ("7B", None, (7_000_000_000, 0)),
        (" 350M ", None, (350_000_000, 0)),
        ("7B", "1B", (7_000_000_000, 1_000_000_000)),
        ("1M", "1M", (1_000_000, 1_000_000)),
    ],
)
def test_a_count_is_the_same_at_every_shard_size(model_params, root_params, expected):
    counts = params_for_shard(model_params, root_params)
    assert counts(1) == counts(8) == expected


@pytest.mark.parametrize(
    ("model_params", "root_params", "message"),
    [
        ("1M", "2M", "--root-params '2M' is more than --model-params '1M'; the root is part of the model"),
        ("builtin", "1M", "--root-params with --model-params builtin: the built-in model knows its root"),
        ("seven", None, "--model-params"),
        ("builtin:layerz=4", None, "'layerz=4' is not KEY=VALUE with KEY one of"),
        ("builtin:layers=x", None, "--model-params builtin: layers='x' must be an integer"),
        ("builtin:layers", None, "'layers' is not KEY=VALUE"),
    ],
)
def test_params_for_shard_refusals(model_params, root_params, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        params_for_shard(model_params, root_params)


def test_the_builtin_models_counts_are_padded_per_shard_size_and_carry_its_dimensions():
    counts = params_for_shard("builtin:layers=4,width=128", None)
    assert counts == builtin_counts("layers=4,width=128")
    assert counts.dims == (4, 128, TrainingSpec().dataset.seq_len, "the built-in model's 4 blocks, width 128")
    params, root = counts(1)
    assert 0 < root < params
    assert counts(3)[0] > params  # dim 0 padded to a multiple of 3, as FSDP2 pads it


@pytest.mark.parametrize(
    ("options", "fields"),
    [
        ("", {}),
        ("layers=4,width=128", {"layers": 4, "width": 128}),
        (" seq-len = 64 , vocab_size=1000 ", {"seq_len": 64, "vocab_size": 1000}),
        ("heads=2,", {"heads": 2}),
    ],
)
def test_builtin_training_reads_key_value_pairs(options, fields):
    assert builtin_training(options).options() == {**TrainingSpec().options(), **fields}


@pytest.mark.parametrize(
    ("model", "model_params", "seq_len", "expected"),
    [
        (None, None, None, None),
        (None, "7B", 4096, None),  # a bare count: nothing to split
        ("builtin", None, None, {"model": "builtin"}),
        ("builtin", None, 256, {"model": "builtin", "seq_len": 256}),
        (None, "builtin:layers=2", 128, {"layers": 2, "seq_len": 128}),
        (None, "BUILTIN", None, {}),
    ],
)
def test_tp_training_is_the_model_tp_must_split(model, model_params, seq_len, expected):
    training = tp_training(model, model_params, seq_len)
    if expected is None:
        assert training is None
    else:
        assert training is not None
        assert training.options() == {**TrainingSpec().options(), **expected}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("builtin", "7B", None, False, None), "--model and --model-params both say what the model is; keep one"),
        (("builtin", None, "1M", False, None), "--model and --model-params both say what the model is; keep one"),
        ((None, None, None, True, "80GiB"), "--recommend needs --model-params (what must fit)"),
        ((None, "7B", None, True, None), "--recommend needs --gpu-memory (what it must fit in)"),
        ((None, None, "1M", False, None), "--root-params needs --model-params"),
        (("llama", None, None, False, None), "--model 'llama' is not one of builtin"),
    ],
)
def test_model_options_refusals(arguments, message):
    model, model_params, root_params, recommend, gpu_memory = arguments
    with pytest.raises(SpecError, match=re.escape(message)):
        model_options(model, model_params, root_params, recommend=recommend, gpu_memory=gpu_memory)


def test_model_options():
    assert model_options(None, None, None, recommend=False, gpu_memory=None) == (None, None)
    assert model_options(None, "7B", "1B", recommend=True, gpu_memory="80GiB") == ("7B", None)
    model_params, info = model_options("builtin", None, None, recommend=True, gpu_memory="80GiB")
    assert model_params == "" and info is not None and info["record"]["model"] == "builtin"


def test_the_builtin_models_summary():
    info = model_summary("builtin")
    params, root = info["counts"](1)
    assert info["record"] == {"model": "builtin", "params": params, "root_params": root}
    assert info["line"] == f"model builtin: {params:,} parameters, {root:,} in the root"
    assert info["dims"] == info["counts"].dims
    assert "activation_style" not in info


def test_an_hf_models_summary_from_its_config(tmp_path):
    model = write_config(
        tmp_path / "llama",
        dict(
            model_type="llama",
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
    )
    info = model_summary(f"hf:{model}")
    assert info["record"]["model"] == f"hf:{model}" and info["record"]["layers"] == 2
    assert info["line"].startswith(f"model hf:{model}: llama, ")
    assert info["dims"] == (2, 64, None, "2 blocks, width 64")
    # transformers' own TP plan: not sequence parallel, the logits gathered over the vocabulary
    assert info["activation_style"] == {"sequence_parallel": False, "vocab_size": 1000, "tied": False}
