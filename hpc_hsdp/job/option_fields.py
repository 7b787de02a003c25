"""The words of a job option's declaration, and the typed sections that declare them.

Every job option is a field of one section: a frozen dataclass in source per component of the
job (:mod:`hpc_hsdp.job.spec`), its type, default and docstring
written out, and what the rest of the program derives from it (its flag, config key, help,
bounds, the commands that take it, the ``#SBATCH`` lines it writes) as the field's metadata:
:func:`option_field` declares one, :func:`section` makes the class a section and completes
each declaration into a :class:`JobOption` (``dataclasses.fields(cls)[i].metadata["option"]``).
The registry :mod:`hpc_hsdp.job.options` reads them back, in the sections' order. Pure data:
no click, no torch.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, field, replace
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar, overload

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.mixture import is_mixture, parse_mixture
from hpc_hsdp.plan.records import record
from hpc_hsdp.plan.slurm_facts import check_text

if TYPE_CHECKING:
    from typing import TypedDict

    from typing_extensions import Unpack, dataclass_transform
else:

    def dataclass_transform(**_facts):
        return lambda function: function


CONFIG_ENV = "HPC_HSDP_CONFIG"
"""Environment variable naming the config file when ``--config`` is not given."""
PROFILE_ENV = "HPC_HSDP_PROFILE"
"""Environment variable naming the profile when ``--profile`` is not given."""
SLURM_TIMEOUT_ENV = "HPC_HSDP_SLURM_TIMEOUT"
"""Environment variable: seconds any one SLURM command (``sbatch``, ``squeue``, ``scontrol``,
``sacct``, ``scancel``, ``sinfo``) may take before hpc-hsdp stops waiting for it
(:func:`hpc_hsdp.scheduler.backends.slurm_command.run_slurm`); default ``DEFAULT_SLURM_TIMEOUT_S``."""
DEFAULT_SLURM_TIMEOUT_S = 10.0

DEVICES = ("auto", "cpu", "cuda")
"""``--device``: ``auto`` (the layout's GPU when CUDA is usable, else CPU), ``cpu`` or ``cuda``."""
LAUNCHERS = ("srun", "torchrun")
PRECISIONS = ("auto", "bf16", "fp32", "fp8")
LR_SCHEDULES = ("constant", "cosine", "linear")
RESHARD_CHOICES = ("auto", "always", "never")
TRACKERS = ("tensorboard", "wandb", "mlflow")
"""``--tracker``: where every metrics row goes besides metrics.jsonl (comma-separated; ``none``: nowhere else)."""
NO_TRACKER = "none"
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tb"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""tracker -> (the module its package installs, the hpc-hsdp extra that installs it)."""
FAULT_TOLERANCE = ("none", "replica")
"""``--fault-tolerance``: ``none`` (a lost node requeues the job) or ``replica`` (torchft: each
replica group is its own job step; the others train on without it)."""

# How an option reaches the tasks of a job.
RUN_ARGUMENT = "an `hpc-hsdp run` argument in the rendered script"
SBATCH_LINE = "an #SBATCH line"
SCRIPT_LINE = "the script's setup, activation or launch lines"
ENVIRONMENT = "a variable exported to every task"
SUBMIT_SIDE = "read where the job is rendered or submitted"

MODULE_FUNCTION = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
"""``--entry`` and ``--model MODULE:FUNCTION``: a dotted module path, a colon, a function name."""

RENDER_SUBMIT = ("render", "submit")
CLUSTERS = ("auto", "slurm", "local")
"""``--cluster``: ``auto`` or one of the backends (``hpc_hsdp.scheduler.backends.BACKEND_NAMES``)."""
ON_EVERY_TASK = ("render", "submit", "run")

KINDS = ("int", "float", "str", "path", "data", "bool", "nodes", "list", "table")
"""Kinds of value (as a config file holds them): ``path`` is a string made absolute against the
config file's (or the caller's) directory, ``data`` one such path or a mixture
``NAME=PATH:WEIGHT,...`` whose every path is (:mod:`hpc_hsdp.plan.mixture`), ``nodes`` an int or ``"MIN-MAX"``, ``list`` repeatable
strings, ``table`` repeatable ``KEY=VALUE`` items."""


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


LAYERED = _Marker("LAYERED")
"""``Shown.default``: the command line leaves the option unset (None) for a config file, its
profile and then the declared default to fill."""
DECLARED = _Marker("DECLARED")
"""``Shown.default``: the command line carries the option's declared default itself."""


@record
class Shown:
    """How one command shows an option where it differs from the declaration."""

    help: str | None = None
    """Its own help text; None: the declaration's."""
    default: object = LAYERED
    """LAYERED (the command reads config files), DECLARED, or a default of this command's own."""
    default_text: str | None = None
    """What ``[default: ...]`` says for a LAYERED option; None: the declaration's."""
    metavar: str | None = ""
    """Its own metavar (None: click's); "": the declaration's."""
    required: bool = False
    directory: bool = False
    """The value names a directory (click checks that an existing path is not a file)."""


OWN_VALUE = _Marker("OWN_VALUE")
"""``SbatchKey.value``: the option's own value (its field of the JobSpec)."""
PLACE_WITH_PARTITION = 80
"""Where an option's ``#SBATCH`` line goes unless it says: with ``--partition``, ``--account``, ``--qos``
and ``--constraint`` (after ``--time``, before ``--exclusive``)."""


@record(kw_only=False)
class SbatchKey:
    """An sbatch option that a job option owns: the ``#SBATCH`` line it writes, or (without a
    ``value``) one whose ``--sbatch`` passthrough would contradict it. ``--sbatch NAME=...`` is
    refused for every one, saying to use ``instead``."""

    name: str
    """sbatch's long option: ``job-name``."""
    value: Callable[[Any], object] | _Marker | None = OWN_VALUE
    """The line's value, read from the JobSpec: None or False writes no line, True ``--NAME`` alone,
    anything else ``--NAME=VALUE``. None here: the job option writes no such line."""
    place: int = PLACE_WITH_PARTITION
    """Where the line goes in the header: the lines are written by place, then in declaration order;
    the ``--sbatch`` passthrough follows them all."""
    instead: str | None = None
    """What the refusal of ``--sbatch NAME=...`` says to use; None: the option's flag."""
    owned: bool = True
    """False: ``--sbatch NAME`` stays allowed (the job writes the line only in some cases)."""


@record
class JobOption:
    """One job option, declared once (see the module docstring)."""

    key: str
    """Config-file key and Python API keyword (``gpus_per_node``); ``--gpus-per-node`` on the command line."""
    kind: str
    help: str
    default: object = None
    default_text: str | None = None
    """What ``[default: ...]`` says in ``--help``; None: derived from ``default`` (yes/no for a bool, none
    shown for None or empty)."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    """The largest value that makes sense (``--timeout``: a week); larger is refused."""
    positive: bool = False
    """Above zero: an integer of at least 1, a number above 0."""
    pattern: str | None = None
    """A regular expression a text value must match from its start (``--entry``: module:function)."""
    refusal: str | None = None
    """What the error of a value that is not positive or does not match ``pattern`` says after the
    flag and the value ("must be a positive integer such as 4"); None: from the kind."""
    commands: tuple[str, ...] = RENDER_SUBMIT
    reaches: str = SBATCH_LINE
    param: str | None = None
    """The click parameter name, where it is not the key (``training_<key>`` for a training option)."""
    section: str | None = None
    """Where the section holding its field sits in a JobSpec (``""``: the JobSpec itself, ``run``,
    ``run.training``, ``scheduler``, ...); None: no spec field (``--config``, ``--profile``).
    Set by :func:`section` from the field's class."""
    spec_field: str | None = None
    """The spec attribute it sets, where it is not the key (set by :func:`section`: the field's name)."""
    spec_required: bool = False
    """The spec field has no default: every spec is given a value (``--shard``, ``--run-dir``)."""
    off_word: str | None = None
    """The word that turns the option off (``--signal none``): the spec field then holds None."""
    flag_value: str | None = None
    """The value of the flag given alone (``--stage-data`` is ``--stage-data auto``); None: it needs a value."""
    sbatch: tuple[SbatchKey, ...] | None = None
    """The sbatch options it owns (see :class:`SbatchKey`); None: ``#SBATCH --KEY=VALUE`` for an
    option that ``reaches`` an #SBATCH line, none for the others (a tuple once declared)."""
    in_config: bool = True
    """False: it selects the config file itself (``--config``, ``--profile``) and is no key in one."""
    shown: Mapping[str, Shown] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"option {self.key}: kind {self.kind!r} is not one of {KINDS}")
        if self.reaches == RUN_ARGUMENT and "run" not in self.commands:
            raise ValueError(f"option {self.key} reaches the tasks as a run argument, so `run` must take it")
        unknown = set(self.shown) - set(self.commands)
        if unknown:
            raise ValueError(f"option {self.key} is shown on {sorted(unknown)}, which do not take it")
        keys = self.sbatch
        if keys is None:
            keys = (SbatchKey(name=self.key.replace("_", "-")),) if self.reaches == SBATCH_LINE else ()
        if any(key.value is OWN_VALUE for key in keys):
            own = attrgetter(self.path)
            keys = tuple(replace(key, value=own) if key.value is OWN_VALUE else key for key in keys)
        object.__setattr__(self, "sbatch", keys)

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def training(self) -> bool:
        """A field of the training loop's sections (``TrainingSpec``), given to the tasks as an
        ``hpc-hsdp run`` argument."""
        return self.section is not None and (self.section + ".").startswith("run.training.")

    @property
    def sbatch_keys(self) -> tuple[SbatchKey, ...]:
        """The sbatch options it owns (``sbatch`` as :meth:`__post_init__` completed it)."""
        return self.sbatch or ()

    @property
    def click_param(self) -> str:
        return self.param or (f"training_{self.key}" if self.training else self.key)

    @property
    def attribute(self) -> str:
        return self.spec_field or self.key

    @property
    def path(self) -> str:
        """Where its value sits in a JobSpec: ``scheduler.partition``, ``run.training.steps``."""
        return ".".join(filter(None, (self.section, self.attribute)))

    def shown_on(self, command: str) -> Shown:
        return self.shown.get(command, Shown())


