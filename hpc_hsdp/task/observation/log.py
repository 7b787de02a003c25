"""The runtime's one logger: ``logging.getLogger("hpc_hsdp")``.

What the tasks say about themselves (the rank's start line, checkpoints, stops, hangs, damaged
checkpoints, lost nodes) goes through it as ``[hpc-hsdp] <message>`` lines: :func:`note` to
stderr, :func:`say` to stdout (the child logger ``hpc_hsdp.stdout``). The handlers look
``sys.stderr``/``sys.stdout`` up at each line and flush it, so a task whose streams were
redirected after start-up (a forked test task, submitit) logs where it prints. ``configure``
installs them once per process; the first line configures it when nobody did.
"""

from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("hpc_hsdp")
_STDOUT = logging.getLogger("hpc_hsdp.stdout")
TAG = "[hpc-hsdp] "


class _CurrentStream(logging.Handler):
    """Writes each line to ``sys.<name>`` as it is at that moment, then flushes it."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.INFO)
        self.stream_name = name

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = getattr(sys, self.stream_name)
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging must never end a task
            self.handleError(record)


class _Tagged(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        return text if getattr(record, "bare", False) else TAG + text


def configure() -> logging.Logger:
    """Install the handlers (once; later calls change nothing)."""
    for logger, stream in ((LOGGER, "stderr"), (_STDOUT, "stdout")):
        if not any(isinstance(h, _CurrentStream) for h in logger.handlers):
            handler = _CurrentStream(stream)
            handler.setFormatter(_Tagged())
            logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # an application's root handlers would print every line twice
    return LOGGER


def note(message: str, *, tag: bool = True) -> None:
    """One line on stderr: ``[hpc-hsdp] message`` (``tag=False``: the message alone)."""
    if not LOGGER.handlers:
        configure()
    LOGGER.info(message, extra={"bare": not tag})


def say(message: str, *, tag: bool = True) -> None:
    """One line on stdout, as :func:`note`."""
    if not _STDOUT.handlers:
        configure()
    _STDOUT.info(message, extra={"bare": not tag})
