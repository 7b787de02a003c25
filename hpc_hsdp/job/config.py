"""Job options from the command line, a TOML config file and its profiles -> a JobSpec.

A config file holds any job option under its option name (``gpus_per_node`` or
``gpus-per-node``), and ``[profiles.NAME]`` tables holding the same keys::

    profile = "dev"                 # the profile used when neither --profile nor $HPC_HSDP_PROFILE says
    nodes = 2
    shard = 4

    [profiles.dev]
    partition = "debug"
    account = "hsdp"
    gpus_per_node = 8
    setup = ["module load cuda/12.4"]
    env = { NCCL_IB_DISABLE = "1" }
    sbatch = { mail-type = "END,FAIL", overcommit = true }
    venv = "/opt/venvs/hsdp"

Precedence, per option: command line > config top level > profile > default. Tables
(``env``, ``sbatch``) merge key by key in that order (``sbatch = { key = false }`` removes
a key a profile set); lists (``setup``, ``pass_env``) are joined: profile's first, then
the config's, then the command line's. Relative paths (``run_dir``, ``venv``,
``template``) in a config file are relative to the file's directory. Unknown keys are an
error naming the key and the file.

Everything here is pure except :func:`load_config`, which reads the file it is given.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.options import CONFIG_ENV, CONFIG_KINDS, OPTIONS, PROFILE_ENV, options_in
from hpc_hsdp.job.spec import (
    EnvironmentSpec,
    JobSpec,
    LaunchSpec,
    RunSpec,
    SchedulerSpec,
    TrainingSpec,
    check_text,
    model_with_absolute_path,
    parse_nodes,
)
from hpc_hsdp.job.training_sections import SECTION_FIELDS, TRAINING_SECTIONS
from hpc_hsdp.plan.mixture import map_data_paths

OPTION_KINDS: Mapping[str, str] = CONFIG_KINDS
"""Config key -> kind of value (from the declarations in :mod:`hpc_hsdp.job.options`)."""
_TOP_LEVEL_ONLY = {"profile": "str", "profiles": "profiles"}
_GIVEN_ALONE = {o.key: (o.flag_value, o.off_word) for o in OPTIONS if o.flag_value is not None}
"""Options a command line may give without a value (``--stage-data``): key -> (the value alone, the
off word)."""


def given_alone(key: str, value: Any) -> Any:
    """``true`` for an option that may be given alone (``stage_data = true``) is the value it takes
    alone on the command line; ``false`` is its off word. Other values pass unchanged."""
    if key in _GIVEN_ALONE and isinstance(value, bool):
        alone, off = _GIVEN_ALONE[key]
        return alone if value else off
    return value


_KIND_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "path": "a path (string)",
    "data": "a path, or a mixture NAME=PATH:WEIGHT,... (a string)",
    "bool": "true or false",
    "nodes": 'a node count (an integer) or "MIN-MAX"',
    "list": "a list of strings",
    "table": "a table of KEY = value",
}
_EXAMPLES = {
    "int": "2",
    "nodes": '2 (or "1-2")',
    "float": "3e-3",
    "str": '"text"',
    "path": '"/path"',
    "data": '"web=/data/web:0.7,code=/data/code:0.3"',
    "bool": "true",
    "list": '["line one", "line two"]',
    "table": '{ KEY = "value" }',
}

_NO_VENV = "none"


def check_kind(key: str, value: Any, kind: str, where: str) -> Any:
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "nodes": lambda v: (
            (isinstance(v, int) and not isinstance(v, bool))
            or (isinstance(v, str) and re.fullmatch(r"\s*[0-9]+(-[0-9]+)?\s*", v) is not None)
        ),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "path": lambda v: isinstance(v, str),
        "data": lambda v: isinstance(v, str),
        "bool": lambda v: isinstance(v, bool),
        "list": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
        "table": lambda v: isinstance(v, dict),
    }[kind](value)
    if not ok:
        raise SpecError(
            f"{key} = {value!r} in {where} must be {_KIND_WORDS[kind]}; write e.g. {key} = {_EXAMPLES[kind]}"
        )
    if kind == "float":
        return float(value)
    if kind == "list":
        return tuple(value)
    if kind == "table":
        return _table(key, value, where)
    return value


def _table(key: str, value: dict, where: str) -> dict[str, str | None | bool]:
    out: dict[str, str | None | bool] = {}
    for name, item in value.items():
        if key == "sbatch" and isinstance(item, bool):
            out[name] = None if item else False  # true: a flag (--KEY); false: drop a key set below
        elif isinstance(item, (str, int, float)) and not isinstance(item, bool):
            out[name] = str(item)
        else:
            raise SpecError(
                f"{key}.{name} = {item!r} in {where} must be a string or number"
                + ("" if key != "sbatch" else " (or true for a flag, false to drop it)")
            )
    return out


def _normalize(table: Mapping[str, Any], *, where: str, base_dir: Path, allowed: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        if key not in allowed:
            import difflib  # noqa: PLC0415 - only for a misspelt key: render's start-up stays lean

            close = difflib.get_close_matches(key, list(allowed), n=3, cutoff=0.6)
            if close:
                raise SpecError(f"unknown key {raw_key!r} in {where}; did you mean {' or '.join(close)}?")
            raise SpecError(
                f"unknown key {raw_key!r} in {where}; the keys are the job options' names with _ "
                f"(hpc-hsdp submit --help lists them: --gpus-per-node is gpus_per_node)"
            )
        if key in out:
            raise SpecError(f"{raw_key!r} is given twice in {where} (as - and _ spellings); keep one")
        kind = allowed[key]
        if kind == "profiles":
            out[key] = value
            continue
        value = check_kind(raw_key, given_alone(key, value), kind, where)
        if kind == "path" and not (key == "venv" and value == _NO_VENV):
            value = str(base_dir / os.path.expanduser(value)) if value else value
        if kind == "data" and value:
            value = map_data_paths(value, lambda path: str(base_dir / os.path.expanduser(path)))
        if key == "model" and isinstance(value, str):
            value = model_with_absolute_path(value, base_dir)
        out[key] = value
    return out


def parse_config(data: Mapping[str, Any], *, path: str | Path) -> dict[str, Any]:
    """Check a parsed TOML document: known keys, value kinds; relative paths made absolute
    against the file's directory. ``profiles`` maps each name to its checked table."""
    path = Path(path)
    base_dir = path.resolve().parent
    top = _normalize(data, where=str(path), base_dir=base_dir, allowed={**OPTION_KINDS, **_TOP_LEVEL_ONLY})
    profiles = top.get("profiles", {})
    if not isinstance(profiles, dict) or not all(isinstance(v, dict) for v in profiles.values()):
        raise SpecError(f"profiles in {path} must hold tables: write [profiles.NAME] with options under it")
    top["profiles"] = {
        name: _normalize(table, where=f"[profiles.{name}] of {path}", base_dir=base_dir, allowed=OPTION_KINDS)
        for name, table in profiles.items()
    }
    return top