# ----------------------------------------------------------------------------- fields and sections

_T = TypeVar("_T")
_Section = TypeVar("_Section", bound=type)
_DRAFT = "hpc_hsdp.option_draft"
"""The metadata key of a declaration that :func:`section` has not completed yet."""

if TYPE_CHECKING:

    class OptionFacts(TypedDict, total=False):
        """What :func:`option_field` takes besides the default, kind and help: :class:`JobOption`'s fields."""

        key: str
        default_text: str | None
        metavar: str | None
        choices: tuple[str, ...] | None
        minimum: float | None
        maximum: float | None
        positive: bool
        pattern: str | None
        refusal: str | None
        commands: tuple[str, ...]
        reaches: str
        param: str | None
        off_word: str | None
        flag_value: str | None
        sbatch: tuple[SbatchKey, ...] | None
        shown: Mapping[str, Shown]


@overload
def option_field(*, default: _T, kind: str, help: str, **facts: Unpack[OptionFacts]) -> _T: ...
@overload
def option_field(*, kind: str, help: str, **facts: Unpack[OptionFacts]) -> Any: ...
def option_field(*, default: object = MISSING, kind: str, help: str, **facts: Any) -> Any:
    """A section's field that is a job option: its default (none: every spec must be given a
    value, ``--shard``), the kind of value a config file holds, the one line of ``--help`` and
    the rest of its :class:`JobOption` (``key``: its config key and flag where they are not the
    field's name; ``reaches`` and ``commands``: where they are not the section's)."""
    return field(default=default, metadata={_DRAFT: {"default": default, "kind": kind, "help": help, **facts}})


