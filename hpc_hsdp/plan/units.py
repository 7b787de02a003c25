"""Numbers, bytes and durations as text: every formatter of the package, in one place (pure).

The lowest layer (no torch, nothing of the package): ``plan``, ``data``, ``rundir``,
``report`` and ``runtime`` all print through it, so one quantity reads alike everywhere.

- :func:`format_bytes`: binary, two decimals (``3.50 GiB``): plans and estimates.
- :func:`byte_unit`: the binary unit that suits a set of values (a chart's axis).
- :func:`human_bytes`, :func:`human_count`: decimal (``1.2 MB``, ``3.40M``): progress lines.
- :func:`si`: three significant digits and a decimal suffix (``1.23M``): chart ticks.
- :func:`seconds`: ``12.5 ms`` or ``1.2 s`` (a step's time); :func:`duration`: ``1h02m`` (time left).
- :func:`terminal_safe`: text from a file, fit for a terminal (its control characters escaped).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

BINARY_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
"""The binary byte units, largest first."""

SI_SUFFIXES = (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3))


def format_bytes(n: float) -> str:
    """``3758096384`` -> ``3.50 GiB``; below 1 KiB whole bytes (``512 B``)."""
    for unit, size in BINARY_UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def byte_unit(values: Iterable[float]) -> tuple[float, str]:
    """The binary unit that suits the largest of ``values``: (bytes per unit, name); ``bytes`` below 1 KiB."""
    top = max((abs(v) for v in values), default=0)
    for unit, size in BINARY_UNITS:
        if top >= size:
            return size, unit
    return 1, "bytes"


def human_bytes(n: float) -> str:
    """Decimal: ``1234567`` -> ``1.2 MB``; below 1000 whole bytes; TB the largest unit."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_count(n: float) -> str:
    """Decimal: ``3400000`` -> ``3.40M``; below 1000 a whole number; G the largest unit."""
    for unit in ("", "K", "M", "G"):
        if n < 1000 or unit == "G":
            return f"{n:.0f}{unit}" if not unit else f"{n:.2f}{unit}"
        n /= 1000
    return f"{n:.2f}G"


def si(value: float) -> str:
    """``1234567`` -> ``1.23M``; small numbers keep 3 significant digits."""
    if value == 0:
        return "0"
    for suffix, factor in SI_SUFFIXES:
        if abs(value) >= factor:
            return f"{value / factor:.3g}{suffix}"
    return f"{value:.3g}"


def seconds(value: float) -> str:
    """``0.0125`` -> ``12.5 ms``; from one second on ``1.2 s`` (3 significant digits)."""
    return f"{value * 1000:.3g} ms" if abs(value) < 1 else f"{value:.3g} s"


def duration(secs: float | None) -> str:
    """``3725`` -> ``1h02m``; ``75`` -> ``1m15s``; ``9.4`` -> ``9s``; None or not finite -> ``?``."""
    if secs is None or not math.isfinite(secs):
        return "?"
    secs = max(0, int(round(secs)))
    days, rest = divmod(secs, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, rest = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{rest:02d}s"
    return f"{rest}s"


_CONTROLS = "\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_UNSAFE_LINE = re.compile(f"[\n{_CONTROLS}]")
_UNSAFE_LINES = re.compile(f"[{_CONTROLS}]")


def terminal_safe(text: str, *, lines: bool = False) -> str:
    """``text`` with every character that a terminal obeys rather than shows written as an
    escape (``\\x1b``, ``\\u202e``): ESC and the other C0 and C1 controls (colours, a cursor
    moved, a title set, a line rewritten by a carriage return), DEL, and Unicode's line
    separators and direction overrides. Tabs stay; newlines stay with ``lines``. For what a
    run's files (``replicas.jsonl``, ``restarts.jsonl``, flight-recorder dumps, logs) put into
    what ``status`` and ``runs`` print."""
    pattern = _UNSAFE_LINES if lines else _UNSAFE_LINE
    return pattern.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}", text
    )
