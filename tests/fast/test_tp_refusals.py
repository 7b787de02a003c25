"""`--tp T` that cannot split the model: one line, exit 2, nothing written, at plan, render and
submit (hpc_hsdp.plan.shapes.tp_refusal, the one check; submit_host/preflight.py's tensor_parallel_refusal
finds the sizes of each kind of model). Table-driven, no torch."""

from __future__ import annotations

import numpy as np
import pytest
from cli_helpers import assert_cli_imports_no_torch
from hf_helpers import TINY_LLAMA, write_config

import hpc_hsdp
from hpc_hsdp.cli import main
from hpc_hsdp.cli.examples import spec_from_argv
from hpc_hsdp.data.tokens import write_token_file
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.models.hf_shapes import tp_dims_from_config
from hpc_hsdp.plan.shapes import builtin_tp_dims, tp_refusal
from hpc_hsdp.submit_host.preflight import check_job_inputs, check_tensor_parallel, tensor_parallel_refusal

# (heads, width, vocab, seq_len, tp) -> the part of the refusal that names the size (None: it splits)
BUILTIN = [
    (4, 64, 256, 32, 2, None),
    (4, 64, 256, 32, 4, None),
    (4, 64, 256, 32, 8, "the built-in model's 4 attention heads (--heads)"),
    (8, 64, 256, 32, 8, None),
    (8, 6 * 8, 256, 32, 8, None),  # feed-forward 4 x 48 = 192 = 8 x 24
    (8, 8 * 2, 256, 32, 16, "the built-in model's 8 attention heads"),
    (4, 64, 250, 32, 4, "the built-in model's 250 vocabulary (--vocab-size, or the data's)"),
    (4, 64, 256, 30, 4, "the built-in model's 30 sequence length (--seq-len)"),
    (4, 64, None, 32, 4, None),  # the data's vocabulary, not read here
    (3, 63, 255, 33, 3, None),
    (3, 63, 256, 33, 3, "256 vocabulary"),
]


@pytest.mark.parametrize(("heads", "width", "vocab", "seq", "tp", "named"), BUILTIN)
def test_builtin_model(heads, width, vocab, seq, tp, named):
    refusal = tp_refusal(builtin_tp_dims(heads=heads, width=width, vocab_size=vocab, seq_len=seq), tp)
    if named is None:
        assert refusal is None
    else:
        assert refusal.startswith(f"--tp {tp} does not divide ") and named in refusal
        assert "\n" not in refusal and refusal.endswith("or --tp 1")


def test_the_fix_names_the_tp_sizes_that_divide_every_size():
    dims = builtin_tp_dims(heads=12, width=96, vocab_size=256, seq_len=64)
    assert "use --tp 2, 4 (dividing every one)" in tp_refusal(dims, 3)
    assert "no --tp above 1 divides them all" in tp_refusal(
        builtin_tp_dims(heads=3, width=3, vocab_size=5, seq_len=7), 3
    )


LLAMA = {**TINY_LLAMA, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 128}
# (config, tp) -> what is named (None: it splits; "no formula": not checked here); no sequence length:
# transformers' plans are not sequence parallel
HF = [
    (LLAMA, 2, None),
    (LLAMA, 4, "2 key/value heads (num_key_value_heads in config.json)"),
    ({**LLAMA, "num_key_value_heads": 8}, 8, None),  # feed-forward 96 = 8 x 12, vocabulary 128 = 8 x 16
    ({**LLAMA, "num_key_value_heads": None}, 8, None),  # no grouping: the attention heads
    ({**LLAMA, "num_key_value_heads": 8, "intermediate_size": 100}, 8, "100 feed-forward width (intermediate_size"),
    ({**LLAMA, "vocab_size": 131}, 2, "131 vocabulary (vocab_size in config.json)"),
    ({**LLAMA, "model_type": "qwen2"}, 4, "2 key/value heads"),
    ({"model_type": "gpt2", "n_head": 12, "n_embd": 96}, 2, "50257 vocabulary"),
    ({"model_type": "gpt2", "n_head": 12, "n_embd": 96, "vocab_size": 50304}, 8, "12 attention heads (n_head"),
    ({"model_type": "mamba", "hidden_size": 64}, 2, "no formula"),
]


