"""One part of ``hpc-hsdp status``, declared once beside the record it reads (as
:mod:`hpc_hsdp.report.charts` declares each chart): its name, the reader of its record, its
lines of the text and its keys of ``--json``.

Each run-directory module that ``status`` shows declares its own ``STATUS_SECTION``;
:mod:`hpc_hsdp.submit_host.status_sections` adds the job's own (its state, step, pace, failure) and
lists them all in the order the command prints them. A record added to ``status`` is one
section here and one name in that list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class RunView(Protocol):
    """What a section reads from: the run directory, and its newest metrics record, read once
    for every section."""

    @property
    def run_dir(self) -> str: ...

    @property
    def last_metrics(self) -> dict | None: ...


View = TypeVar("View", contravariant=True)
Value = TypeVar("Value")


@dataclass(frozen=True, kw_only=True)
class StatusSection(Generic[View, Value]):
    name: str
    read: Callable[[View], Value]
    """The section's record, read from the view; a missing, damaged or hostile one reads as
    nothing to say, never as an error."""
    lines: Callable[[Value], Sequence[str]]
    """Its lines of ``status``'s text, none when there is nothing to say (the command escapes
    their control characters)."""
    fields: Callable[[Value], Mapping[str, object]] | None = None
    """Its keys of ``status --json``, in order; None: a text-only section, not read for the dump."""
