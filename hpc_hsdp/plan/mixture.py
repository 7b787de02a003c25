"""A data mixture, ``--data web=DIR:0.7,code=DIR:0.3``: parsed, checked and apportioned. Pure.

The value of ``--data`` is either one token dataset (a path) or a mixture: comma-separated
``NAME=PATH:WEIGHT`` items (a name of letters, digits, ``_`` and ``-``; the weight after the
last colon of the item, a positive number; the weights are normalised to sum 1). A value is a
mixture when it starts with ``NAME=``.

How the rows of a step's global batch of ``G`` samples split over the sources is a pure
function of the step (:func:`rows_after`): after ``k`` steps, source ``s`` (every source but
the heaviest, the *absorber*) has given ``floor(k * G * w_s)`` rows, exactly, in rational
arithmetic; the absorber gives the rest. So every source's share after any number of steps is
within one row of its weight (the absorber's within ``S - 1`` rows), the counts of a step
depend on nothing but its number, and a resumed run draws the very rows it would have. That
no step gives a negative count is checked once (:func:`check_batch`): it needs a global batch
that holds, beside the absorber's share, every other source's share rounded up.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.records import record

if TYPE_CHECKING:
    from fractions import Fraction

_NAME = r"^[A-Za-z0-9_-]+$"
_MIXTURE = r"^[A-Za-z0-9_-]+="
EXAMPLE = "--data web=data/web:0.7,code=data/code:0.3"


@record(kw_only=False)
class Source:
    """One source of a mixture: its name (in metrics: ``loss/NAME``), its token dataset and its
    weight as given (:attr:`Mixture.shares` are the normalised ones)."""

    name: str
    path: str
    weight: Fraction
    weight_text: str = ""
    """The weight as written (kept, so that the value reaches the tasks unchanged)."""


@record(kw_only=False)
class Mixture:
    """``--data NAME=PATH:WEIGHT,...``: the sources, in the order given."""

    sources: tuple[Source, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.sources)

    @property
    def shares(self) -> tuple[Fraction, ...]:
        """The weights normalised to sum 1, exactly."""
        total = sum(s.weight for s in self.sources)
        return tuple(s.weight / total for s in self.sources)

    @property
    def absorber(self) -> int:
        """The source that takes what the others' rounding leaves: the heaviest (the first of equals)."""
        shares = self.shares
        return max(range(len(shares)), key=lambda i: (shares[i], -i))

    def format(self) -> str:
        return ",".join(f"{s.name}={s.path}:{s.weight_text or s.weight}" for s in self.sources)

    def with_paths(self, absolute: Callable[[str], str]) -> Mixture:
        return Mixture(tuple(Source(s.name, absolute(s.path), s.weight, s.weight_text) for s in self.sources))


def is_mixture(value: object) -> bool:
    return isinstance(value, str) and bool(re.match(_MIXTURE, value))


def parse_mixture(value: str, *, flag: str = "--data") -> Mixture:
    """``NAME=PATH:WEIGHT,...`` -> Mixture; SpecError (one line, exit 2) on a bad item, a
    weight that is not a positive number, or a name given twice."""
    from fractions import Fraction  # noqa: PLC0415 - fractions imports decimal (milliseconds): only a mixture needs it, not every CLI start

    sources: list[Source] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            raise SpecError(f"{flag} {value!r} has an empty item; write NAME=PATH:WEIGHT items joined by commas")
        name, equals, rest = item.partition("=")
        path, colon, weight_text = rest.rpartition(":")
        if not equals or not colon or not path:
            raise SpecError(f"{flag} item {item!r} is not NAME=PATH:WEIGHT; e.g. {EXAMPLE}")
        if not re.match(_NAME, name):
            raise SpecError(f"{flag} source name {name!r}: use letters, digits, _ and - (it names metrics: loss/NAME)")
        try:
            weight = Fraction(weight_text.strip())
        except (ValueError, ZeroDivisionError):
            raise SpecError(f"{flag} source {name}: weight {weight_text!r} is not a number; e.g. {EXAMPLE}") from None
        if not weight > 0:
            raise SpecError(
                f"{flag} source {name}: weight {weight_text} must be positive (leave the source out instead)"
            )
        if any(s.name == name for s in sources):
            raise SpecError(f"{flag} names source {name!r} twice; give each source once, with one weight")
        sources.append(Source(name, path, weight, weight_text.strip()))
    return Mixture(tuple(sources))


