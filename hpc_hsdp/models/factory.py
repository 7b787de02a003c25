"""``--model MODULE:FUNCTION``: your own ``nn.Module`` under the same loop.

The contract, in full::

    # mypkg/models.py  (importable on every task: installed, or on PYTHONPATH)
    class Block(nn.Module): ...

    class MyLM(nn.Module):
        shard_units = (Block,)              # 1. the blocks each wrapped with fully_shard
        vocab_size = 32000                  # 2. checked against the data before step 1
        def forward(self, inputs):          # 3. (batch, seq) int64 -> logits (batch, seq, vocab)
            ...
        # optional: def loss(self, inputs, targets) -> scalar tensor, instead of 3.

    def build(training):                    # --model mypkg.models:build
        return MyLM(layers=training.model.layers, width=training.model.width)

1. **Building.** The function is called with the run's ``TrainingSpec`` (``--layers``,
   ``--width``, ... are yours to use; with ``--data`` its ``vocab_size`` is the data's) or with no argument if it takes none. It builds the
   module on the *current default device*: the loop calls it under
   ``torch.device("meta")`` (no memory), shards it, then materializes it. It may return
   ``(module, shard_units)`` instead of setting the attribute.
2. **Shard units**: classes (or class names) whose instances become FSDP units, from the
   returned pair, else ``module.shard_units``, else transformers-style
   ``module._no_split_modules``; ``--shard-unit CLASS[,CLASS]`` overrides them all.
   Without any, the whole model is one unit (allowed, but every step then gathers it whole).
3. **Loss.** ``module.loss(inputs, targets)`` when the module has it (it is called through
   FSDP, like ``forward``); otherwise ``forward(inputs)`` returns logits (a tensor, or an
   object with ``.logits``) and the loop takes the cross-entropy against ``targets`` in
   fp32, mean over all tokens. ``targets`` are the inputs shifted by one already.
4. **Vocabulary**: ``module.vocab_size``, else ``module.config.vocab_size``, else the
   first ``nn.Embedding``'s number of rows.
5. **Initialisation**, deterministic and the same on every mesh shape: each module's own
   ``reset_parameters()`` (what torch's layers do on construction), then, if the model
   has one, ``model.init_module(module)``, per module under an RNG seeded by
   ``(--seed, module name)``, one FSDP unit at a time (:mod:`hpc_hsdp.models.weights`).
   A parameter neither of them sets is an error that names it.
6. Tied parameters must lie in one FSDP unit (e.g. a head tied to the embedding, both
   in the root), else they are refused.
7. **Tensor parallelism** (``--tp T``): ``module.tp_plan(tp_size)`` (or a ``tp_plan`` dict)
   returns module name -> ``torch.distributed.tensor.parallel`` style (``ColwiseParallel``,
   ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``), applied on the tp axis
   before FSDP2; raise ``hpc_hsdp.errors.SpecError`` where ``tp_size`` does not divide the model.
   The forward must work on the local shards (e.g. heads from the split's width, not the
   config's). Set ``loss_parallel = True`` on the module where the plan leaves the logits a
   DTensor sharded over the vocabulary (``ColwiseParallel(output_layouts=Shard(-1),
   use_local_output=False)``): the loss then runs on the shards. Without a plan, ``--tp`` > 1 is
   refused naming the model.

Export writes one ``model.safetensors`` file of the full state (tied names once).

Importing this module loads no torch (``plan`` and submit's checks use it); torch loads when
the model is built.
"""

from __future__ import annotations

import importlib
import inspect

from hpc_hsdp.errors import SpecError
from hpc_hsdp.models.base import ModelSettings, check_data_vocabulary, split_import_name
from hpc_hsdp.models.hf import classes_named
from hpc_hsdp.models.hf_shapes import ModelShapes


def resolve_factory(model: str):
    """``MODULE:FUNCTION`` -> the function (imported now, so a typo fails before training)."""
    module_name, attribute = split_import_name("--model", model)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(
            f"--model {model!r}: cannot import module {module_name!r} ({exc}); check PYTHONPATH on the nodes"
        ) from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise SpecError(f"--model {model!r}: module {module_name!r} has no function {attribute!r}")
    return fn


