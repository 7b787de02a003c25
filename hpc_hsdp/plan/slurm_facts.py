"""Facts about SLURM that the job spec, the plan and the emulator share: srun's task
distributions, sbatch's ``--signal`` and ``--time`` forms, and what a value must be to sit
on one line of an sbatch script, and what sinfo says about a node's GPUs. Pure; no job spec,
no scheduler."""

from __future__ import annotations

import re

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.records import record

DISTRIBUTIONS = ("block", "cyclic")
"""srun ``--distribution`` values hpc-hsdp writes and emulates."""

DEFAULT_SIGNAL = "USR2@120"
"""Default ``--signal``: USR2 two minutes before the time limit. USR2 is what submitit's task
wrapper listens for (checkpoint and requeue), so plain sbatch and ``submit`` agree; USR1 is
left free for the payload's own preemption handling."""

SLURM_DEFAULT_SIGNAL_LEAD_S = 60
"""sbatch's lead time for ``--signal SIG`` without ``@SECONDS``."""

_TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
_TIME = r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$"
_SIGNAL = r"^(?:(R|B|RB|BR):)?([A-Za-z0-9]+)(?:@([0-9]+))?$"
_SIGNAL_NAMES = frozenset(
    [
        "HUP",
        "INT",
        "QUIT",
        "ABRT",
        "KILL",
        "ALRM",
        "TERM",
        "USR1",
        "USR2",
        "CONT",
        "STOP",
        "TSTP",
        "TTIN",
        "TTOU",
        "URG",
        "XCPU",
        "XFSZ",
        "VTALRM",
        "PROF",
        "WINCH",
    ]
)


def check_text(option: str, value: str, *, allow_empty: bool = False) -> str:
    """A value that will become part of one line of the script: a string without newline,
    carriage return or NUL (a newline would start a new #SBATCH or shell line)."""
    if not isinstance(value, str):
        raise SpecError(f"{option} {value!r} must be a string")
    if "\0" in value:
        raise SpecError(f"{option} {value!r} contains a NUL byte, which no script line can hold; remove it")
    if "\n" in value or "\r" in value:
        raise SpecError(
            f"{option} {value!r} contains a line break, which would start a new line of the sbatch script; "
            f"give it on one line"
        )
    if not allow_empty and value == "":
        raise SpecError(f"{option} is empty; give a value or leave the option out")
    return value


def check_time(value: str) -> str:
    """A SLURM time limit in one of the forms sbatch accepts; returns it unchanged."""
    check_text("--time", value)
    match = re.match(_TIME, value)
    if not match:
        raise SpecError(f"--time {value!r} is not a SLURM time; write {_TIME_FORMS} (e.g. 02:00:00 or 1-12)")
    days, d_hours, d_minutes, d_seconds, first, second, third = match.groups()
    if days is not None:
        parts = [("hours", d_hours, 24), ("minutes", d_minutes, 60), ("seconds", d_seconds, 60)]
    elif third is not None:  # HH:MM:SS
        parts = [("minutes", second, 60), ("seconds", third, 60)]
    elif second is not None:  # MM:SS
        parts = [("seconds", second, 60)]
    else:
        parts = []
    for name, text, limit in parts:
        if text is not None and int(text) >= limit:
            raise SpecError(f"--time {value!r} has {int(text)} {name}; {name} must be below {limit} ({_TIME_FORMS})")
    if all(int(x) == 0 for x in match.groups() if x is not None):
        raise SpecError(f"--time {value!r} is zero (SLURM reads that as no limit); give a real limit such as 01:00:00")
    return value


def time_limit_seconds(value: str) -> int:
    """Seconds in a SLURM time limit (``check_time`` forms): ``2`` is 2 minutes, ``1-12`` 36 hours."""
    match = re.match(_TIME, check_time(value))
    assert match is not None  # check_time accepted it
    days, d_hours, d_minutes, d_seconds, first, second, third = match.groups()
    if days is not None:
        return ((int(days) * 24 + int(d_hours)) * 60 + int(d_minutes or 0)) * 60 + int(d_seconds or 0)
    if third is not None:
        return (int(first) * 60 + int(second)) * 60 + int(third)
    return int(first) * 60 + int(second or 0)


def signal_lead_seconds(value: str) -> int:
    """Seconds before the time limit that ``--signal`` sends its signal (``USR2@120`` -> 120)."""
    match = re.match(_SIGNAL, check_signal(value))
    assert match is not None  # check_signal accepted it
    return int(match.group(3)) if match.group(3) is not None else SLURM_DEFAULT_SIGNAL_LEAD_S


def check_signal(value: str) -> str:
    """``[R:|B:]SIG[@SECONDS]`` as sbatch's --signal takes it; returns it unchanged."""
    check_text("--signal", value)
    match = re.match(_SIGNAL, value)
    name = match.group(2).upper() if match else ""
    name = name[3:] if name.startswith("SIG") else name
    ok = match is not None and (name in _SIGNAL_NAMES or (name.isdigit() and 1 <= int(name) <= 64))
    if match is None or not ok:
        raise SpecError(
            f"--signal {value!r} is not SIG@SECONDS; write e.g. {DEFAULT_SIGNAL} or B:TERM@60 "
            f"(signals: {', '.join(sorted(_SIGNAL_NAMES))}), or 'none' for no signal"
        )
    if match.group(3) is not None and int(match.group(3)) > 65535:
        raise SpecError(
            f"--signal {value!r}: SLURM sends a signal at most 65535 seconds before the limit; give fewer seconds"
        )
    return value


