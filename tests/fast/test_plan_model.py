"""``plan --model``: real parameter counts and per-block sizes from a config.json, without
torch or transformers for the Llama and GPT-2 families (checked against the real models)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from cli_helpers import hpc
from dist_helpers import in_child
from hf_helpers import write_config

from hpc_hsdp.models.hf_shapes import shapes_from_config

CONFIGS = {
    "llama-gqa": dict(
        model_type="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "llama-tied-bias-headdim": dict(
        model_type="llama",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        head_dim=32,
    ),
    "mistral": dict(
        model_type="mistral",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "qwen3": dict(
        model_type="qwen3",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "gpt2": dict(model_type="gpt2", vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "gpt2-untied-inner": dict(
        model_type="gpt2",
        vocab_size=96,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=128,
        n_inner=100,
        tie_word_embeddings=False,
    ),
}


def real_shapes(configs: dict) -> dict:
    """In a child: each config's real model on meta: (name, shape) in order, and the block class."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = {}
    for key, values in configs.items():
        values = dict(values)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        out[key] = {
            "shapes": [[n, list(p.shape)] for n, p in model.named_parameters()],
            "blocks": sorted(model._no_split_modules),
        }
    return out


def test_formulas_match_the_real_models_parameter_by_parameter():
    real = in_child(real_shapes, CONFIGS)
    for key, values in CONFIGS.items():
        ours = shapes_from_config(values)
        assert [[n, list(s)] for n, s, _ in ours.shapes] == real[key]["shapes"], key
        assert [ours.block_class] == real[key]["blocks"], key
        assert all(root == (".layers." not in n and ".h." not in n) for n, _, root in ours.shapes), key


def test_unknown_family_has_no_formula():
    assert shapes_from_config({"model_type": "falcon", "hidden_size": 64}) is None
    assert shapes_from_config({"model_type": "llama"}) is None  # incomplete: no guess


PLAN = """
import sys
from hpc_hsdp.cli import main
try:
    main({args!r})
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print("HEAVY", heavy[:3])
"""


def _plan(args):
    out = subprocess.run(
        [sys.executable, "-c", PLAN.format(args=args)],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
    )
    assert out.returncode == 0, out.stderr
    body, _, heavy = out.stdout.rpartition("HEAVY ")
    return body, heavy.strip()


def test_plan_with_an_hf_config_counts_without_torch_or_transformers(tmp_path):
    config = dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
    )
    model = write_config(tmp_path / "llama-3.2-1b-like", config)
    text, heavy = _plan(["plan", "--nodes", "2", "--shard", "4", "--model", f"hf:{model}", "--dtype", "bf16"])
    assert heavy == "[]"
    # Llama 3.2 1B has 1,235,814,400 parameters (its published count)
    assert "llama, 1,235,814,400 parameters = 16 x LlamaDecoderLayer of 60,821,504 + root 262,670,336, tied" in text
    text, heavy = _plan(["plan", "--nodes", "2", "--shard", "4", "--model", f"hf:{model / 'config.json'}", "--json"])
    data = json.loads(text)
    assert heavy == "[]"
    assert data["model"]["params"] == 1_235_814_400 and data["model"]["block_class"] == "LlamaDecoderLayer"
    assert data["estimate"]["model_params"] == 1_235_814_400  # 16 ranks' shards of 4: every dim 0 divides
    assert data["estimate"]["root_params"] == 262_670_336


@pytest.mark.parametrize(
    "model,expected",
    [
        ("hf:/nonexistent/dir", "does not exist"),
        ("hf:openai/gpt2", "looks like a hub model id"),
        ("nonsense", "is not one of builtin"),
    ],
)
def test_plan_bad_model_is_one_line(model, expected):
    out = hpc("plan", "--nodes", "1", "--shard", "2", "--model", model, timeout=60)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and expected in out.stderr, out.stderr


def test_plan_with_another_family_builds_on_meta(tmp_path):
    model = write_config(
        tmp_path / "phi",
        dict(
            model_type="phi",
            vocab_size=96,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
    )
    text, heavy = _plan(["plan", "--nodes", "1", "--shard", "2", "--model", f"hf:{model}"])
    assert "meta-device build (torch and transformers" in text and "2 x PhiDecoderLayer" in text
    assert "torch" in heavy


RENDER = """
import sys
from click.testing import CliRunner
from hpc_hsdp.cli import cli
result = CliRunner().invoke(cli, ["render", "--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--run-dir", {run!r},
                                  "--model", "hf:models/llama", "-o", "job.sbatch"])
assert result.exit_code == 0, result.output
print(open("job.sbatch").read())
print("HEAVY", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers")))
"""


def test_render_makes_a_relative_hf_path_absolute_without_transformers(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", RENDER.format(run=str(tmp_path / "run"))],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert f"--model hf:{tmp_path}/models/llama" in out.stdout
    assert out.stdout.rstrip().endswith("HEAVY []")
