"""The job options shared by ``render`` and ``submit``, and their one way to a JobSpec.

``@job_options`` adds every job option to a click command (all default to None, so that
a config file and its profile can fill what the command line leaves out);
:func:`job_spec_from_options` takes the command's kwargs and does config loading, profile
selection, precedence (command line > config top level > profile > default) and
validation. Keys of the kwargs that are not job options (a command's own) are ignored.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click

from hpc_hsdp.cli.options import training_options
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.config import (
    CONFIG_ENV,
    PROFILE_ENV,
    build_job_spec,
    load_config,
    merge_options,
    select_profile,
)
from hpc_hsdp.job.spec import DEVICES, LAUNCHERS, JobSpec, TrainingSpec
from hpc_hsdp.plan.slurm_facts import DEFAULT_SIGNAL, DISTRIBUTIONS, check_text

# click parameter name -> config key (the option's name in a config file), where they differ
_RENAMED = {"shard_size": "shard", "time_limit": "time", "sbatch_options": "sbatch", "env_vars": "env"}
# click parameter names of the options that job_options adds
JOB_OPTION_NAMES = (
    "config",
    "profile",
    "nodes",
    "gpus_per_node",
    "shard_size",
    "ntasks",
    "job_name",
    "partition",
    "account",
    "qos",
    "time_limit",
    "constraint",
    "exclusive",
    "mem",
    "cpus_per_task",
    "signal",
    "requeue",
    "run_dir",
    "setup",
    "env_vars",
    "pass_env",
    "sbatch_options",
    "launcher",
    "distribution",
    "entry",
    "device",
    "timeout",
    "comm_stats",
    "container_image",
    "container_mounts",
    "debug",
    "venv",
    "conda_env",
    "python",
    "template",
    *(f"training_{name}" for name in TrainingSpec.__dataclass_fields__),
)


class NodeCount(click.ParamType):
    """``--nodes``: ``2`` (an int) or ``1-2`` (a flexible allocation, kept as text)."""

    name = "nodes"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value is None:
            return value
        text = str(value).strip()
        return int(text) if text.isdigit() else text  # MIN-MAX and typos: checked with the spec, one line


NODES = NodeCount()


def config_key(name: str) -> str:
    """The config-file key (and Python API keyword) of a click parameter of ``@job_options``."""
    return name.removeprefix("training_") if name.startswith("training_") else _RENAMED.get(name, name)


def job_options(command):
    """Add every job option to a click command (see ``hpc-hsdp render --help``)."""
    decorators = [
        click.option(
            "--config",
            "config",
            default=None,
            metavar="FILE",
            help=f"TOML file with job options and [profiles.NAME] tables.  [default: ${CONFIG_ENV}]",
        ),
        click.option(
            "--profile",
            "profile",
            default=None,
            metavar="NAME",
            help=f"Profile of the config file to apply (below the file's top level).  [default: ${PROFILE_ENV}]",
        ),
        click.option(
            "--nodes",
            type=NODES,
            default=None,
            metavar="N|MIN-MAX",
            help="Nodes in the job; MIN-MAX (e.g. 1-2): a flexible allocation, the mesh follows the nodes "
            "SLURM grants and the global batch stays the same.  [default: 1]",
        ),
        click.option(
            "--gpus-per-node",
            type=int,
            default=None,
            help="GPUs per node; one task (srun) or torchrun worker each.  [default: 8]",
        ),
        click.option(
            "--shard",
            "shard_size",
            type=int,
            default=None,
            help="Shard-group size S (required here or in the config): divides a node or is a multiple of it.",
        ),
        click.option(
            "--ntasks",
            type=int,
            default=None,
            help="Total tasks for an uneven allocation (e.g. 12 on 2 nodes: 8,4); replaces --ntasks-per-node.",
        ),
        click.option("--job-name", default=None, help="#SBATCH --job-name.  [default: hpc-hsdp]"),
        click.option("--partition", default=None, help="#SBATCH --partition."),
        click.option("--account", default=None, help="#SBATCH --account."),
        click.option("--qos", default=None, help="#SBATCH --qos."),
        click.option(
            "--time",
            "time_limit",
            default=None,
            metavar="TIME",
            help="Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS.",
        ),
        click.option("--constraint", default=None, help="#SBATCH --constraint (node features, e.g. 'h100&ib')."),
        click.option(
            "--exclusive/--no-exclusive",
            default=None,
            help="Whole nodes (#SBATCH --exclusive): every rank gets an equal share of its node's CPUs and "
            "memory.  [default: yes]",
        ),
        click.option(
            "--mem", default=None, help="Memory per node, e.g. 512G (0: all of it).  [default: 0 with --exclusive]"
        ),
        click.option(
            "--cpus-per-task",
            type=int,
            default=None,
            help="CPUs per task (also passed to srun).  [default: the node's CPUs / its tasks, at run time]",
        ),
        click.option(
            "--signal",
            default=None,
            metavar="SIG@SECONDS",
            help=f"Signal sent before the time limit; 'none' for no signal.  [default: {DEFAULT_SIGNAL}]",
        ),
        click.option("--requeue/--no-requeue", default=None, help="Let SLURM requeue the job.  [default: requeue]"),
        click.option(
            "--run-dir",
            default=None,
            metavar="DIR",
            help="Run directory (made absolute); logs in DIR/logs; an existing one resumes.  [default: render: "
            "./hpc-hsdp-runs/<job-name>; submit: a new ./hpc-hsdp-runs/<job-name>-<date-time>]",
        ),
        click.option(
            "--setup",
            multiple=True,
            metavar="LINE",
            help="A raw shell line run before launch (module load ...); repeatable; not quoted.",
        ),
        click.option(
            "--env",
            "env_vars",
            multiple=True,
            metavar="KEY=VALUE",
            help="Export a variable (value quoted); repeatable.",
        ),
        click.option(
            "--pass-env",
            multiple=True,
            metavar="NAME",
            help="Pass a variable by name from the submitting environment (never written); repeatable.",
        ),
        click.option(
            "--sbatch",
            "sbatch_options",
            multiple=True,
            metavar="KEY=VALUE",
            help="Extra '#SBATCH --KEY=VALUE' (KEY alone: a flag); repeatable.",
        ),
        click.option(
            "--launcher",
            type=click.Choice(LAUNCHERS),
            default=None,
            help="srun: one task per GPU; torchrun: one task per node, static rendezvous.  [default: srun]",
        ),
        click.option(
            "--distribution",
            type=click.Choice(DISTRIBUTIONS),
            default=None,
            help="srun --distribution; the layout is node-major either way.  [default: block]",
        ),
        click.option(
            "--entry",
            default=None,
            metavar="MODULE:FUNCTION",
            help="Your training function, called on every rank.  [default: the built-in payload]",
        ),
        click.option(
            "--device", type=click.Choice(DEVICES), default=None, help="Device of each rank.  [default: auto]"
        ),
        click.option(
            "--timeout", type=int, default=None, metavar="SECONDS", help="Process-group timeout.  [default: 300]"
        ),
        click.option(
            "--comm-stats/--no-comm-stats",
            default=None,
            help="Record each step's collectives (bytes per mesh axis, intra-/inter-node) in metrics.jsonl.  [default: no]",
        ),
        click.option("--container-image", default=None, help="Pyxis container image for srun."),
        click.option("--container-mounts", default=None, help="Pyxis container mounts for srun (/src:/dst,...)."),
        click.option(
            "--debug/--no-debug",
            default=None,
            help="NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL, ...  [default: no]",
        ),
        click.option(
            "--venv",
            default=None,
            metavar="PATH",
            help="Virtualenv to activate ('none': no activation).  [default: the running interpreter's venv]",
        ),
        click.option(
            "--conda-env", default=None, metavar="NAME", help="Conda environment to activate instead of a venv."
        ),
        click.option("--python", default=None, help="Interpreter name the script calls.  [default: python]"),
        click.option(
            "--template",
            default=None,
            metavar="PATH",
            help="Your own Jinja2 template (gets the same variables; may extend job.sbatch.j2).",
        ),
    ]
    command = training_options(command)
    for decorator in reversed(decorators):
        command = decorator(command)
    return command


def _key_value(option: str, items: tuple[str, ...], *, flag_ok: bool) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for item in items:
        check_text(option, item)
        key, sep, value = item.partition("=")
        if not sep:
            if not flag_ok:
                raise SpecError(
                    f"{option} {item!r} is not KEY=VALUE; write {option} {item}=value, or --pass-env {item} to pass it by name"
                )
            out[key] = None
        else:
            out[key] = value
        if not key:
            raise SpecError(f"{option} {item!r} has no KEY before '='; write KEY=VALUE")
    return out


def cli_layer(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The options given on the command line, as config keys (unset ones left out)."""
    layer: dict[str, Any] = {}
    for name in JOB_OPTION_NAMES:
        if name in ("config", "profile"):
            continue
        value = kwargs.get(name)
        if value is None or value == ():
            continue
        key = config_key(name)
        if key == "env":
            value = _key_value("--env", value, flag_ok=False)
        elif key == "sbatch":
            value = _key_value("--sbatch", value, flag_ok=True)
        elif key in ("setup", "pass_env"):
            value = tuple(value)
        layer[key] = value
    return layer


