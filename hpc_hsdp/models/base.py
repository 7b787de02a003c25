"""The interface between the training loop and a model.

The loop (``hpc_hsdp.task.training.loop``) knows nothing of a model but this: it asks the
adapter to build the module on the meta device, wraps every module of the adapter's
shard-unit classes with ``fully_shard`` (then the root) on the ``("replicate", "shard")``
mesh, materializes it with ``to_empty``, and asks the adapter to initialise (or load)
the weights. Each step it calls ``adapter.loss(model, inputs, targets)``.

Contract for every adapter:

- ``build_meta()`` returns the full model on the meta device (no memory, no I/O).
- ``shard_units(model)`` returns the classes whose instances become FSDP units
  (transformer blocks); it never returns the root's class.
- ``init_weights(model, seed)`` runs after ``to_empty`` on the sharded model (DTensor
  parameters) and gives every parameter a value that depends on the seed and the
  parameter's name only, never on the mesh shape: a (2, 2) and a (1, 4) mesh start
  from the same model.
- ``load_pretrained(model)`` (adapters with weights only) places the pretrained weights
  into the sharded parameters without any rank holding the whole model unless it must.
- ``loss(model, inputs, targets)``: mean cross-entropy over all tokens of the
  micro-batch, computed in fp32; ``inputs``/``targets`` are int64 ``(batch, seq_len)``.
- ``vocab_size``: the model's vocabulary; the loop checks the data against it before
  step 1.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from hpc_hsdp.errors import SpecError

if TYPE_CHECKING:
    import torch
    from torch import nn


class ModelOptions(Protocol):
    """The model section of the training options (``training.model``)."""

    @property
    def name(self) -> str:
        """``builtin``, ``hf:PATH`` or ``MODULE:FUNCTION``."""
        ...

    @property
    def shard_unit(self) -> str | None: ...
    @property
    def layers(self) -> int: ...
    @property
    def width(self) -> int: ...
    @property
    def heads(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


class DatasetOptions(Protocol):
    """What a model reads of the dataset section (``training.dataset``)."""

    @property
    def seq_len(self) -> int: ...


class ModelSettings(Protocol):
    """What a model reads of the run's training options. A :class:`~hpc_hsdp.job.spec.TrainingSpec`
    is one; the models package names only these attributes, so it does not depend on the job layer."""

    @property
    def model(self) -> ModelOptions: ...
    @property
    def dataset(self) -> DatasetOptions: ...


@runtime_checkable
class ModelAdapter(Protocol):
    name: str
    """What ``--model`` said (``builtin``, ``hf:/path``, ``pkg.mod:fn``); for messages and checkpoints."""
    vocab_size: int
    has_pretrained_weights: bool

    def build_meta(self) -> nn.Module: ...

    def shard_units(self, model: nn.Module) -> tuple[type, ...]: ...

    def init_weights(self, model: nn.Module, *, seed: int) -> None: ...

    def load_pretrained(self, model: nn.Module) -> None: ...

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor: ...


_IMPORT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def split_import_name(option: str, value: object) -> tuple[str, str]:
    """``module.path:function`` -> (module, function), identifiers only: the name is imported
    (``importlib``) and looked up (``getattr``), never evaluated. A value from a config or a
    job file of another form (an expression, a path, ``os.system('...')``) is refused here,
    before anything is imported."""
    if not isinstance(value, str) or not _IMPORT_NAME.match(value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise SpecError(f"{option} {shown} is not module:function (Python identifiers); write e.g. 'mypkg.train:main'")
    module, _, function = value.partition(":")
    return module, function


def check_data_vocabulary(model: str, *, model_vocab_size: int, data_vocab_size: int | None, fix: str) -> None:
    """Refuse data whose tokenizer has more ids than the model's embedding (SpecError, exit 2);
    ``fix`` says how, in the words of the model kind. The loop's ``check_data`` then checks the
    largest token id actually present."""
    if data_vocab_size is not None and data_vocab_size > model_vocab_size:
        raise SpecError(
            f"--model {model!r} has a vocabulary of {model_vocab_size} tokens but the data's tokenizer has "
            f"{data_vocab_size}{fix}"
        )