@pytest.mark.parametrize(("config", "tp", "named"), HF)
def test_hf_config(config, tp, named):
    dims = tp_dims_from_config(config, model="--model hf:/m")
    if named == "no formula":
        assert dims is None
        return
    refusal = tp_refusal(dims, tp)
    if named is None:
        assert refusal is None
    else:
        assert refusal.startswith(f"--tp {tp} does not divide --model hf:/m's ") and named in refusal
        assert "vocabulary over the TP group" in refusal  # not "and sequence": nothing splits it


def test_a_transformers_model_takes_any_sequence_length(tmp_path, capsys):
    """transformers' plans split heads and widths, never the sequence (no sequence parallelism):
    a --seq-len that T does not divide is no reason to refuse (the tasks train it:
    tests/processes/test_tensor_parallel.py's Llama at --seq-len 15)."""
    model = "hf:" + str(write_config(tmp_path / "llama", LLAMA))
    assert tensor_parallel_refusal(TrainingSpec.of(model=model, seq_len=33), 2) is None
    out = tmp_path / "job.sbatch"
    for argv in (
        ["plan", "--nodes", "1", "--shard", "2", "--tp", "2", "--model", model, "--seq-len", "33"],
        ["render", "--nodes", "1", "--shard", "2", "--tp", "2", "--model", model, "--seq-len", "33",
         "--run-dir", str(tmp_path / "r"), "-o", str(out)],
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code in (0, None), capsys.readouterr().err
    assert "tp=2" in capsys.readouterr().out and out.exists()


def test_a_factory_model_and_tp_1_are_never_refused_before_the_tasks():
    assert tensor_parallel_refusal(TrainingSpec.of(model="my_pkg.models:build"), 8) is None
    assert tensor_parallel_refusal(TrainingSpec.of(heads=3, width=3), 1) is None


# ----------------------------------------------------------------------------- the commands


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    captured = capsys.readouterr()
    assert exc.value.code == 2, captured.err
    assert captured.err.count("\n") == 1 and captured.out == "", captured
    return captured.err


REFUSED = [
    (["--tp", "8"], "the built-in model's 4 attention heads (--heads)"),
    (["--tp", "4", "--vocab-size", "250"], "250 vocabulary"),
    (["--tp", "4", "--seq-len", "30"], "30 sequence length"),
    (["--tp", "4", "--heads", "8", "--width", "8", "--seq-len", "32"], None),  # 4 x 8 = 32: splits
]


@pytest.mark.parametrize(("args", "named"), REFUSED)
def test_render_refuses_and_writes_nothing(tmp_path, capsys, args, named):
    out = tmp_path / "job.sbatch"
    argv = ["render", "--nodes", "1", "--shard", "1", "--run-dir", str(tmp_path / "run"), "-o", str(out), *args]
    if named is None:
        try:
            main(argv)
        except SystemExit as exc:
            assert exc.code in (0, None)
        assert out.exists()
        return
    err = _refused(argv, capsys)
    assert named in err and err.startswith("hpc-hsdp: error: --tp ")
    assert not out.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("args", "named"), [r for r in REFUSED if r[1] is not None and "--vocab-size" not in r[0]])
def test_plan_refuses_for_the_builtin_model(capsys, args, named):
    err = _refused(["plan", "--nodes", "1", "--shard", "1", "--model", "builtin", *args], capsys)
    assert named in err


def test_plan_refuses_for_model_params_builtin(capsys):
    err = _refused(["plan", "--nodes", "1", "--shard", "1", "--tp", "8", "--model-params", "builtin:heads=4"], capsys)
    assert "4 attention heads" in err
    err = _refused(["plan", "--nodes", "1", "--shard", "1", "--tp", "2", "--model-params", "builtin", "--seq-len",
                    "31"], capsys)  # fmt: skip
    assert "31 sequence length" in err
    err = _refused(["plan", "--nodes", "1", "--shard", "1", "--tp", "4", "--model-params", "builtin:vocab-size=250"],
                   capsys)  # fmt: skip
    assert "250 vocabulary" in err