def running_venv() -> str | None:
    """The running interpreter's virtualenv, when it runs in one."""
    return os.path.abspath(sys.prefix) if sys.prefix != sys.base_prefix else None


def job_spec_from_options(
    kwargs: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    default_venv: str | None | bool = True,
    new_run_dir: bool = False,
) -> JobSpec:
    """The JobSpec of a command's kwargs (from ``@job_options``): config file (``--config``
    or ``$HPC_HSDP_CONFIG``), profile (``--profile``, ``$HPC_HSDP_PROFILE`` or the file's
    ``profile`` key), precedence command line > config > profile > default, validation.

    ``environ``/``cwd`` default to the process's; ``default_venv=True`` means the running
    interpreter's venv (pass a path or None to fix it). Raises SpecError/TopologyError.
    """
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    if default_venv is True:
        default_venv = running_venv()
    config_path = kwargs.get("config") or environ.get(CONFIG_ENV) or None
    profile_name = kwargs.get("profile") or environ.get(PROFILE_ENV) or None
    config = load_config(os.path.join(cwd, os.path.expanduser(config_path))) if config_path else None
    profile = select_profile(config, profile_name, config_path=config_path)
    top = {k: v for k, v in (config or {}).items() if k not in ("profile", "profiles")}
    options = merge_options(profile, top, cli_layer(kwargs))
    return build_job_spec(options, cwd=cwd, default_venv=default_venv or None, new_run_dir=new_run_dir)