def load_config(path: str | Path) -> dict[str, Any]:
    """Read and check a TOML config file (see the module docstring)."""
    if sys.version_info >= (3, 11):
        import tomllib  # noqa: PLC0415  (only when a config file is read: render/submit --help stay as quick)
    else:
        import tomli as tomllib  # noqa: PLC0415  (as above)

    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise SpecError(f"config file {str(path)!r} does not exist; check --config or ${CONFIG_ENV}") from None
    except IsADirectoryError:
        raise SpecError(f"config file {str(path)!r} is a directory; give the path of a .toml file") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"config file {str(path)!r} is not valid TOML ({exc}); fix the file") from None
    except OSError as exc:
        raise SpecError(f"config file {str(path)!r} cannot be read ({exc.strerror})") from None
    return parse_config(data, path=path)


def select_profile(config: Mapping[str, Any] | None, name: str | None, *, config_path: str | None) -> dict[str, Any]:
    """The options of profile ``name`` (None: the config's ``profile`` key, or no profile)."""
    if config is None:
        if name is not None:
            raise SpecError(
                f"profile {name!r} is selected but no config file is given; pass --config FILE or set ${CONFIG_ENV}"
            )
        return {}
    name = name if name is not None else config.get("profile")
    if name is None:
        return {}
    profiles = config.get("profiles", {})
    if name not in profiles:
        known = ", ".join(sorted(profiles)) or "none"
        raise SpecError(
            f"profile {name!r} is not in {config_path} (profiles there: {known}); add [profiles.{name}] or pick another"
        )
    return dict(profiles[name])