class FactoryAdapter:
    """:class:`~hpc_hsdp.models.base.ModelAdapter` of a user's factory (see the module docstring)."""

    has_pretrained_weights = False

    def __init__(self, training, *, data_vocab_size: int | None = None) -> None:
        self.name = training.model.name
        if data_vocab_size is not None and training.model.vocab_size != data_vocab_size:
            training = training.replace(vocab_size=data_vocab_size)  # the data's, as the built-in model
        self.training = training
        self.factory = resolve_factory(training.model.name)
        self.shard_unit_option = training.model.shard_unit
        probe, self._declared_units = self._call()
        self.vocab_size = _vocab_size(probe, what=f"--model {self.name!r}")
        check_data_vocabulary(
            self.name,
            model_vocab_size=self.vocab_size,
            data_vocab_size=data_vocab_size,
            fix=f"; build the model with vocab_size >= {data_vocab_size} (training.model.vocab_size is "
            f"the data's when --data is given)",
        )

    def _call(self):
        import torch  # noqa: PLC0415 - loaded when a model is built
        from torch import nn  # noqa: PLC0415 - loaded when a model is built

        try:
            takes_spec = len(inspect.signature(self.factory).parameters) > 0
        except (TypeError, ValueError):
            takes_spec = False
        with torch.device("meta"):
            made = self.factory(self.training) if takes_spec else self.factory()
        units = None
        if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module):
            made, units = made
        if not isinstance(made, nn.Module):
            raise SpecError(
                f"--model {self.name!r} returned {type(made).__name__}, not a torch.nn.Module (or a "
                f"(module, shard_units) pair)"
            )
        return made, units

    def build_meta(self):
        model, self._declared_units = self._call()
        return model

    def shard_units(self, model) -> tuple[type, ...]:
        from hpc_hsdp.models.weights import check_tied_parameters  # noqa: PLC0415 - weights imports torch

        what = f"--model {self.name!r}"
        if self.shard_unit_option:
            wanted, source = [n.strip() for n in self.shard_unit_option.split(",") if n.strip()], "--shard-unit"
        else:
            declared = self._declared_units
            if declared is None:
                declared = getattr(model, "shard_units", None)
            if declared is None:
                declared = sorted(getattr(model, "_no_split_modules", None) or [])
            if isinstance(declared, (type, str)):
                declared = (declared,)
            wanted, source = [c if isinstance(c, str) else c.__name__ for c in declared], "the factory's shard units"
            classes = [c for c in declared if isinstance(c, type)]
            if classes and len(classes) == len(declared):
                present = {type(m) for m in model.modules()}
                absent = [c.__name__ for c in classes if c not in present]
                if absent:
                    raise SpecError(f"{what}: {source} name {', '.join(absent)}, which the model does not contain")
                if type(model) in classes:
                    raise SpecError(f"{what}: {source} name the model's own class; name its blocks")
                check_tied_parameters(model, tuple(classes), what=what)
                return tuple(classes)
        units = classes_named(model, wanted, source=source, what=what) if wanted else ()
        check_tied_parameters(model, units, what=what)
        return units

    def init_weights(self, model, *, seed: int) -> None:
        from hpc_hsdp.models.weights import init_unit_by_unit  # noqa: PLC0415 - weights imports torch

        fresh = self.build_meta()
        root_init = getattr(fresh, "init_module", None)

        def init_module(module, name):
            if hasattr(module, "reset_parameters") and (module._parameters or module._buffers):
                module.reset_parameters()
            if callable(root_init):
                root_init(module)

        init_unit_by_unit(
            model, fresh, self.shard_units(fresh), seed=seed, init_module=init_module, what=f"--model {self.name!r}"
        )

    def load_pretrained(self, model) -> None:
        raise SpecError(
            f"--model {self.name!r}: a factory has no pretrained weights to load; load them in the "
            f"factory's init_module or in your own loop (hpc_hsdp.train_api)"
        )

    def loss(self, model, inputs, targets):
        import torch.nn.functional as F  # noqa: PLC0415 - loaded when a model is built

        if callable(getattr(model, "loss", None)):
            from hpc_hsdp.models.weights import fsdp_forward_method  # noqa: PLC0415 - weights imports torch

            fsdp_forward_method(model, "loss")
            return model.loss(inputs, targets)
        logits = self.logits(model, inputs)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def logits(self, model, inputs):
        out = model(inputs)
        return getattr(out, "logits", out)

    def tp_plan(self, model, tp_size: int) -> dict | None:
        """The module's own tensor-parallel plan (contract item 7): ``model.tp_plan(tp_size)`` or a
        ``tp_plan`` dict; None without one (``--tp`` > 1 is then refused naming the model)."""
        plan = getattr(model, "tp_plan", None)
        if callable(plan):
            plan = plan(tp_size)
        if plan is not None and not isinstance(plan, dict):
            raise SpecError(
                f"--model {self.name!r}: tp_plan gave {type(plan).__name__}, not a dict of module name -> "
                f"torch.distributed.tensor.parallel style"
            )
        self.loss_parallel = bool(getattr(model, "loss_parallel", False))
        return plan

    loss_parallel = False
    """True where the model's plan leaves the logits sharded over the vocabulary (its ``loss_parallel``)."""

    def describe(self) -> dict:
        return {"kind": "factory", "model": self.name}


def _vocab_size(model, *, what: str) -> int:
    from torch import nn  # noqa: PLC0415 - loaded when a model is built

    value = getattr(model, "vocab_size", None)
    if value is None:
        value = getattr(getattr(model, "config", None), "vocab_size", None)
    if value is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        value = embedding.num_embeddings if embedding is not None else None
    if not isinstance(value, int) or value < 1:
        raise SpecError(f"{what}: cannot tell the model's vocabulary; give the module a vocab_size attribute")
    return value


def read_shapes(training: ModelSettings):
    """``plan --model MODULE:FUNCTION``: the factory's model built on the meta device (torch)."""
    from hpc_hsdp.models.weights import tied_groups, unit_names, unit_of  # noqa: PLC0415 - weights imports torch

    adapter = FactoryAdapter(training)
    meta = adapter.build_meta()
    units = adapter.shard_units(meta)
    names = unit_names(meta, units)
    shapes = tuple((n, tuple(p.shape), unit_of(n, names) == "") for n, p in meta.named_parameters())
    layers = sum(1 for m in meta.modules() if units and isinstance(m, units))
    return (
        ModelShapes(
            model_type=type(meta).__name__,
            block_class=",".join(u.__name__ for u in units) or "none",
            layers=layers,
            shapes=shapes,
            tied=bool(tied_groups(meta)),
        ),
        "meta-device build of the factory (torch)",
    )