def test_hf_model_at_plan_render_and_submit(tmp_path, capsys):
    model = "hf:" + str(write_config(tmp_path / "llama", LLAMA))
    err = _refused(["plan", "--nodes", "1", "--shard", "2", "--tp", "4", "--model", model], capsys)
    assert "2 key/value heads (num_key_value_heads in config.json)" in err
    render = ["render", "--nodes", "1", "--shard", "2", "--tp", "4", "--model", model, "--run-dir", str(tmp_path / "r")]
    assert "2 key/value heads" in _refused([*render, "-o", str(tmp_path / "job.sbatch")], capsys)
    assert not (tmp_path / "job.sbatch").exists()
    submit = ["submit", "--cluster", "local", "--shard", "2", "--tp", "4", "--model", model]
    assert "2 key/value heads" in _refused([*submit, "--run-dir", str(tmp_path / "run")], capsys)
    assert not (tmp_path / "run").exists()
    # a config.json that render cannot read here is the tasks' to check; submit reads it
    missing = "hf:" + str(tmp_path / "elsewhere")
    spec = spec_from_argv(["--nodes", "1", "--shard", "2", "--tp", "4", "--model", missing])
    check_tensor_parallel(spec, config_optional=True)
    with pytest.raises(SpecError, match="no config.json|does not exist|elsewhere"):
        check_tensor_parallel(spec)


def test_submit_and_the_api_refuse_writing_nothing(tmp_path, capsys):
    run_dir = tmp_path / "run"
    err = _refused(["submit", "--cluster", "local", "--shard", "1", "--tp", "8", "--run-dir", str(run_dir)], capsys)
    assert "4 attention heads" in err and not run_dir.exists()
    with pytest.raises(SpecError, match="4 attention heads"):
        hpc_hsdp.submit(cluster="local", shard=1, tp=8, run_dir=str(tmp_path / "api"))
    assert not (tmp_path / "api").exists()


def test_own_code_and_factories_are_not_refused_before_the_tasks():
    base = ["--nodes", "1", "--shard", "1", "--tp", "8"]
    check_tensor_parallel(spec_from_argv([*base, "--model", "my_pkg.models:build"]))
    check_tensor_parallel(spec_from_argv([*base, "--entry", "my_pkg.train:main"]))
    check_tensor_parallel(spec_from_argv(base), own_function=True)
    with pytest.raises(SpecError, match="4 attention heads"):
        check_tensor_parallel(spec_from_argv(base))


def test_submit_checks_the_datas_vocabulary_for_the_builtin_model(tmp_path):
    data = tmp_path / "odd.bin"
    write_token_file(data, np.arange(4000) % 90, vocab_size=99)
    spec = spec_from_argv(["--nodes", "1", "--shard", "1", "--tp", "2", "--seq-len", "16", "--data", str(data)])
    check_tensor_parallel(spec)  # --vocab-size is not the model's: the data's is, read at submit
    with pytest.raises(SpecError, match="99 vocabulary"):
        check_job_inputs(spec)
    even = tmp_path / "even.bin"
    write_token_file(even, np.arange(4000) % 90, vocab_size=100)
    check_job_inputs(spec_from_argv(["--nodes", "1", "--shard", "1", "--tp", "2", "--seq-len", "16", "--data",
                                     str(even)]))  # fmt: skip


def test_the_checks_import_no_torch(tmp_path):
    model = "hf:" + str(write_config(tmp_path / "llama", LLAMA))
    render = ["render", "--nodes", "1", "--shard", "2", "--tp", "2", "--model", model, "--run-dir", str(tmp_path / "r")]
    assert_cli_imports_no_torch([*render, "-o", str(tmp_path / "job.sbatch")])


def test_a_transformers_model_without_a_plan_is_refused_before_the_job(tmp_path, capsys):
    model = "hf:" + str(write_config(tmp_path / "gpt2", {"model_type": "gpt2", "n_head": 4, "n_embd": 64}))
    render = ["render", "--nodes", "1", "--shard", "2", "--tp", "2", "--model", model, "--run-dir", str(tmp_path / "r")]
    err = _refused([*render, "-o", str(tmp_path / "job.sbatch")], capsys)
    assert "(gpt2) has no tensor-parallel plan in transformers" in err
    assert not (tmp_path / "job.sbatch").exists()
