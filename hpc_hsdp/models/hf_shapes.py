"""Parameter shapes of a transformers causal LM from its config.json, without torch or
transformers (so ``hpc-hsdp plan --model hf:PATH`` stays light).

Two families are written out: Llama-style decoders (llama, mistral, qwen2, qwen3, ...:
RMSNorm, gated MLP, grouped-query attention, optional biases) and GPT-2-style ones
(gpt2: learned positions, LayerNorm with biases, fused QKV Conv1D). Any other
``model_type`` returns None: the caller then needs torch and transformers (a meta-device
build). A test checks each formula parameter by parameter against the real model.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from hpc_hsdp.plan.shapes import TpDims, padded_numel

LLAMA_STYLE = {
    "llama": "LlamaDecoderLayer",
    "mistral": "MistralDecoderLayer",
    "qwen2": "Qwen2DecoderLayer",
    "qwen3": "Qwen3DecoderLayer",
}
GPT2_STYLE = {"gpt2": "GPT2Block"}

SIZE_LIMITS = {
    "num_hidden_layers": 1024,
    "n_layer": 1024,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "n_head": 4096,
    "hidden_size": 1 << 20,
    "n_embd": 1 << 20,
    "intermediate_size": 1 << 22,
    "n_inner": 1 << 22,
    "head_dim": 1 << 16,
    "vocab_size": 1 << 24,
    "n_positions": 1 << 27,
    "max_position_embeddings": 1 << 27,
}
"""The sizes and counts of a config.json that shape the model, each with its largest sensible
value: every one present is an integer from 1 to it (``null`` where transformers derives it)
before anything proportional to it is done (1e8 layers were a plan that built for minutes)."""
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "n_inner")
"""Sizes that ``null`` leaves to transformers (the heads', 4 x the width)."""


def config_size_problem(config: dict) -> str | None:
    """What is wrong with ``config``'s sizes (:data:`SIZE_LIMITS`), in words; None when nothing."""
    for key, most in SIZE_LIMITS.items():
        if key not in config or (config[key] is None and key in OPTIONAL_SIZES):
            continue
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{key} is {str(value)[:40]!r}, not an integer"
        if not 1 <= value <= most:
            return f"{key} is {value if abs(value) < 10**12 else 'out of range'}, outside 1-{most}"
    return None


Shape = tuple[str, tuple[int, ...], bool]
"""(parameter name, shape, in the root unit)."""


@dataclass(frozen=True, kw_only=True)
class ModelShapes:
    model_type: str
    block_class: str
    layers: int
    shapes: tuple[Shape, ...]
    tied: bool
    width: int = 0
    """The hidden size (the activations' last dim); 0 where not known (a meta-device build)."""

    def counts(self, shard_size: int = 1) -> tuple[int, int]:
        """(parameters, root parameters), dim 0 padded to a multiple of ``shard_size`` as FSDP2 pads it."""
        return (
            sum(padded_numel(s, shard_size) for _, s, _ in self.shapes),
            sum(padded_numel(s, shard_size) for _, s, root in self.shapes if root),
        )

    @property
    def params(self) -> int:
        return sum(prod(s) for _, s, _ in self.shapes)

    @property
    def root_params(self) -> int:
        return sum(prod(s) for _, s, root in self.shapes if root)

    @property
    def block_params(self) -> int:
        return (self.params - self.root_params) // max(self.layers, 1)

    def to_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "block_class": self.block_class,
            "layers": self.layers,
            "params": self.params,
            "root_params": self.root_params,
            "block_params": self.block_params,
            "tied_embeddings": self.tied,
        }


def _linear(name: str, out_features: int, in_features: int, bias: bool) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"{name}.weight", (out_features, in_features))] + ([(f"{name}.bias", (out_features,))] if bias else [])


