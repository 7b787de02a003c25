"""Sweeps: ``--sweep KEY=V1,V2 ...`` -> the points of one job array (pure: no scheduler, no files).

A sweep names job options and their values (``--sweep lr=3e-4,1e-3 --sweep seed=0,1``); its
points are their cross product (``--sweep-mode grid``) or the values paired in order
(``zip``). Each value is read as the option's command line would read it (its kind, its
choices), then the point's whole JobSpec is made and checked as one submission's is: a bad
value is refused, naming the point, before anything is written. Every point is a whole job
of its own (its run directory ``<sweep-dir>/<point name>``), and a task of a SLURM job array.
One job array has one ``#SBATCH`` header: the points are grouped by theirs (:func:`group_by_header`),
one array per distinct header, so that an option that changes it (``--nodes``, ``--time``,
``--partition`` ...) can be swept too. Within its array a point's task id is its place among the
points of that header (0, 1, ...): where every point shares one header, its index in the sweep.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.options import OPTION_BY_KEY, JobOption, options_of
from hpc_hsdp.rundir.lifecycle.sweep_record import MAX_POINTS

SWEEP_MODES = ("grid", "zip")
UNSWEPT = ("config", "profile", "run_dir", "cluster", "sweep", "sweep_mode", "array_parallelism")
"""Options no sweep varies: the config file and its profile (read once, for every point), the
run directory (each point's is ``<sweep-dir>/<point name>``) and the sweep's own."""
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_NAME_SAFE = r"[^A-Za-z0-9._=,+@-]+"
MAX_NAME = 120


@dataclass(frozen=True)
class Axis:
    """One ``--sweep KEY=V1,V2``: the option and its values, as given and as the command line reads them."""

    option: JobOption
    texts: tuple[str, ...]
    values: tuple[Any, ...]

    @property
    def key(self) -> str:
        return self.option.key


@dataclass(frozen=True)
class Point:
    """One point of a sweep: its index (the array task id), name (its run directory's) and values."""

    index: int
    name: str
    texts: tuple[tuple[str, str], ...]
    """(option key, the value as given), in the order of the ``--sweep`` options."""
    values: Mapping[str, Any]
    """option key -> the value as the command line reads it."""


def sweepable() -> dict[str, JobOption]:
    """The options a sweep may vary: those of ``submit`` that go into a JobSpec, but the config, profile and run directory."""
    return {o.key: o for o in options_of("submit") if o.in_config and o.key not in UNSWEPT}


def check_sweep_given(spec, given: Mapping[str, Any]) -> None:
    """``--array-parallelism`` or ``--sweep-mode`` on a command line (or as keywords) without a sweep
    bounds nothing: SpecError, rather than a job that quietly ignores them. A config file's value
    may stand for the sweeps its jobs make, so only what this call gave is refused."""
    if spec.sweep:
        return
    for key in ("array_parallelism", "sweep_mode"):
        if given.get(key) is not None:
            flag = OPTION_BY_KEY[key].flag
            raise SpecError(
                f"{flag} {given[key]} applies to a sweep, and this job has none: drop {flag}, or sweep an "
                f"option (--sweep lr=3e-4,1e-3)"
            )


def parse_value(declared: JobOption, text: str, *, given: str) -> Any:
    """``text`` as ``declared``'s command line option reads it (its kind and choices); SpecError, one line."""
    flag = f"--sweep {given}"
    kind = declared.kind
    if kind == "int":
        if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):
            raise SpecError(f"{flag}: {text!r} is not an integer, which {declared.flag} takes; give e.g. 1,2")
        return int(text)
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise SpecError(
                f"{flag}: {text!r} is not a number, which {declared.flag} takes; give e.g. 3e-4,1e-3"
            ) from None
    if kind == "bool":
        word = text.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
        raise SpecError(f"{flag}: {text!r} is not yes or no, which {declared.flag} takes; give e.g. yes,no")
    if kind == "nodes":
        return int(text) if text.strip().isdigit() else text
    if declared.choices and text not in declared.choices:
        raise SpecError(f"{flag}: {text!r} is not one of {declared.flag}'s choices ({', '.join(declared.choices)})")
    if kind in ("list", "table"):
        return (text,)  # one item for the point, in place of the command line's
    return text


def parse_axis(spec_text: str) -> tuple[str, list[str]]:
    """``KEY=V1,V2`` -> (option key, value texts), the key as a flag or a config key (``--lr``, ``global-batch-size``)."""
    if not isinstance(spec_text, str) or "=" not in spec_text:
        raise SpecError(
            f"--sweep {spec_text!r} has no '='; write --sweep OPTION=VALUE,VALUE (e.g. --sweep lr=3e-4,1e-3)"
        )
    name, _, listed = spec_text.partition("=")
    key = name.strip().lstrip("-").replace("-", "_")
    texts = [t.strip() for t in listed.split(",")] if listed.strip() else []
    if not texts or any(t == "" for t in texts):
        raise SpecError(
            f"--sweep {spec_text!r}: an empty value list or an empty value; give at least one value, e.g. --sweep {name}=1,2"
        )
    return key, texts


def parse_axes(specs: Sequence[str] | Mapping[str, Sequence[Any]]) -> list[Axis]:
    """The axes of ``--sweep`` texts (or of the API's ``{key: [values]}``); SpecError (one line) for an
    unknown or unsweepable option, an empty list, a value of the wrong kind, an option twice."""
    if isinstance(specs, Mapping):
        pairs = []
        for key, values in specs.items():
            values = [values] if isinstance(values, (str, int, float, bool)) else list(values)
            pairs.append((str(key).replace("-", "_"), [_text_of(v) for v in values], f"{key}=..."))
            if not values:
                raise SpecError(f"sweep {key!r}: an empty value list; give at least one value")
    else:
        pairs = []
        for text in specs:
            key, texts = parse_axis(text)
            pairs.append((key, texts, text))
    if not pairs:
        raise SpecError("a sweep needs at least one --sweep OPTION=VALUE,VALUE")
    allowed = sweepable()
    axes, seen = [], set()
    for key, texts, given in pairs:
        if any(ch in text for text in (key, *texts) for ch in "\n\r\0"):
            raise SpecError(f"--sweep {given!r}: a value with a line break or NUL; sweep one-line values")
        if key in seen:
            raise SpecError(f"--sweep {given}: {key} is swept twice; give its values in one --sweep")
        seen.add(key)
        if key not in allowed:
            if key in OPTION_BY_KEY and key in UNSWEPT:
                why = {
                    "run_dir": "the run directory of each point is <sweep-dir>/<point>",
                    "config": "it is read once",
                    "profile": "it is read once",
                    "cluster": "a sweep goes to one scheduler",
                }.get(key, "it shapes the sweep itself")
                raise SpecError(f"--sweep {given}: {OPTION_BY_KEY[key].flag} cannot be swept ({why})")
            raise SpecError(
                f"--sweep {given}: {key!r} is not an option of hpc-hsdp submit; sweep one of "
                f"{', '.join(sorted(allowed))}"
            )
        declared = allowed[key]
        axes.append(Axis(declared, tuple(texts), tuple(parse_value(declared, t, given=given) for t in texts)))
    return axes


def _text_of(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def names_point(ref: str, texts: Sequence[tuple[str, str]]) -> bool:
    """``ref`` (``lr=1e-3,seed=1``) gives the point of ``texts`` (``lr=0.001``, ``seed=1``) value by value,
    each read as its option reads it: the same options, the same values however written."""
    given = {}
    for item in ref.split(","):
        key, sep, text = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or key in given:
            return False
        given[key] = text.strip()
    own = dict(texts)
    if set(given) != set(own) or any(key not in OPTION_BY_KEY for key in own):
        return False
    try:
        return all(
            parse_value(OPTION_BY_KEY[key], given[key], given=ref)
            == parse_value(OPTION_BY_KEY[key], own[key], given=ref)
            for key in own
        )
    except SpecError:
        return False


def point_name(texts: Sequence[tuple[str, str]]) -> str:
    """``lr=3e-4,seed=0``: the point's values as given, reduced to characters safe in a file name."""
    name = ",".join(f"{key}={text}" for key, text in texts)
    return re.sub(_NAME_SAFE, "_", name).strip("._") or "point"


def count_points(axes: Sequence[Axis], mode: str = "grid") -> int:
    """How many points ``expand`` would make, without making them; SpecError for an unknown mode,
    zip lists of different lengths, or more than :data:`MAX_POINTS` (25 values on 5 axes were
    9.8 million points, expanded until memory ran out)."""
    if mode not in SWEEP_MODES:
        raise SpecError(f"--sweep-mode {mode!r} is unknown; choose {' or '.join(SWEEP_MODES)}")
    lengths = {axis.key: len(axis.texts) for axis in axes}
    if mode == "zip":
        if len(set(lengths.values())) > 1:
            said = ", ".join(f"{k} {n}" for k, n in lengths.items())
            raise SpecError(f"--sweep-mode zip pairs the values in order, but the lists differ in length ({said})")
        count = min(lengths.values(), default=0)
    else:
        count = math.prod(lengths.values())
    if count > MAX_POINTS:
        said = " x ".join(str(n) for n in lengths.values())
        raise SpecError(
            f"the sweep has {count} points ({said} values), more than {MAX_POINTS}; sweep fewer values, or split "
            f"the sweep"
        )
    return count


def expand(axes: Sequence[Axis], mode: str = "grid") -> list[Point]:
    """The points: the cross product of the axes (``grid``, the first axis slowest) or their values
    paired in order (``zip``: every axis as long), counted first (:func:`count_points`). Names are
    unique (an index is added where two reduce alike, or one is too long)."""
    count_points(axes, mode)
    if mode == "zip":
        combos = list(zip(*(range(len(axis.texts)) for axis in axes)))
    else:
        combos = list(itertools.product(*(range(len(axis.texts)) for axis in axes)))
    points, names = [], set()
    for index, combo in enumerate(combos):
        texts = tuple((axis.key, axis.texts[i]) for axis, i in zip(axes, combo))
        name = point_name(texts)
        if name in names or len(name) > MAX_NAME:
            name = f"{index:04d}-{name[: MAX_NAME - 5]}"
        names.add(name)
        values = {axis.key: axis.values[i] for axis, i in zip(axes, combo)}
        points.append(Point(index=index, name=name, texts=texts, values=values))
    return points


def check_array_size(count: int, max_array_size: int | None, *, array: str = "") -> None:
    """More points than SLURM's ``MaxArraySize`` in one job array (task ids 0..N-1 must stay below
    it): SpecError. ``array``: which of the sweep's arrays, where it has several."""
    if max_array_size is not None and count > max_array_size:
        which = f"job array {array} of the sweep" if array else "the sweep"
        raise SpecError(
            f"{which} has {count} points, more than this cluster's MaxArraySize ({max_array_size}: array task "
            f"ids 0-{max_array_size - 1}); sweep fewer values, or split the sweep"
        )


def parse_max_array_size(text: str) -> int | None:
    """``MaxArraySize = 1001`` from ``scontrol show config``; None when it does not say."""
    match = re.search(r"^\s*MaxArraySize\s*=\s*([0-9]+)\s*$", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def array_range(indices: int | Sequence[int], parallelism: int | None) -> str:
    """``#SBATCH --array``'s value: ``0-3%2`` (tasks 0..count-1, or the ``indices`` given, as SLURM
    writes them: ``1,3-5``; at most ``parallelism`` at once)."""
    wanted = sorted(set(range(indices) if isinstance(indices, int) else indices))
    spans: list[list[int]] = []
    for index in wanted:
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return text + (f"%{parallelism}" if parallelism else "")


def point_specs(points: Sequence[Point], given: Mapping[str, Any], sweep_dir: str, resolve: Callable) -> list:
    """Every point's JobSpec: ``resolve`` (the command's own spec making, config file and checks
    included) of the command line's options ``given`` (by key) with the point's values and run
    directory ``<sweep_dir>/<name>``. SpecError naming the point for a value its spec refuses."""
    specs = []
    for point in points:
        options = {**given, **point.values, "run_dir": str(Path(sweep_dir) / point.name)}
        try:
            specs.append(resolve(options))
        except SpecError as exc:
            raise SpecError(f"sweep point {point.name}: {exc}") from None
    return specs


HEADER_OF_RUN_DIR = ("output", "error")
"""#SBATCH lines that name the run directory: the array's own point to the sweep directory."""

Header = tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class ArrayGroup:
    """The points that share one ``#SBATCH`` header: one job array of the sweep."""

    header: Header
    """The shared ``#SBATCH`` lines, but those of the run directory (:data:`HEADER_OF_RUN_DIR`)."""
    members: tuple[int, ...]
    """The points' positions in the sweep, in its order; a point's task id in the array is its place here."""


def shared_header(lines: Sequence[tuple[str, str | None]]) -> Header:
    """A point's ``#SBATCH`` lines without those of its run directory: what its array shares."""
    return tuple(line for line in lines if line[0] not in HEADER_OF_RUN_DIR)


def group_by_header(headers: Sequence[Sequence[tuple[str, str | None]]]) -> list[ArrayGroup]:
    """The points (``headers[i]``: point i's ``#SBATCH`` lines) grouped by their shared header, one
    job array per distinct one, in the order each header first appears (pure)."""
    groups: dict[Header, list[int]] = {}
    for position, lines in enumerate(headers):
        groups.setdefault(shared_header(lines), []).append(position)
    return [ArrayGroup(header, tuple(members)) for header, members in groups.items()]


def header_differences(groups: Sequence[ArrayGroup]) -> list[str]:
    """What sets each array's header apart from the others' (``--nodes=2 --time=1:00:00``): its lines
    that not every array has, in its header's order, else the lines it lacks (``without --exclusive``);
    '' for a sweep of one array."""
    if len(groups) < 2:
        return [""] * len(groups)
    common = set(groups[0].header).intersection(*(set(g.header) for g in groups[1:]))

    def flags(lines) -> str:
        return " ".join(f"--{key}" + ("" if value is None else f"={value}") for key, value in lines)

    out = []
    for group in groups:
        own = [line for line in group.header if line not in common]
        lacks = dict.fromkeys(line for g in groups for line in g.header if line not in set(group.header))
        out.append(flags(own) if own else f"without {flags(lacks)}" if lacks else "(the same lines, in another order)")
    return out


def check_no_array(points: Sequence[Point], extras: Sequence[Sequence[tuple[str, str]]]) -> None:
    """An ``--sbatch array=...`` of the command line or of a point (``--sweep sbatch=array=...``):
    SpecError, the sweep makes the job arrays itself."""
    for point, extra in zip(points, extras):
        if any(key == "array" for key, _ in extra):
            where = "" if not any(key == "sbatch" for key, _ in point.texts) else f" (sweep point {point.name})"
            raise SpecError(
                f"--sbatch array=... and --sweep{where}: the sweep makes the job arrays itself; drop --sbatch array"
            )
