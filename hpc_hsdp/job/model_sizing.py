"""The model ``hpc-hsdp plan`` costs, read from its options with the job's own readers: ``--model``
(the built-in model, an ``hf:`` config.json, a factory's shapes), ``--model-params`` (a count, or
``builtin:KEY=VALUE,...``) and ``--root-params``; the parameters per shard size that
:mod:`hpc_hsdp.plan.model_cost` prices, and the model ``--tp`` must split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import TrainingSpec, check_model
from hpc_hsdp.plan.estimates import ParamsForShard, parse_count


def model_summary(model: str) -> dict:
    """``--model`` -> {"counts": shard size -> (parameters, root parameters), "record": JSON, "line": text}."""
    check_model(model)
    if model == "builtin":
        counts = builtin_counts("")
        params, root = counts(1)
        return {
            "counts": counts,
            "dims": counts.dims,
            "record": {"model": model, "params": params, "root_params": root},
            "line": f"model builtin: {params:,} parameters, {root:,} in the root",
        }
    if model.startswith("hf:"):
        from hpc_hsdp.models.hf import read_shapes  # noqa: PLC0415  (models/ loads only for --model)

        shapes, source = read_shapes(TrainingSpec.of(model=model))
    else:
        from hpc_hsdp.models.factory import read_shapes  # noqa: PLC0415  (models/ loads only for --model)

        shapes, source = read_shapes(TrainingSpec.of(model=model))
    record = {"model": model, **shapes.to_dict(), "source": source}
    tied = ", tied embeddings" if shapes.tied else ""
    line = (
        f"model {model}: {shapes.model_type}, {shapes.params:,} parameters = {shapes.layers} x "
        f"{shapes.block_class} of {shapes.block_params:,} + root {shapes.root_params:,}{tied} ({source})"
    )
    dims = (
        (shapes.layers, shapes.width, None, f"{shapes.layers} blocks, width {shapes.width}") if shapes.width else None
    )
    info = {"counts": shapes.counts, "dims": dims, "record": record, "line": line}
    if model.startswith("hf:"):  # transformers' own TP plan: not sequence parallel, the logits gathered
        vocab = next((s[0] for name, s, _ in shapes.shapes if name.endswith("embed_tokens.weight")), 0)
        info["activation_style"] = {"sequence_parallel": False, "vocab_size": vocab, "tied": shapes.tied}
    return info


def params_for_shard(model_params: str, root_params: str | None) -> ParamsForShard:
    """``--model-params``/``--root-params`` -> shard size -> (parameters, root parameters)."""
    text = model_params.strip()
    if text.lower() == "builtin" or text.lower().startswith("builtin:"):
        if root_params is not None:
            raise SpecError(
                "--root-params with --model-params builtin: the built-in model knows its root; drop --root-params"
            )
        return builtin_counts(text.partition(":")[2])
    params = parse_count(text)
    p_root = parse_count(root_params, option="--root-params") if root_params is not None else 0
    if p_root > params:
        raise SpecError(
            f"--root-params {root_params!r} is more than --model-params {model_params!r}; the root is part of the model"
        )
    return lambda _s: (params, p_root)


@dataclass(frozen=True)
class BuiltinCounts:
    """``--model-params builtin:...``: (parameters, root parameters) per shard size, and the model's dimensions."""

    training: dict[str, Any]
    dims: tuple[int, int, int, str]

    def __call__(self, shard_size: int) -> tuple[int, int]:
        from hpc_hsdp.plan.shapes import parameter_counts  # noqa: PLC0415 - only --model-params builtin: needs it

        c = parameter_counts(**self.training, shard_size=shard_size)
        return c.params, c.root_params


def builtin_counts(options: str) -> BuiltinCounts:
    training = builtin_training(options).options()
    dims = (
        training["layers"],
        training["width"],
        training["seq_len"],
        f"the built-in model's {training['layers']} blocks, width {training['width']}",
    )
    return BuiltinCounts(training, dims)


def builtin_training(options: str) -> TrainingSpec:
    """``--model-params builtin:KEY=VALUE,...`` -> the built-in model's TrainingSpec."""
    known = {
        key.replace("_", "-"): key
        for key in TrainingSpec().options()
        if key in ("layers", "width", "heads", "seq_len", "vocab_size")
    }
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in options.split(","))):
        key, sep, value = item.partition("=")
        name = known.get(key.strip().replace("_", "-"))
        if not sep or name is None:
            raise SpecError(
                f"--model-params builtin:{options!r}: {item!r} is not KEY=VALUE with KEY one of "
                f"{', '.join(sorted(known))}; write e.g. builtin:layers=4,width=128"
            )
        try:
            values[name] = int(value)
        except ValueError:
            raise SpecError(f"--model-params builtin: {key}={value!r} must be an integer") from None
    return TrainingSpec.of(**values)


def tp_training(model: str | None, model_params: str | None, seq_len: int | None) -> TrainingSpec | None:
    """The model ``--tp`` must split, as a TrainingSpec (``--model``, or ``--model-params builtin:...``;
    ``--seq-len`` where given); None for a bare parameter count (nothing to check)."""
    more = {"seq_len": seq_len} if seq_len is not None else {}
    if model is not None:
        return TrainingSpec.of(model=model, **more)
    text = (model_params or "").strip()
    if text.lower() == "builtin" or text.lower().startswith("builtin:"):
        return builtin_training(text.partition(":")[2]).replace(**more)
    return None


def model_options(
    model: str | None, model_params: str | None, root_params: str | None, *, recommend: bool, gpu_memory: str | None
) -> tuple[str | None, dict | None]:
    """What says the model's size (``--model`` or ``--model-params``), checked against the
    options that need it; ``model_info`` for ``--model``."""
    model_info = None
    if model is not None:
        if model_params is not None or root_params is not None:
            raise SpecError("--model and --model-params both say what the model is; keep one")
        model_params, model_info = "", model_summary(model)
    if recommend:
        if model_params is None:
            raise SpecError("--recommend needs --model-params (what must fit); add e.g. --model-params 7B")
        if gpu_memory is None:
            raise SpecError("--recommend needs --gpu-memory (what it must fit in); add e.g. --gpu-memory 80GiB")
    if root_params is not None and model_params is None:
        raise SpecError("--root-params needs --model-params; add e.g. --model-params 7B")
    return model_params, model_info
