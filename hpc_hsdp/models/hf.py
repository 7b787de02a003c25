"""``--model hf:PATH``: a Hugging Face transformers causal LM, from a local directory or config.json.

PATH is a directory written by ``save_pretrained`` (``config.json``, and optionally
``model.safetensors`` or ``model.safetensors.index.json`` with its files) or a
``config.json`` file. Nothing is ever fetched from a hub: transformers is imported with
``HF_HUB_OFFLINE=1`` and a PATH that does not exist is one clear error.

- Build: ``AutoModelForCausalLM.from_config(config)`` under ``torch.device("meta")``, fp32
  parameters (``--precision`` casts for compute).
- Shard units: the model's ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``), or the
  classes named by ``--shard-unit CLASS[,CLASS]``. A tied head and input embedding stay
  tied: both live in the root unit; shard units that would split a tie are refused.
- Without weights: the model's own ``_init_weights``, applied unit by unit on an
  unsharded meta copy with the RNG seeded by ``(seed, module name)`` (see
  :mod:`hpc_hsdp.models.weights`): the same values on every mesh shape, never more than
  one unit unsharded on a rank. These are the model's own distributions, not the very
  numbers of ``from_config`` on one process (whose single RNG stream depends on order).
- With safetensors weights: every rank reads only its own shard of each tensor from the
  files; non-persistent buffers (rotary frequencies) come from the model's initialisation.
- Loss: the logits of ``model(input_ids=inputs)`` against the loop's ``targets`` (the
  inputs shifted by one, already), cross-entropy in fp32, mean over all tokens: exactly
  what ``model(input_ids=tokens, labels=tokens).loss`` gives on the unshifted sample
  (transformers shifts the labels itself; the loop has shifted them already, so labels
  are not passed).

Importing this module loads neither torch nor transformers (``plan`` and submit's checks read
config.json with it); they load when a model is built.
"""

from __future__ import annotations

import os
import re
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import InputNotFound, SpecError
from hpc_hsdp.files import parse_json, read_capped
from hpc_hsdp.models.base import ModelSettings, check_data_vocabulary
from hpc_hsdp.models.hf_shapes import ModelShapes, config_size_problem, shapes_from_config, tp_dims_from_config
from hpc_hsdp.models.third_party_noise import quiet_library_imports, root_output_read_out_of_place
from hpc_hsdp.plan.shapes import tp_refusal