def _llama(c: dict, model_type: str) -> ModelShapes:
    h, v, layers = c["hidden_size"], c["vocab_size"], c["num_hidden_layers"]
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    inter = c["intermediate_size"]
    qkv_bias = c.get("attention_bias", model_type == "qwen2")
    o_bias = c.get("attention_bias", False) if model_type != "qwen2" else False
    mlp_bias = c.get("mlp_bias", False)
    tied = bool(c.get("tie_word_embeddings", False))
    out: list[Shape] = [("model.embed_tokens.weight", (v, h), True)]
    for i in range(layers):
        p = f"model.layers.{i}."
        block = [
            *_linear("self_attn.q_proj", heads * hd, h, qkv_bias),
            *_linear("self_attn.k_proj", kv * hd, h, qkv_bias),
            *_linear("self_attn.v_proj", kv * hd, h, qkv_bias),
            *_linear("self_attn.o_proj", h, heads * hd, o_bias),
        ]
        if model_type == "qwen3":
            block += [("self_attn.q_norm.weight", (hd,)), ("self_attn.k_norm.weight", (hd,))]
        block += [
            *_linear("mlp.gate_proj", inter, h, mlp_bias),
            *_linear("mlp.up_proj", inter, h, mlp_bias),
            *_linear("mlp.down_proj", h, inter, mlp_bias),
        ]
        block += [("input_layernorm.weight", (h,)), ("post_attention_layernorm.weight", (h,))]
        out += [(p + name, shape, False) for name, shape in block]
    out.append(("model.norm.weight", (h,), True))
    if not tied:
        out.append(("lm_head.weight", (v, h), True))
    return ModelShapes(
        model_type=model_type,
        block_class=LLAMA_STYLE[model_type],
        layers=layers,
        shapes=tuple(out),
        tied=tied,
        width=h,
    )


def _gpt2(c: dict, model_type: str) -> ModelShapes:
    e, v, layers = c.get("n_embd", 768), c.get("vocab_size", 50257), c.get("n_layer", 12)
    positions = c.get("n_positions", 1024)
    inner = c.get("n_inner") or 4 * e
    tied = bool(c.get("tie_word_embeddings", True))
    out: list[Shape] = [("transformer.wte.weight", (v, e), True), ("transformer.wpe.weight", (positions, e), True)]
    for i in range(layers):
        p = f"transformer.h.{i}."
        block = [
            ("ln_1.weight", (e,)),
            ("ln_1.bias", (e,)),
            ("attn.c_attn.weight", (e, 3 * e)),
            ("attn.c_attn.bias", (3 * e,)),
            ("attn.c_proj.weight", (e, e)),
            ("attn.c_proj.bias", (e,)),
            ("ln_2.weight", (e,)),
            ("ln_2.bias", (e,)),
            ("mlp.c_fc.weight", (e, inner)),
            ("mlp.c_fc.bias", (inner,)),
            ("mlp.c_proj.weight", (inner, e)),
            ("mlp.c_proj.bias", (e,)),
        ]
        out += [(p + name, shape, False) for name, shape in block]
    out += [("transformer.ln_f.weight", (e,), True), ("transformer.ln_f.bias", (e,), True)]
    if not tied:
        out.append(("lm_head.weight", (v, e), True))
    return ModelShapes(
        model_type=model_type,
        block_class=GPT2_STYLE[model_type],
        layers=layers,
        shapes=tuple(out),
        tied=tied,
        width=e,
    )


def shapes_from_config(config: dict) -> ModelShapes | None:
    """The parameter shapes of ``config`` (a parsed config.json), or None for a family without a formula."""
    model_type = config.get("model_type")
    try:
        if model_type in LLAMA_STYLE:
            return _llama(config, model_type)
        if model_type in GPT2_STYLE:
            return _gpt2(config, model_type)
    except KeyError:
        return None
    return None


def tp_dims_from_config(config: dict, *, model: str) -> TpDims | None:
    """What tensor parallelism splits of ``config``'s model (a parsed config.json), for
    :func:`~hpc_hsdp.plan.shapes.tp_refusal`; None for a family without a formula (the tasks
    check those when they build the model)."""
    model_type = config.get("model_type")

    def number(key: str) -> int | None:
        value = config.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    def number_or(key: str, default: int) -> int:
        found = number(key)
        return default if found is None else found

    if model_type in LLAMA_STYLE:
        heads, inter, vocab = number("num_attention_heads"), number("intermediate_size"), number("vocab_size")
        if heads is None or inter is None:
            return None
        kv = number("num_key_value_heads")
        return TpDims(
            model=model,
            heads=(heads, "num_attention_heads in config.json"),
            kv_heads=(kv, "num_key_value_heads in config.json")
            if kv
            else (heads, "num_attention_heads in config.json"),
            ffn_width=(inter, "intermediate_size in config.json"),
            vocab_size=(vocab, "vocab_size in config.json") if vocab else None,
            seq_len=None,  # transformers' plans are not sequence parallel: any length splits
        )
    if model_type in GPT2_STYLE:
        heads, width = number_or("n_head", 12), number_or("n_embd", 768)
        inner = number("n_inner") or 4 * width
        return TpDims(
            model=model,
            heads=(heads, "n_head in config.json"),
            kv_heads=(heads, "n_head in config.json"),
            ffn_width=(inner, "n_inner (or 4 x n_embd) in config.json"),
            vocab_size=(number_or("vocab_size", 50257), "vocab_size in config.json"),
            seq_len=None,  # transformers' plans are not sequence parallel: any length splits
        )
    return None
