"""What transformers, torchao and torch print that says nothing to a user of hpc-hsdp, kept out of
the job's logs and ``export``'s output; everything else they print still reaches the logs.

- torchao, imported by transformers whenever it is installed, tries to load its CUDA kernels
  (``_C_mxfp8``, ``_C_cutlass_*``) and logs a failure per file on CPU or another CUDA build; the float8
  training hpc-hsdp does (tensorwise ``Float8Linear``) never calls them.
- torchao registers Enum classes with ``torch.utils._pytree``, which logs a deprecation per class.
- FSDP2 warns that the root module returned a view tensor; an adapter that reads the root output out
  of place (:func:`root_output_read_out_of_place`) says so for its class.
- ``dcp.load(no_dist=True)`` warns that it loads in one process, which ``export`` asked for.
- transformers draws progress bars while it writes a model, as carriage-return lines in a log file.
"""

from __future__ import annotations

import logging
import re
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache


class _DropMessages(logging.Filter):
    """Drops the records of one logger whose message contains every part of one of ``messages``."""

    def __init__(self, *messages: tuple[str, ...]) -> None:
        super().__init__()
        self.messages = messages

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(all(part in text for part in parts) for parts in self.messages)


@cache
def quiet_library_imports() -> None:
    """Before transformers or torchao is imported (once per process): their import-time noise dropped."""
    logging.getLogger("torchao").addFilter(
        _DropMessages(("Failed to load ", "torchao/_C", "Could not load this library"))
    )
    logging.getLogger("torch.utils._pytree").addFilter(
        _DropMessages(("is an Enum subclass and is now natively supported by torch.compile",))
    )


@cache
def root_output_read_out_of_place(module_class: str) -> None:
    """FSDP2's "returned a view tensor" warning silenced for the root module ``module_class`` (its
    FSDP class name), whose output its adapter reads only out of place (no ``+=`` on the logits)."""
    warnings.filterwarnings(
        "ignore",
        message=rf"FSDP2-wrapped module \({re.escape(module_class)}\) returned a view tensor",
        category=UserWarning,
    )


@contextmanager
def single_process_load() -> Iterator[None]:
    """Around ``dcp.load(..., no_dist=True)``: its warning that it loads in a single process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


@contextmanager
def progress_bars_on_a_terminal() -> Iterator[None]:
    """Around a transformers save: its progress bars only where stderr is a terminal."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 - transformers is loaded by the caller

    if sys.stderr.isatty() or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()
