"""The job options, read from the fields of the typed sections that declare them.

Each option is one field of one section (:mod:`hpc_hsdp.job.option_fields`): ``tp_size`` of
``RunSpec``, ``lr`` of ``TrainingSpec``, ``partition`` of ``SchedulerSpec``
(:mod:`hpc_hsdp.job.spec`), with its type, default and docstring
in source and its :class:`JobOption` as metadata: its config-file key and Python API keyword
(``--flag`` spelled from it), kind of value, one line of help, metavar, choices or bound, the
commands that take it, how it reaches a task and the ``#SBATCH`` lines it writes. This module
lists them, in the order of the sections (``spec.SECTIONS``) and their fields (:data:`OPTIONS`), for what is
derived from them: the click options of ``render``, ``submit``, ``run`` and ``plan``
(:mod:`hpc_hsdp.cli.click_options`), the config keys and kinds and the copy of a config's values
into a spec (:mod:`hpc_hsdp.job.config`), the ``#SBATCH`` header of the rendered script
(:func:`sbatch_lines`, :mod:`hpc_hsdp.submit_host.render`), the ``hpc-hsdp run`` arguments of that
script (``RunSpec.to_args``), the keywords of ``hpc_hsdp.submit`` and ``--help``. No click, no
torch.

Adding an ``#SBATCH`` option is one field of ``SchedulerSpec``, e.g.::

    reservation: str | None = option_field(default=None, kind="str", help="#SBATCH --reservation.")
    '''``#SBATCH --reservation``: the reservation the job runs in.'''

The section's ``reaches`` is :data:`SBATCH_LINE`, so it becomes ``spec.scheduler.reservation``,
a ``reservation`` key of config files and keyword of ``hpc_hsdp.submit``, ``--reservation`` of
``render`` and ``submit``, and, when set, the line ``#SBATCH --reservation=VALUE`` (beside
``--partition``, ``--account``, ``--qos``; see :class:`SbatchKey` for another place, another
name or a value of its own), which ``--sbatch reservation=...`` may no longer override. A bool
writes ``--KEY`` alone when true. ``tests/fast/test_options.py`` adds one to a copy of the spec
module and renders it.
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter
from types import MappingProxyType

from hpc_hsdp.job.option_fields import (  # noqa: F401  (the words of a declaration, imported from here too)
    CONFIG_ENV,
    DECLARED,
    DEFAULT_SLURM_TIMEOUT_S,
    DEVICES,
    ENVIRONMENT,
    FAULT_TOLERANCE,
    KINDS,
    LAUNCHERS,
    LAYERED,
    LR_SCHEDULES,
    MODULE_FUNCTION,
    NO_TRACKER,
    ON_EVERY_TASK,
    OWN_VALUE,
    PLACE_WITH_PARTITION,
    PRECISIONS,
    PROFILE_ENV,
    RENDER_SUBMIT,
    RESHARD_CHOICES,
    RUN_ARGUMENT,
    SBATCH_LINE,
    SCRIPT_LINE,
    SLURM_TIMEOUT_ENV,
    SUBMIT_SIDE,
    TRACKER_PACKAGES,
    TRACKERS,
    JobOption,
    SbatchKey,
    Shown,
    section_options,
)
from hpc_hsdp.job.spec import SECTIONS, RunSpec

FILE_SELECTORS: tuple[JobOption, ...] = (
    JobOption(
        key="config",
        kind="path",
        in_config=False,
        metavar="FILE",
        default_text=f"${CONFIG_ENV}",
        reaches=SUBMIT_SIDE,
        help="TOML file with job options and [profiles.NAME] tables.",
    ),
    JobOption(
        key="profile",
        kind="str",
        in_config=False,
        metavar="NAME",
        default_text=f"${PROFILE_ENV}",
        reaches=SUBMIT_SIDE,
        help="Profile of the config file to apply (below the file's top level).",
    ),
)
"""``--config`` and ``--profile``: they choose the config file and its profile, and are no key in one."""

PLAN_ONLY: tuple[JobOption, ...] = (
    JobOption(
        key="upload_bandwidth",
        kind="str",
        in_config=False,
        default_text="none: no store",
        metavar="BYTES/s",
        reaches=SUBMIT_SIDE,
        commands=("plan",),
        help="What one node uploads to --checkpoint-store per second (e.g. 500MB/s); plan then counts the upload "
        "after the local save in its check of the save on the warning signal.",
    ),
)
"""Facts only ``plan`` asks for (no job holds them): ``--upload-bandwidth``."""

OPTIONS: tuple[JobOption, ...] = (
    FILE_SELECTORS + PLAN_ONLY + tuple(declared for each in SECTIONS for declared in section_options(each))
)
"""Every job option: the file selectors, plan's own, then the fields of ``spec.SECTIONS`` in order."""
OPTION_BY_KEY: Mapping[str, JobOption] = MappingProxyType({o.key: o for o in OPTIONS})
TRAINING_OPTIONS: tuple[JobOption, ...] = tuple(o for o in OPTIONS if o.training)
"""The training loop's options (``TrainingSpec``'s fields), in the fields' order."""
RUN_ARGUMENTS: tuple[str, ...] = tuple(declared.key for declared in section_options(RunSpec))
"""RunSpec's own options in the order ``hpc-hsdp run`` lists them and the rendered script passes
them; the training options follow."""


def options_in(place: str) -> tuple[JobOption, ...]:
    """The options whose fields the section at ``place`` in a JobSpec (``""``, ``run``,
    ``run.training``, ``scheduler``, ...) has, in the fields' order."""
    return tuple(declared for declared in OPTIONS if declared.section == place)


def sbatch_lines() -> list[SbatchKey]:
    """The ``#SBATCH`` lines the options write, in the header's order (``SbatchKey.place``, then declaration)."""
    lines = [key for declared in OPTIONS for key in declared.sbatch_keys if key.value is not None]
    return sorted(lines, key=attrgetter("place"))


def owned_sbatch_keys() -> dict[str, str]:
    """sbatch options that the job writes itself or that would contradict it -> what to use instead."""
    return {key.name: key.instead or declared.flag for declared in OPTIONS for key in declared.sbatch_keys if key.owned}


def option(key: str) -> JobOption:
    return OPTION_BY_KEY[key]


def default(key: str) -> object:
    """The declared default of an option: what a spec field holds when nothing sets it."""
    return OPTION_BY_KEY[key].default


def options_of(command: str) -> tuple[JobOption, ...]:
    """The options a command takes, in the order of its ``--help``."""
    if command == "run":
        return tuple(OPTION_BY_KEY[key] for key in RUN_ARGUMENTS) + TRAINING_OPTIONS
    return tuple(declared for declared in OPTIONS if command in declared.commands)


CONFIG_KINDS: Mapping[str, str] = MappingProxyType({o.key: o.kind for o in OPTIONS if o.in_config})
"""Config-file key -> kind of value."""
