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

import os
import re
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import (
    DEFAULT_SIGNAL,
    EnvironmentSpec,
    JobSpec,
    LaunchSpec,
    RunSpec,
    SchedulerSpec,
    TrainingSpec,
    model_with_absolute_path,
    option_flag,
    parse_nodes,
    training_field_kind,
)

CONFIG_ENV = "HPC_HSDP_CONFIG"
"""Environment variable naming the config file when ``--config`` is not given."""
PROFILE_ENV = "HPC_HSDP_PROFILE"
"""Environment variable naming the profile when ``--profile`` is not given."""

_TRAINING_KINDS = {f.name: "path" if f.metadata.get("path") else training_field_kind(f) for f in fields(TrainingSpec)}

# option (config key) -> kind of value
OPTION_KINDS: dict[str, str] = {
    "nodes": "nodes",
    "gpus_per_node": "int",
    "shard": "int",
    "ntasks": "int",
    "job_name": "str",
    "partition": "str",
    "account": "str",
    "qos": "str",
    "time": "str",
    "constraint": "str",
    "exclusive": "bool",
    "mem": "str",
    "cpus_per_task": "int",
    "signal": "str",
    "requeue": "bool",
    "run_dir": "path",
    "setup": "list",
    "env": "table",
    "pass_env": "list",
    "sbatch": "table",
    "launcher": "str",
    "distribution": "str",
    "entry": "str",
    "device": "str",
    "timeout": "int",
    "comm_stats": "bool",
    "container_image": "str",
    "container_mounts": "str",
    "debug": "bool",
    "venv": "path",
    "conda_env": "str",
    "python": "str",
    "template": "path",
    **_TRAINING_KINDS,
}
_TOP_LEVEL_ONLY = {"profile": "str", "profiles": "profiles"}

_KIND_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "path": "a path (string)",
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
            close = [k for k in allowed if k.startswith(key[:3])][:3]
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise SpecError(
                f"unknown key {raw_key!r} in {where}{hint}; known keys are the job options: {', '.join(sorted(allowed))}"
            )
        if key in out:
            raise SpecError(f"{raw_key!r} is given twice in {where} (as - and _ spellings); keep one")
        kind = allowed[key]
        if kind == "profiles":
            out[key] = value
            continue
        value = check_kind(raw_key, value, kind, where)
        if kind == "path" and not (key == "venv" and value == _NO_VENV):
            value = str(base_dir / os.path.expanduser(value)) if value else value
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
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

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


_SANITIZE = re.compile(r"[^A-Za-z0-9._-]+")


def default_run_dir(job_name: str, cwd: str | Path, *, new: bool = False) -> str:
    """``<cwd>/hpc-hsdp-runs/<job name>``, the job name reduced to ``[A-Za-z0-9._-]``; with
    ``new`` (every ``submit``), ``<job name>-<YYYYmmdd-HHMMSS>`` that does not exist yet, so that a
    second submission starts a run of its own instead of resuming (or ending) the first."""
    safe = _SANITIZE.sub("_", job_name).strip("._") or "job"
    base = Path(cwd) / "hpc-hsdp-runs" / safe
    if not new:
        return str(base)
    import time

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
    o = dict(options)
    unknown = set(o) - set(OPTION_KINDS)
    if unknown:
        raise SpecError(f"unknown job option(s) {', '.join(sorted(unknown))}")
    if o.get("shard") is None:
        raise SpecError(
            "--shard is required: give the shard-group size, e.g. --shard 4 (or shard = 4 in the config file)"
        )

    def absolute(value: str | None, option: str) -> str | None:
        if value is None:
            return None
        if value == "":
            raise SpecError(f"{option} is empty; give a path or leave the option out")
        return os.path.normpath(os.path.join(cwd, os.path.expanduser(value)))

    job_name = o.get("job_name", "hpc-hsdp")
    if o.get("run_dir") is not None:
        run_dir = absolute(o["run_dir"], "--run-dir")
    else:
        run_dir = default_run_dir(str(job_name), cwd, new=new_run_dir)
    venv_option = o.get("venv")
    if venv_option == _NO_VENV:
        venv = None
    elif venv_option is not None:
        venv = absolute(venv_option, "--venv")
    else:
        venv = default_venv if o.get("conda_env") is None else None
    signal = o.get("signal", DEFAULT_SIGNAL)
    if isinstance(signal, str) and signal.lower() == "none":
        signal = None

    training_values = {name: o[name] for name in _TRAINING_KINDS if o.get(name) is not None}
    for name, kind in _TRAINING_KINDS.items():
        if kind == "path" and name in training_values:
            training_values[name] = absolute(training_values[name], option_flag(name))
    if isinstance(training_values.get("model"), str):
        training_values["model"] = model_with_absolute_path(training_values["model"], cwd)
    training = TrainingSpec(**training_values)
    run = RunSpec(
        shard_size=o["shard"],
        run_dir=run_dir,
        device=o.get("device", "auto"),
        entry=o.get("entry"),
        training=training,
        **({"timeout_s": o["timeout"]} if o.get("timeout") is not None else {}),
        comm_stats=o.get("comm_stats", False),
    )
    scheduler = SchedulerSpec(
        job_name=job_name,
        partition=o.get("partition"),
        account=o.get("account"),
        qos=o.get("qos"),
        time=o.get("time"),
        constraint=o.get("constraint"),
        exclusive=o.get("exclusive", SchedulerSpec.exclusive),
        mem=o.get("mem"),
        cpus_per_task=o.get("cpus_per_task"),
        signal=signal,
        requeue=o.get("requeue", True),
        extra=tuple(o.get("sbatch", {}).items()),
    )
    environment = EnvironmentSpec(
        setup=tuple(o.get("setup", ())),
        venv=venv,
        conda_env=o.get("conda_env"),
        env=tuple(o.get("env", {}).items()),
        pass_env=tuple(o.get("pass_env", ())),
        debug=o.get("debug", False),
        python=o.get("python", "python"),
    )
    launch = LaunchSpec(
        launcher=o.get("launcher", "srun"),
        distribution=o.get("distribution", "block"),
        container_image=o.get("container_image"),
        container_mounts=o.get("container_mounts"),
    )
    min_nodes, nodes = parse_nodes(o.get("nodes", 1))
    return JobSpec(
        nodes=nodes,
        min_nodes=min_nodes if min_nodes != nodes else None,
        gpus_per_node=o.get("gpus_per_node", 8),
        ntasks=o.get("ntasks"),
        run=run,
        scheduler=scheduler,
        environment=environment,
        launch=launch,
        template=absolute(o.get("template"), "--template"),
    )