def section_options(cls: type) -> tuple[JobOption, ...]:
    """The options of a :func:`section`'s fields, in the fields' order (none for another class)."""
    declared: tuple[JobOption, ...] = cls.__dict__.get("__section_options__", ())
    return declared


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(field, option_field))
def section(place: str, *, reaches: str, commands: tuple[str, ...] = RENDER_SUBMIT) -> Callable[[_Section], _Section]:
    """Class decorator: ``cls`` as a :func:`~hpc_hsdp.plan.records.record` (a frozen, keyword-only
    dataclass) whose :func:`option_field` fields are job options. ``place``: where it sits in a
    JobSpec (``""``: the JobSpec, ``run.training``); ``reaches``, ``commands``: its options'
    unless a field says. Every option field's value is checked against its declaration
    (:func:`check_option_value`), in the fields' order, before the class's own ``__post_init__``."""

    def decorate(cls: _Section) -> _Section:
        own_post_init = cls.__dict__.get("__post_init__")

        def __post_init__(self: Any) -> None:
            for declared in section_options(type(self)):
                check_option_value(declared, getattr(self, declared.attribute))
            if own_post_init is not None:
                own_post_init(self)

        __post_init__.__qualname__ = f"{cls.__qualname__}.__post_init__"
        setattr(cls, "__post_init__", __post_init__)  # noqa: B010  (before record() reads it)
        made: _Section = record(cls)
        declared = []
        for each in dataclasses.fields(made):
            draft = each.metadata.get(_DRAFT)
            if draft is None:
                continue
            facts = dict(draft)
            default = facts.pop("default")
            key = facts.pop("key", each.name)
            facts.setdefault("reaches", reaches)
            facts.setdefault("commands", commands)
            option = JobOption(
                key=key,
                default=None if default is MISSING else default,
                spec_required=default is MISSING,
                section=place,
                spec_field=None if key == each.name else each.name,
                **facts,
            )
            each.metadata = MappingProxyType({"option": option})
            declared.append(option)
        setattr(made, "__section_options__", tuple(declared))  # noqa: B010
        return made

    return decorate


