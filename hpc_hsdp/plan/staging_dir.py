"""Where ``--stage-data [DIR]`` puts the token files on a node: the value's form (checked with
the spec, everywhere) and the directory it names on a node with a given environment. Pure: the
environment is a mapping, nothing is read from the disk."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from hpc_hsdp.errors import SpecError

STAGE_AUTO = "auto"
"""``--stage-data`` alone: the job's node-local temporary directory (:func:`stage_base`)."""
TEMPORARY_DIRS = ("SLURM_TMPDIR", "TMPDIR")
"""Where a job's node-local temporary directory is named, in this order; else ``/tmp``."""
DIR_HINT = "give a writable directory on node-local disk, or --stage-data alone for $SLURM_TMPDIR, $TMPDIR or /tmp"
_VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def check_stage_value(value: str) -> None:
    """``auto``, or an absolute path (``$VAR`` allowed, expanded on the node); else
    :class:`SpecError` (one line)."""
    if value == STAGE_AUTO:
        return
    if not (value.startswith("/") or value.startswith("$")):
        raise SpecError(f"--stage-data {value!r} is not an absolute path; {DIR_HINT}")
    if "$" in _VARIABLE.sub("", value):
        raise SpecError(f"--stage-data {value!r}: a '$' that names no variable ($NAME or ${{NAME}}); {DIR_HINT}")


def stage_base(value: str, env: Mapping[str, str]) -> Path:
    """The directory ``--stage-data VALUE`` names on a node with environment ``env``: ``auto``
    -> ``$SLURM_TMPDIR``, ``$TMPDIR`` or ``/tmp``; a path with ``$VAR``/``${VAR}`` expanded
    from ``env`` (a site's ``$LOCAL_SCRATCH``). Raises :class:`SpecError`."""
    check_stage_value(value)
    if value == STAGE_AUTO:
        for name in TEMPORARY_DIRS:
            if env.get(name, "").strip():
                return Path(env[name].strip())
        return Path("/tmp")

    def one(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        if not env.get(name):
            raise SpecError(f"--stage-data {value!r}: ${name} is not set on this node; {DIR_HINT}")
        return env[name]

    expanded = _VARIABLE.sub(one, value)
    if not expanded.startswith("/"):
        raise SpecError(f"--stage-data {value!r} is {expanded!r} on this node, not an absolute path; {DIR_HINT}")
    return Path(expanded)