def merge_options(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Merge option layers, lowest precedence first (profile, config, command line).

    A scalar takes the value of the highest layer that has one (None means unset); tables
    merge key by key (a False value removes the key); lists are joined in layer order.
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in ("profile", "profiles") or value is None:
                continue
            kind = OPTION_KINDS[key]
            if kind == "table":
                table = dict(merged.get(key, {}))
                for name, item in value.items():
                    if item is False:
                        table.pop(name, None)
                    else:
                        table[name] = item
                merged[key] = table
            elif kind == "list":
                merged[key] = tuple(merged.get(key, ())) + tuple(value)
            else:
                merged[key] = value
    return merged


_SANITIZE = r"[^A-Za-z0-9._-]+"


def default_run_dir(job_name: str, cwd: str | Path, *, new: bool = False) -> str:
    """``<cwd>/hpc-hsdp-runs/<job name>``, the job name reduced to ``[A-Za-z0-9._-]``; with
    ``new`` (every ``submit``), ``<job name>-<YYYYmmdd-HHMMSS>`` that does not exist yet, so that a
    second submission starts a run of its own instead of resuming (or ending) the first."""
    safe = re.sub(_SANITIZE, "_", job_name).strip("._") or "job"
    base = Path(cwd) / "hpc-hsdp-runs" / safe
    if not new:
        return str(base)
    stamped = base.with_name(f"{safe}-{time.strftime('%Y%m%d-%H%M%S')}")
    candidate, n = stamped, 1
    while candidate.exists():
        n += 1
        candidate = stamped.with_name(f"{stamped.name}-{n}")
    return str(candidate)


def build_job_spec(
    options: Mapping[str, Any], *, cwd: str | Path, default_venv: str | None = None, new_run_dir: bool = False
) -> JobSpec:
    """A JobSpec from merged options (config keys), filling the defaults.

    ``cwd``: against which a relative ``run_dir``/``venv``/``template`` of the command line
    is made absolute (config-file paths already are). ``default_venv``: the venv used when
    none is given (the caller passes the running interpreter's, if any); ``venv = "none"``
    turns activation off. ``new_run_dir``: without a ``run_dir``, a new directory for this job
    (``submit``) rather than the job name's (``render``).
    """
    unknown = set(options) - set(OPTION_KINDS)
    if unknown:
        raise SpecError(f"unknown job option(s) {', '.join(sorted(unknown))}")
    if options.get("shard") is None:
        raise SpecError(
            "--shard is required: give the shard-group size, e.g. --shard 4 (or shard = 4 in the config file)"
        )
    given = {key: value for key, value in options.items() if value is not None}
    o = {**{declared.key: declared.default for declared in OPTIONS if declared.in_config}, **given}
    absolute = functools.partial(_absolute_against, cwd)
    if o["run_dir"] is not None:
        o["run_dir"] = absolute(o["run_dir"], "--run-dir")
    else:
        o["run_dir"] = default_run_dir(str(o["job_name"]), cwd, new=new_run_dir)
    if o["venv"] == _NO_VENV:
        o["venv"] = None
    elif o["venv"] is not None:
        o["venv"] = absolute(o["venv"], "--venv")
    else:
        o["venv"] = default_venv if o["conda_env"] is None else None
    o["model"] = model_with_absolute_path(o["model"], cwd)

    def fields(place: str) -> dict[str, Any]:
        """The fields of the section at ``place`` in a JobSpec (:func:`~hpc_hsdp.job.options.options_in`):
        the other paths made absolute against ``cwd`` (a config file's already are), tables and lists as tuples."""
        values = {}
        for declared in options_in(place):
            value = o[declared.key]
            if isinstance(value, str) and declared.off_word is not None and value.lower() == declared.off_word:
                value = None
            if value is not None and declared.key not in ("run_dir", "venv"):  # resolved above
                if declared.kind == "path":
                    value = absolute(value, declared.flag)
                elif declared.kind == "data":
                    value = map_data_paths(value, functools.partial(absolute, option=declared.flag))
                elif declared.kind == "table":
                    value = tuple(dict(value).items())
                elif declared.kind == "list":
                    value = tuple(value)
            values[declared.attribute] = value
        return values

    # built in this order so that, of several bad options, the same one is reported as before
    sections = zip(SECTION_FIELDS, TRAINING_SECTIONS, strict=True)
    training = TrainingSpec(**{name: kind(**fields(f"run.training.{name}")) for name, kind in sections})
    run = RunSpec(**fields("run"), training=training)
    scheduler = SchedulerSpec(**fields("scheduler"))
    environment, launch = EnvironmentSpec(**fields("environment")), LaunchSpec(**fields("launch"))
    min_nodes, o["nodes"] = parse_nodes(o["nodes"])
    return JobSpec(
        **fields(""),
        min_nodes=min_nodes if min_nodes != o["nodes"] else None,
        run=run,
        scheduler=scheduler,
        environment=environment,
        launch=launch,
    )


def _absolute_against(cwd: str | Path, value: str, option: str) -> str:
    if value == "":
        raise SpecError(f"{option} is empty; give a path or leave the option out")
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(value)))