_JOB_ID = r"^[0-9]{1,12}(?:_[0-9]{1,10}|\+[0-9]{1,6})?$"


def own_job_id(env) -> str | None:
    """The job a task belongs to, as its submission recorded it: ``<array job id>_<task id>`` in a
    job array's task (a sweep's point; SLURM gives each task a ``SLURM_JOB_ID`` of its own, which
    no submission knows), else ``SLURM_JOB_ID``; None outside a job."""
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return env.get("SLURM_JOB_ID") or None


def check_job_id(value: object, *, where: str = "the job id") -> str:
    """A SLURM job id in one of SLURM's forms, ``123``, ``123_4`` (an array task) or
    ``123+1`` (a heterogeneous component), as text; anything else (an option such as
    ``--user=root``, a path, a name) is refused before it reaches squeue, scancel or a file name."""
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not re.match(_JOB_ID, text):
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise SpecError(
            f"{where} {shown} is not a SLURM job id (123, 123_4 or 123+1); give the run directory or a job id"
        )
    return text


# ----------------------------------------------------------------------------- what a node offers (sinfo)

SINFO_NODE_FORMAT = "%P|%N|%G|%f"
"""``sinfo -h -N -o`` format of :func:`parse_sinfo_nodes`: partition (``*`` marks the default),
node, GRES, available features; one line per node and partition."""


@record(kw_only=False)
class SinfoNode:
    """One line of :data:`SINFO_NODE_FORMAT`: a node of a partition, its GPUs and features."""

    partition: str
    default: bool
    """The cluster's default partition (what a job without ``--partition`` goes to)."""
    node: str
    gpus: tuple[tuple[str | None, int], ...]
    """GPU GRES as (type, or None when untyped, count)."""
    features: tuple[str, ...]


def parse_gpu_gres(text: str) -> tuple[tuple[str | None, int], ...]:
    """The GPUs of a node's GRES as sinfo shows it (``gpu:h100:8(S:0-1),nic:1`` -> ``(('h100', 8),)``;
    ``gpu:8`` -> ``((None, 8),)``; ``(null)`` -> ``()``). Other GRES are left out."""
    gpus = []
    for item in re.sub(r"\([^)]*\)", "", text.strip()).split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu":
            continue
        count = int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
        typed = parts[1:-1] if len(parts) > 1 and parts[-1].isdigit() else parts[1:]
        gpus.append((":".join(typed) or None, count))
    return tuple(gpus)


def parse_sinfo_nodes(text: str) -> list[SinfoNode]:
    """The lines of ``sinfo -h -N -o`` :data:`SINFO_NODE_FORMAT`; a line of another shape is skipped."""
    nodes = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 4 or not fields[0] or not fields[1]:
            continue
        partition, node, gres, features = fields
        nodes.append(
            SinfoNode(
                partition=partition.rstrip("*"),
                default=partition.endswith("*"),
                node=node,
                gpus=parse_gpu_gres(gres),
                features=tuple(f for f in features.split(",") if f and f != "(null)"),
            )
        )
    return nodes


def satisfies_constraint(constraint: str, features: tuple[str, ...]) -> bool | None:
    """Whether a node with ``features`` can satisfy ``--constraint`` written with ``&`` (or ``,``)
    and ``|`` alone (``h100&ib``, ``a100|h100``); None for the forms that need more than one
    node's features to decide (counts ``*N``, brackets, parentheses)."""
    if any(c in constraint for c in "[]()*"):
        return None
    have = set(features)
    return any(set(filter(None, re.split(r"[&,]", one))) <= have for one in constraint.split("|"))


_SWITCHES = r"^([1-9][0-9]{0,5})(?:@(.+))?$"


def check_switches(value: str) -> str:
    """``COUNT[@MAX_WAIT]`` as sbatch's ``--switches`` takes it (at most COUNT leaf switches,
    waiting at most MAX_WAIT, a SLURM time, for them); returns it unchanged."""
    check_text("--switches", value)
    match = re.match(_SWITCHES, value)
    if not match or (match.group(2) is not None and not _is_time(match.group(2))):
        raise SpecError(
            f"--switches {value!r} is not COUNT[@MAX_WAIT]; write e.g. 1 (one leaf switch) or 1@10:00 "
            f"(one leaf switch, waiting up to 10 minutes for it; {_TIME_FORMS})"
        )
    return value


def _is_time(value: str) -> bool:
    """A SLURM time with its parts in range; zero too (``--switches 1@0``: no waiting)."""
    match = re.match(_TIME, value)
    if match and all(int(x) == 0 for x in match.groups() if x is not None):
        return True
    try:
        check_time(value)
    except SpecError:
        return False
    return True


def check_segment(value: object) -> int:
    """sbatch's ``--segment`` (topology/block): nodes per segment, each segment in one block."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65_536:
        raise SpecError(f"--segment {value!r} is not a node count; give the nodes per block segment, e.g. --segment 2")
    return value