def map_data_paths(value: str | None, absolute: Callable[[str], str]) -> str | None:
    """``--data``'s value with its path (or each source's) made absolute by ``absolute``."""
    if value is None:
        return value
    if is_mixture(value):
        return parse_mixture(value).with_paths(absolute).format()
    return absolute(value)


def data_paths(value: str) -> list[tuple[str | None, str]]:
    """(source name or None for a single dataset, path) of every dataset ``--data`` names."""
    if is_mixture(value):
        return [(s.name, s.path) for s in parse_mixture(value).sources]
    return [(None, value)]


# ---------------------------------------------------------------------------- apportionment


def rows_after(mixture: Mixture, steps: int, global_batch: int) -> tuple[int, ...]:
    """Rows each source has given after ``steps`` steps of ``global_batch`` rows (see the
    module docstring): non-decreasing in ``steps`` once :func:`check_batch` passed."""
    total = steps * global_batch
    counts = [math.floor(total * share) for share in mixture.shares]
    absorber = mixture.absorber
    counts[absorber] = total - (sum(counts) - counts[absorber])
    return tuple(counts)


def rows_of_step(mixture: Mixture, step: int, global_batch: int) -> tuple[int, ...]:
    """Rows of each source in the global batch of ``step`` (1-based)."""
    after, before = rows_after(mixture, step, global_batch), rows_after(mixture, step - 1, global_batch)
    return tuple(a - b for a, b in zip(after, before))


def min_global_batch(mixture: Mixture) -> int:
    """The smallest global batch in which no step can give a source a negative count."""
    batch = 1
    while not _batch_fits(mixture, batch):
        batch += 1
    return batch


def _batch_fits(mixture: Mixture, batch: int) -> bool:
    absorber = mixture.absorber
    others = sum(math.ceil(batch * share) for i, share in enumerate(mixture.shares) if i != absorber)
    return others <= batch


def check_batch(mixture: Mixture, global_batch: int) -> None:
    if not _batch_fits(mixture, global_batch):
        raise SpecError(
            f"--data mixture of {len(mixture.sources)} sources ({', '.join(mixture.names)}): a global batch of "
            f"{global_batch} samples cannot hold every source's share in every step; use a global batch of at "
            f"least {min_global_batch(mixture)} (--batch-size, --global-batch-size)"
        )


def steps_until_used_once(mixture: Mixture, num_samples: tuple[int, ...], global_batch: int) -> tuple[int, ...]:
    """For each source, the first step after which it has given as many rows as it has
    samples (one epoch of it): the least ``k`` with ``rows_after(k)[s] >= num_samples[s]``."""
    out = []
    for index, (share, samples) in enumerate(zip(mixture.shares, num_samples)):
        guess = max(1, math.ceil(samples / (global_batch * share)) - len(mixture.sources) - 1)
        while guess > 1 and rows_after(mixture, guess - 1, global_batch)[index] >= samples:
            guess -= 1
        while rows_after(mixture, guess, global_batch)[index] < samples:
            guess += 1
        out.append(guess)
    return tuple(out)


def used_once_text(mixture: Mixture, num_samples: tuple[int, ...], global_batch: int, steps: int) -> str:
    """One line: after how many steps each source has been used once, against ``steps``."""
    after = steps_until_used_once(mixture, num_samples, global_batch)
    parts = []
    for source, share, samples, step in zip(mixture.sources, mixture.shares, num_samples, after):
        passes = rows_after(mixture, steps, global_batch)[mixture.sources.index(source)] / samples
        parts.append(
            f"{source.name} ({float(share):.0%} of each batch, {samples:,} samples) once after {step:,} steps "
            f"({passes:.2f} passes in --steps {steps:,})"
        )
    return f"data mixture: {'; '.join(parts)}; a source used up wraps, reshuffled"
