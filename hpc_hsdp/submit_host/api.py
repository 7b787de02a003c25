"""The Python API: ``hpc_hsdp.submit(fn, nodes=2, shard=4, ...)``, the options of ``hpc-hsdp
submit`` as keyword arguments, made into the same JobSpec the command line makes."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.config import (
    OPTION_KINDS,
    check_kind,
    command_line_layer,
    given_alone,
    resolve_job_spec,
    running_venv,
)
from hpc_hsdp.job.options import OPTIONS
from hpc_hsdp.job.sweep import check_sweep_given
from hpc_hsdp.submit_host.submission import submit_spec


def submit(fn: Callable | None = None, **options):
    """Python API: submit a job with the options of ``hpc-hsdp submit`` (as keyword
    arguments, ``nodes=2, shard=4, ...``); ``fn(ctx)``, when given, runs on every rank
    after the mesh is built. Returns submitit's Job (SLURM) or a LocalJob with the same
    ``job_id``, ``state``, ``done()``, ``wait()``, ``results()``, ``cancel()``."""
    spec = api_job_spec(options, environ=os.environ, cwd=os.getcwd(), default_venv=running_venv(), new_run_dir=True)
    if spec.sweep:
        raise SpecError("submit() submits one job; a sweep goes through hpc_hsdp.submit_sweep(sweep=..., ...)")
    check_sweep_given(spec, options)
    _, job, _ = submit_spec(spec, fn=fn)
    return job


def submit_sweep(
    sweep: Mapping[str, Any] | list[str],
    *,
    mode: str | None = None,
    array_parallelism: int | None = None,
    **options,
):
    """Python API of ``hpc-hsdp submit --sweep``: ``sweep`` maps options to their values
    (``{"lr": [3e-4, 1e-3], "seed": [0, 1]}``, each read as its command line option would read
    it) or lists ``--sweep`` texts; the other keywords are :func:`submit`'s. One job array (one per
    distinct ``#SBATCH`` header, where ``nodes``, ``time`` ... are swept), every point a whole job of
    its own; ``array_parallelism`` bounds each array. Returns the sweep's handle: ``wait()`` gives every point's
    result (state, last step, loss, eval loss, run directory), best first; ``results()``,
    ``statuses()``, ``cancel()``."""
    from hpc_hsdp.submit_host.sweep_handle import SweepHandle  # noqa: PLC0415
    from hpc_hsdp.submit_host.sweep_submission import plan_sweep  # noqa: PLC0415
    from hpc_hsdp.submit_host.sweep_submission import submit_sweep as submit_plan  # noqa: PLC0415

    if "sweep_mode" in options:
        raise SpecError("submit_sweep() takes the sweep's mode as mode=")
    if not isinstance(sweep, (Mapping, list, tuple)) or not sweep:
        raise SpecError('submit_sweep(sweep=...) takes a dict of option -> values, e.g. {"lr": [3e-4, 1e-3]}')
    given = api_options({**options, "sweep_mode": mode, "array_parallelism": array_parallelism})
    environ, cwd, venv = os.environ, os.getcwd(), running_venv()

    def resolve(chosen, new_run_dir=False):
        return resolve_job_spec(
            command_line_layer(chosen),
            config_path=chosen.get("config"),
            profile_name=chosen.get("profile"),
            environ=environ,
            cwd=cwd,
            default_venv=venv,
            new_run_dir=new_run_dir,
        )

    plan = plan_sweep(given, resolve=resolve, sweep=sweep if isinstance(sweep, Mapping) else list(sweep))
    record, _ = submit_plan(plan)
    return SweepHandle(record)


def api_job_spec(
    options: dict[str, Any],
    *,
    environ: Mapping[str, str],
    cwd: str | Path,
    default_venv: str | None,
    new_run_dir: bool = False,
):
    """The JobSpec of :func:`submit`'s keyword arguments, as ``hpc-hsdp submit`` makes it of the
    same options on its command line (config file, profile, precedence)."""
    given = api_options(options)
    return resolve_job_spec(
        command_line_layer(given),
        config_path=given.get("config"),
        profile_name=given.get("profile"),
        environ=environ,
        cwd=cwd,
        default_venv=default_venv,
        new_run_dir=new_run_dir,
    )


def api_options(options: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of :func:`submit`, named like the config-file keys (``shard``,
    ``gpus_per_node``, ``env`` and ``sbatch`` as dicts, ``setup`` a string or a list) ->
    the same options as ``hpc-hsdp submit``'s command line gives them (tables as ``KEY=VALUE``
    items). Values are checked as a config file's are."""
    known = {declared.key for declared in OPTIONS}
    converted: dict[str, Any] = {}
    for name, value in options.items():
        if name not in known:
            raise SpecError(f"submit() got an unknown option {name!r}; known options: {', '.join(sorted(known))}")
        kind = OPTION_KINDS.get(name, "path")  # config, profile: strings
        value = given_alone(name, value)
        if value is not None:
            if kind == "table" and isinstance(value, dict):
                table = check_kind(name, value, kind, "submit()")  # true: a flag (sbatch), false: left out
                value = tuple(k if v is None else f"{k}={v}" for k, v in table.items() if v is not False)
            else:
                if kind in ("list", "table") and isinstance(value, (str, tuple)):
                    value = [value] if isinstance(value, str) else list(value)  # one line, or KEY=VALUE items
                value = check_kind(name, value, "list" if kind == "table" else kind, "submit()")
        converted[name] = value
    return converted