def key_value_items(option: str, items: tuple[str, ...], *, flag_ok: bool) -> dict[str, str | None]:
    """``--env``/``--sbatch`` items as the command line gives them (``KEY=VALUE``; ``KEY`` alone a
    flag where ``flag_ok``) -> a table."""
    out: dict[str, str | None] = {}
    for item in items:
        check_text(option, item)
        key, sep, value = item.partition("=")
        if not sep:
            if not flag_ok:
                raise SpecError(
                    f"{option} {item!r} is not KEY=VALUE; write {option} {item}=value, "
                    f"or --pass-env {item} to pass it by name"
                )
            out[key] = None
        else:
            out[key] = value
        if not key:
            raise SpecError(f"{option} {item!r} has no KEY before '='; write KEY=VALUE")
    return out


def command_line_layer(values: Mapping[str, Any]) -> dict[str, Any]:
    """The options of one call (the command line's, or ``hpc_hsdp.submit``'s keywords), by config
    key, as a layer above the config file: unset ones (None, empty) left out, tables given as
    ``KEY=VALUE`` items."""
    layer: dict[str, Any] = {}
    for declared in OPTIONS:
        value = values.get(declared.key)
        if not declared.in_config or value is None or value == ():
            continue
        if declared.kind == "table":
            value = key_value_items(declared.flag, value, flag_ok=declared.key == "sbatch")
        elif declared.kind == "list":
            value = tuple(value)
        layer[declared.key] = value
    return layer


def running_venv() -> str | None:
    """The running interpreter's virtualenv, when it runs in one."""
    return os.path.abspath(sys.prefix) if sys.prefix != sys.base_prefix else None


def resolve_job_spec(
    command_line: Mapping[str, Any],
    *,
    config_path: str | None,
    profile_name: str | None,
    environ: Mapping[str, str],
    cwd: str | Path,
    default_venv: str | None,
    new_run_dir: bool = False,
) -> JobSpec:
    """The JobSpec of one call's options (a :func:`command_line_layer`): the config file
    (``config_path`` or ``$HPC_HSDP_CONFIG``), its profile (``profile_name``,
    ``$HPC_HSDP_PROFILE`` or the file's ``profile`` key), precedence command line > config >
    profile > default, validation. Raises SpecError/TopologyError."""
    config_path = config_path or environ.get(CONFIG_ENV) or None
    profile_name = profile_name or environ.get(PROFILE_ENV) or None
    config = load_config(os.path.join(cwd, os.path.expanduser(config_path))) if config_path else None
    profile = select_profile(config, profile_name, config_path=config_path)
    top = {k: v for k, v in (config or {}).items() if k not in ("profile", "profiles")}
    options = merge_options(profile, top, command_line)
    return build_job_spec(options, cwd=cwd, default_venv=default_venv, new_run_dir=new_run_dir)