def _flag(option: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{option} {value!r} must be true or false")


def check_option_value(declared: JobOption, value: Any) -> None:
    """Check one value against its option's kind, bound, choices and pattern: the one check of every
    option field of every section (:func:`section`)."""
    flag, kind = declared.flag, declared.kind
    if value is None and (declared.default is None or declared.off_word is not None) and not declared.spec_required:
        return
    if kind == "bool":
        _flag(flag, value)
        return
    if kind in ("int", "nodes"):
        if declared.positive and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"{flag} {value!r} {declared.refusal or 'must be a positive integer'}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{flag} {value!r} must be an integer")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        raise SpecError(f"{flag} {value!r} must be a finite number, e.g. {declared.default!r}")
    if declared.pattern is not None and not (isinstance(value, str) and re.match(declared.pattern, value)):
        raise SpecError(f"{flag} {value!r} {declared.refusal}")
    if kind in ("str", "path", "data"):
        check_text(flag, value)
    if kind == "list":
        for item in value:
            check_text(flag, item)
    if kind == "data" and is_mixture(value):
        parse_mixture(value, flag=flag)
    if declared.choices and value not in declared.choices:
        raise SpecError(f"{flag} {value!r} is unknown; choose {', '.join(declared.choices)}")
    if declared.minimum is not None and value < declared.minimum:
        raise SpecError(f"{flag} {value} must be at least {declared.minimum}")
    if declared.maximum is not None and value > declared.maximum:
        raise SpecError(f"{flag} {value} must be at most {declared.maximum:g}")
    if kind == "int" and abs(value) >= 2**63:
        raise SpecError(f"{flag} {value} is out of range (at most {2**63 - 1})")
    if declared.positive and not value > 0:
        raise SpecError(
            f"{flag} {value!r} {declared.refusal or f'must be a positive number, e.g. {declared.default!r}'}"
        )


def owned_sbatch_keys(options: Iterable[JobOption]) -> dict[str, str]:
    """sbatch options that the job writes itself or that would contradict it -> what to use instead."""
    return {key.name: key.instead or declared.flag for declared in options for key in declared.sbatch_keys if key.owned}


def run_arguments(declared: JobOption, value: object) -> list[str]:
    """The ``hpc-hsdp run`` arguments that give an option this value; none for its default."""
    if value == declared.default:
        return []
    if isinstance(value, bool):
        return [declared.flag if value else f"--no-{declared.flag[2:]}"]
    return [declared.flag, repr(value) if isinstance(value, float) else str(value)]
