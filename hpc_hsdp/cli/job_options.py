"""From the click kwargs of ``render`` and ``submit`` to a JobSpec.

The commands get their options from the registry (``@command_options("render")``, see
:mod:`hpc_hsdp.cli.click_options`), all defaulting to None so that a config file and its profile
can fill what the command line leaves out; :func:`job_spec_from_options` takes the
command's kwargs and hands them, by config key, to the config loading, profile selection,
precedence (command line > config top level > profile > default) and validation of
:mod:`hpc_hsdp.job.config`. Keys of the kwargs that are not job options (a command's own)
are ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_hsdp.job.config import command_line_layer, resolve_job_spec, running_venv
from hpc_hsdp.job.options import options_of
from hpc_hsdp.job.spec import JobSpec


def job_spec_from_options(
    kwargs: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    default_venv: str | None | bool = True,
    new_run_dir: bool = False,
) -> JobSpec:
    """The JobSpec of a command's kwargs (from ``@command_options("render")``): config file
    (``--config`` or ``$HPC_HSDP_CONFIG``), profile (``--profile``, ``$HPC_HSDP_PROFILE`` or the
    file's ``profile`` key), precedence command line > config > profile > default, validation.

    ``environ``/``cwd`` default to the process's; ``default_venv=True`` means the running
    interpreter's venv (pass a path or None to fix it). Raises SpecError/TopologyError.
    """
    return job_spec_resolver(environ=environ, cwd=cwd, default_venv=default_venv)(given_options(kwargs), new_run_dir)


def given_options(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The job options of a command's kwargs, by config key (None: not given; submit's are render's
    and --cluster)."""
    return {declared.key: kwargs.get(declared.click_param) for declared in options_of("submit")}


def job_spec_resolver(
    *, environ: Mapping[str, str] | None = None, cwd: str | Path | None = None, default_venv: str | None | bool = True
):
    """``resolve(given, new_run_dir) -> JobSpec`` of options by config key, as :func:`job_spec_from_options`
    makes it (a sweep makes one per point)."""
    environ = os.environ if environ is None else environ
    cwd = os.getcwd() if cwd is None else cwd
    venv = (running_venv() if default_venv is True else default_venv) or None

    def resolve(given: Mapping[str, Any], new_run_dir: bool = False) -> JobSpec:
        return resolve_job_spec(
            command_line_layer(given),
            config_path=given.get("config"),
            profile_name=given.get("profile"),
            environ=environ,
            cwd=cwd,
            default_venv=venv,
            new_run_dir=new_run_dir,
        )

    return resolve
