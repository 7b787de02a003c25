"""Models the training loop can train: one small interface (:class:`ModelAdapter` in
:mod:`hpc_hsdp.models.base`), one entry per kind of model (``builtin``, ``hf:PATH``,
``MODULE:FUNCTION``), chosen by :func:`resolve_model`.

Importing this package imports no torch; each adapter module imports it on the task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_hsdp.models.base import ModelAdapter, ModelSettings


def resolve_model(training: ModelSettings, *, data_vocab_size: int | None = None) -> ModelAdapter:
    """The adapter for ``training.model.name``: ``builtin`` -> :mod:`hpc_hsdp.models.builtin`,
    ``hf:PATH`` -> ``hpc_hsdp.models.hf.HFAdapter``, ``MODULE:FUNCTION`` ->
    ``hpc_hsdp.models.factory.FactoryAdapter`` (each imported only when chosen).
    ``data_vocab_size``: the dataset's vocabulary (None: synthetic data); the built-in
    model takes it, the others check against it."""
    model = training.model.name
    if model == "builtin":
        from hpc_hsdp.models.builtin import BuiltinAdapter  # noqa: PLC0415 - each adapter imports torch; resolving one is on the task

        return BuiltinAdapter.from_training(training, data_vocab_size=data_vocab_size)
    if model.startswith("hf:"):
        from hpc_hsdp.models.hf import HFAdapter  # noqa: PLC0415 - each adapter imports torch; resolving one is on the task

        return HFAdapter(training, data_vocab_size=data_vocab_size)
    from hpc_hsdp.models.factory import FactoryAdapter  # noqa: PLC0415 - each adapter imports torch; resolving one is on the task

    return FactoryAdapter(training, data_vocab_size=data_vocab_size)