PREFIX = "hf:"
DATA_VOCABULARY_FIX = (
    ": token ids would fall outside the embedding; tokenize the data with the model's tokenizer "
    "(hpc-hsdp prepare-data --tokenizer ...)"
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def locate(model: str) -> tuple[Path, Path | None]:
    """``hf:PATH`` -> (config.json, the directory whose weights to load or None); no torch,
    no transformers. A PATH that does not exist is a :class:`SpecError` (one line)."""
    text = model[len(PREFIX) :] if model.startswith(PREFIX) else model
    if not text:
        raise SpecError("--model hf: needs a path: hf:/path/to/model-dir or hf:/path/to/config.json")
    path = Path(text).expanduser()
    if not path.exists():
        if not path.is_absolute() and not text.startswith((".", "~")) and _HUB_ID.match(text):
            raise InputNotFound(
                f"--model {model!r}: no local directory or file {text!r}; it looks like a hub model id, and nothing is "
                f"downloaded: fetch it once (huggingface-cli download {text} --local-dir DIR) and give hf:DIR"
            )
        raise InputNotFound(
            f"--model {model!r}: {str(path)!r} does not exist; give a directory written by "
            f"save_pretrained or a config.json (hf: reads local paths only; a hub id is not downloaded: "
            f"huggingface-cli download ORG/NAME --local-dir DIR, then hf:DIR)"
        )
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise SpecError(
                f"--model {model!r}: the directory {str(path)!r} has no config.json; give the directory "
                f"written by save_pretrained (or the config.json itself)"
            )
        has_safetensors = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
        if not has_safetensors and any(
            (path / n).is_file() for n in ("pytorch_model.bin", "pytorch_model.bin.index.json")
        ):
            raise SpecError(
                f"--model {model!r}: the weights in {str(path)!r} are pytorch_model.bin, which is read only whole; "
                f"save them as safetensors (model.save_pretrained(dir, safe_serialization=True)), or give "
                f"hf:{config} to train from the config alone"
            )
        return config, (path if has_safetensors else None)
    if path.suffix != ".json":
        raise SpecError(
            f"--model {model!r}: {str(path)!r} is a file but not a config.json; give a directory written "
            f"by save_pretrained or its config.json"
        )
    return path, None


MAX_CONFIG_BYTES = 16 << 20


def config_values(model: str) -> dict:
    """``hf:PATH``'s config.json as plain JSON values (no torch, no transformers)."""
    config_path, _ = locate(model)
    return read_config_json(config_path, model=model)


def read_config_json(config_path: Path, *, model: str) -> dict:
    """A config.json read as data that may be hostile (:func:`~hpc_hsdp.files.read_json`: a regular
    file of at most 16 MiB, nesting and numbers in range) whose sizes and counts are in range
    (:func:`~hpc_hsdp.models.hf_shapes.config_size_problem`); SpecError, one line."""
    try:
        values = parse_json(read_capped(config_path.resolve(), max_bytes=MAX_CONFIG_BYTES), where="it")
    except (OSError, ValueError) as exc:
        said = str(exc).replace(" written by hpc-hsdp", "").replace("; it was not", "; it is not a config.json")
        raise SpecError(f"--model {model!r}: cannot read {str(config_path)!r} as JSON ({said})") from None
    if not isinstance(values, dict):
        raise SpecError(f"--model {model!r}: {str(config_path)!r} is not a JSON object; give a config.json")
    problem = config_size_problem(values)
    if problem:
        raise SpecError(f"--model {model!r}: {str(config_path)!r}: {problem}; give a model's own config.json")
    return values


def _transformers():
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    quiet_library_imports()
    try:
        import transformers  # noqa: PLC0415 - loaded when a model is built
    except ImportError:
        raise SpecError("--model hf:... needs transformers on every task: pip install 'hpc-hsdp[hf]'") from None
    return transformers


def load_config(config_path: Path, *, model: str):
    """The transformers config of ``config_path``; a config that is not a causal LM is a SpecError."""
    read_config_json(config_path, model=model)  # bounded and its sizes in range, before transformers reads it
    transformers = _transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # noqa: PLC0415 - loaded when a model is built

    try:
        config = transformers.AutoConfig.from_pretrained(str(config_path), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SpecError(f"--model {model!r}: transformers cannot read {str(config_path)!r}: {first}") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise SpecError(
            f"--model {model!r}: {type(config).__name__} (model_type {config.model_type!r}) is not a causal language "
            f"model (no AutoModelForCausalLM class for it); give a decoder LM such as llama or gpt2"
        )
    return config


class HFAdapter:
    """:class:`~hpc_hsdp.models.base.ModelAdapter` of a transformers causal LM (see the module docstring)."""

    def __init__(self, training, *, data_vocab_size: int | None = None) -> None:
        self.name = training.model.name
        self.config_path, self.weights_dir = locate(training.model.name)
        self.config = load_config(self.config_path, model=self.name)
        self.vocab_size = int(self.config.vocab_size)
        self.shard_unit_option = training.model.shard_unit
        self._files = None
        self.has_pretrained_weights = self.weights_dir is not None
        check_data_vocabulary(
            self.name, model_vocab_size=self.vocab_size, data_vocab_size=data_vocab_size, fix=DATA_VOCABULARY_FIX
        )

    # ------------------------------------------------------------------ build and shard

    def build_meta(self):
        import torch  # noqa: PLC0415 - loaded when a model is built

        transformers = _transformers()
        with torch.device("meta"):
            try:
                return transformers.AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
            except TypeError:  # transformers < 4.56 names it torch_dtype
                return transformers.AutoModelForCausalLM.from_config(self.config, torch_dtype=torch.float32)

    def shard_units(self, model) -> tuple[type, ...]:
        from hpc_hsdp.models.weights import check_tied_parameters  # noqa: PLC0415 - weights imports torch

        if self.shard_unit_option:
            wanted = [n.strip() for n in self.shard_unit_option.split(",") if n.strip()]
            source = "--shard-unit"
        else:
            wanted = sorted(getattr(model, "_no_split_modules", None) or [])
            source = f"{type(model).__name__}._no_split_modules"
            if not wanted:
                raise SpecError(
                    f"--model {self.name!r}: {type(model).__name__} names no blocks to shard "
                    f"(_no_split_modules is empty); name them with --shard-unit CLASS"
                )
        units = classes_named(model, wanted, source=source, what=f"--model {self.name!r}")
        check_tied_parameters(model, units, what=f"--model {self.name!r}")
        return units

    # ------------------------------------------------------------------ values

    def _init_module_fn(self, fresh):
        from transformers import PreTrainedModel  # noqa: PLC0415 - loaded when a model is built

        owners: dict[str | None, Any] = {}  # name -> the transformers model whose init covers it
        for name, module in fresh.named_modules():
            parent = name.rpartition(".")[0] if name else None
            owners[name] = module if isinstance(module, PreTrainedModel) else owners.get(parent, fresh)

        def init_module(module, name):
            owner = owners[name]
            if hasattr(owner, "_initialize_weights"):
                owner._initialize_weights(module)
            else:
                owner._init_weights(module)

        return init_module

    def _initialise(self, model, *, seed: int, buffers_only: bool) -> None:
        from hpc_hsdp.models.weights import init_unit_by_unit  # noqa: PLC0415 - weights imports torch

        fresh = self.build_meta()
        units = self.shard_units(fresh)
        guard = _init_guard()
        with guard:
            init_unit_by_unit(
                model,
                fresh,
                units,
                seed=seed,
                init_module=self._init_module_fn(fresh),
                what=f"--model {self.name!r}",
                buffers_only=buffers_only,
            )

    def init_weights(self, model, *, seed: int) -> None:
        self._initialise(model, seed=seed, buffers_only=False)

    def load_pretrained(self, model) -> None:
        from hpc_hsdp.models.weights import load_safetensors_shards, safetensors_files  # noqa: PLC0415 - weights imports torch

        if self.weights_dir is None:
            raise SpecError(f"--model {self.name!r} has no safetensors weights to load")
        self._initialise(model, seed=0, buffers_only=True)  # non-persistent buffers are in no file
        files = safetensors_files(self.weights_dir)
        prefix = getattr(model, "base_model_prefix", "")
        load_safetensors_shards(
            model, files, what=f"--model {self.name!r}", strip_prefixes=(f"{prefix}.",) if prefix else ()
        )

    # ------------------------------------------------------------------ tensor parallelism

    def tp_plan(self, model, tp_size: int) -> dict | None:
        """The model's own tensor-parallel plan (transformers' ``model._tp_plan``, from its config's
        ``base_model_tp_plan``: the Llama family, Qwen2, Mistral, ...) as torch parallel styles, its
        ``*`` expanded to the blocks: attention and feed-forward split by heads and width, the input
        embedding and the LM head by vocabulary (both left whole where they are tied). None where the
        config carries no plan. SpecError where ``tp_size`` does not divide the heads, key/value
        heads, feed-forward width or vocabulary, or the plan names a style hpc-hsdp does not map."""
        wanted = dict(getattr(model, "_tp_plan", None) or {})
        if not wanted:
            base = getattr(self.config, "base_model_tp_plan", None) or {}
            prefix = getattr(model, "base_model_prefix", "")
            wanted = {f"{prefix}.{name}" if prefix else name: style for name, style in base.items()}
        if not wanted:
            return None
        refusal = hf_tp_refusal(self.config, tp_size, model=self.name)
        if refusal:
            raise SpecError(refusal)
        modules = dict(model.named_modules())
        if getattr(self.config, "tie_word_embeddings", False):  # one parameter: it cannot be split twice
            tied = {model.get_input_embeddings(), model.get_output_embeddings()}
            wanted = {name: style for name, style in wanted.items() if modules.get(name) not in tied}
        plan = {}
        for pattern, style in wanted.items():
            if style not in _TP_STYLES:
                raise SpecError(
                    f"--model {self.name!r}: its tensor-parallel plan splits {pattern} as {style!r}, which "
                    f"hpc-hsdp does not map (it maps {', '.join(_TP_STYLES)}); train it with --tp 1"
                )
            regex = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
            for name in modules:
                if regex.match(name):
                    plan[name] = _parallel_style(style)
        return plan

    # ------------------------------------------------------------------ the step

    def loss(self, model, inputs, targets):
        import torch.nn.functional as F  # noqa: PLC0415 - loaded when a model is built

        root_output_read_out_of_place(type(model).__name__)
        logits = model(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def logits(self, model, inputs):
        return model(input_ids=inputs, use_cache=False).logits

    # ------------------------------------------------------------------ records and export

    def describe(self) -> dict:
        """What run.json records about the model (export rebuilds it from this)."""
        return {
            "kind": "hf",
            "model": self.name,
            "config": self.config.to_dict(),
            "weights": str(self.weights_dir) if self.weights_dir else None,
        }


def model_from_config_dict(values: dict):
    """The causal LM of a config as ``config.to_dict()`` wrote it, on the meta device (export)."""
    import torch  # noqa: PLC0415 - loaded when a model is built

    transformers = _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: PLC0415 - loaded when a model is built

    config = CONFIG_MAPPING[values["model_type"]].from_dict(values)
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except TypeError:
            return transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


def _init_guard():
    try:
        from transformers.initialization import guard_torch_init_functions  # noqa: PLC0415 - loaded when a model is built
    except ImportError:  # transformers 4.x: its init functions have no guard to install
        return nullcontext()
    return guard_torch_init_functions()


def classes_named(model, names: list[str], *, source: str, what: str) -> tuple[type, ...]:
    """The module classes of ``model`` whose names are ``names`` (``Class`` or
    ``module.Class``); a name that matches no module, or the root's own class, is a SpecError."""
    present: dict[str, type] = {}
    for module in model.modules():
        cls = type(module)
        present.setdefault(cls.__name__, cls)
        present.setdefault(f"{cls.__module__}.{cls.__qualname__}", cls)
    found, unknown = [], []
    for name in names:
        if name in present:
            found.append(present[name])
        else:
            unknown.append(name)
    if unknown:
        blocks = sorted(
            {type(m).__name__ for m in model.modules() if m is not model and any(True for _ in m.children())}
        )
        raise SpecError(
            f"{what}: {source} names {', '.join(map(repr, unknown))}, which matches no module of "
            f"{type(model).__name__}; its composite modules are {', '.join(blocks[:12])}"
        )
    if type(model) in found:
        raise SpecError(
            f"{what}: {source} names the model's own class {type(model).__name__}; name its blocks "
            f"(the root is always wrapped last)"
        )
    return tuple(dict.fromkeys(found))


def read_shapes(training: ModelSettings):
    """``plan --model hf:PATH``: the model's :class:`~hpc_hsdp.models.hf_shapes.ModelShapes`
    and how they were found: from config.json by formula (no torch) for the Llama and GPT-2
    families, else by building the model on the meta device (imports torch and transformers)."""
    values = config_values(training.model.name)
    shapes = shapes_from_config(values)
    if shapes is not None:
        return shapes, "config.json formula (no torch)"
    from hpc_hsdp.models.weights import unit_names, unit_of  # noqa: PLC0415 - weights imports torch

    adapter = HFAdapter(training)
    meta = adapter.build_meta()
    units = adapter.shard_units(meta)
    names = unit_names(meta, units)
    out = tuple((n, tuple(p.shape), unit_of(n, names) == "") for n, p in meta.named_parameters())
    layers = sum(1 for m in meta.modules() if isinstance(m, units))
    shapes = ModelShapes(
        model_type=adapter.config.model_type,
        block_class=",".join(u.__name__ for u in units),
        layers=layers,
        shapes=out,
        tied=bool(_tied(meta)),
    )
    return shapes, "meta-device build (torch and transformers: no formula for this model_type)"


def _tied(model) -> list:
    from hpc_hsdp.models.weights import tied_groups  # noqa: PLC0415 - weights imports torch

    return tied_groups(model)


_TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")
"""transformers' plan styles that hpc-hsdp maps to torch's (:func:`_parallel_style`)."""


def _parallel_style(style: str):
    from torch.distributed.tensor import Replicate  # noqa: PLC0415 - only under --tp
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: PLC0415 - only under --tp

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "embedding_rowwise":  # the vocabulary's rows split, each token's vector summed back
        return RowwiseParallel(input_layouts=Replicate())
    return ColwiseParallel(output_layouts=Replicate())  # colwise_gather_output: the LM head


def hf_tp_refusal(config, tp_size: int, *, model: str) -> str | None:
    """Why a transformers config's model cannot be split over ``tp_size`` ranks (None: it can, or
    its family has no formula here): the one check of :func:`hpc_hsdp.plan.shapes.tp_refusal`."""
    dims = tp_dims_from_config(config.to_dict(), model=model)
    return tp_refusal(dims, tp_size) if dims is not None else None
