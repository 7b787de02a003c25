"""The option registry (hpc_hsdp.job.options) and what is derived from it agree: the click
options of every command that takes an option, the config keys and kinds, the spec fields'
defaults, the Python API keywords and the `hpc-hsdp run` arguments of the rendered script."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import click
import pytest

from hpc_hsdp.cli.options import run_spec_from_options
from hpc_hsdp.cli.plan_cmd import plan
from hpc_hsdp.cli.render_cmd import render
from hpc_hsdp.cli.run_cmd import run
from hpc_hsdp.cli.submit_cmd import submit
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.config import OPTION_KINDS, build_job_spec
from hpc_hsdp.job.options import (
    OPTIONS,
    RUN_ARGUMENT,
    RUN_ARGUMENTS,
    TRAINING_OPTIONS,
    option,
    options_of,
)
from hpc_hsdp.job.scheduler import api_options
from hpc_hsdp.job.spec import EnvironmentSpec, JobSpec, LaunchSpec, RunSpec, SchedulerSpec, TrainingSpec

COMMANDS = {"render": render, "submit": submit, "run": run, "plan": plan}
OWN_OPTIONS = {  # what a command has besides the registry's options
    "render": {"output_path", "make_log_dir"},
    "submit": {"cluster", "wait", "dry_run"},
    "run": set(),
}


def _params(command: click.Command) -> dict[str, click.Parameter]:
    return {p.name: p for p in command.params if p.name != "help"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_of_a_command_is_a_click_option_with_its_flag(name: str) -> None:
    params = _params(COMMANDS[name])
    taken = options_of(name)
    assert taken, f"{name} takes no registry option"
    for declared in taken:
        assert declared.click_param in params, f"{name} lacks {declared.flag}"
        assert declared.flag in params[declared.click_param].opts
    if name in OWN_OPTIONS:
        registry_params = {declared.click_param for declared in taken}
        assert set(params) - registry_params == OWN_OPTIONS[name]
        assert [p for p in params if p in registry_params] == [declared.click_param for declared in taken]


def test_render_and_submit_take_the_same_options_and_every_option_has_a_command() -> None:
    assert options_of("render") == options_of("submit")
    assert all(declared.commands for declared in OPTIONS)
    assert len({declared.key for declared in OPTIONS}) == len(OPTIONS)


def test_every_option_is_a_config_key_of_its_kind_except_the_file_selectors() -> None:
    assert set(OPTION_KINDS) == {declared.key for declared in OPTIONS} - {"config", "profile"}
    for declared in OPTIONS:
        if declared.in_config:
            assert OPTION_KINDS[declared.key] == declared.kind


def test_the_training_options_are_the_training_spec_fields_in_order_with_their_kinds() -> None:
    fields = dataclasses.fields(TrainingSpec)
    assert [f.name for f in fields] == [declared.key for declared in TRAINING_OPTIONS]
    for f, declared in zip(fields, TRAINING_OPTIONS, strict=True):
        annotation = f.type.split("|")[0].strip()
        assert annotation == {"path": "str", "data": "str"}.get(declared.kind, declared.kind), f.name
        assert ("None" in f.type) == (declared.default is None), f.name
        assert f.default == declared.default and f.metadata["option"] is declared


@pytest.mark.parametrize(
    ("spec_class", "fields_by_key"),
    [
        (RunSpec, {"device": "device", "entry": "entry", "timeout": "timeout_s", "comm_stats": "comm_stats"}),
        (SchedulerSpec, {"job_name": "job_name", "exclusive": "exclusive", "signal": "signal", "requeue": "requeue"}),
        (EnvironmentSpec, {"debug": "debug", "python": "python"}),
        (LaunchSpec, {"launcher": "launcher", "distribution": "distribution"}),
        (JobSpec, {"nodes": "nodes", "gpus_per_node": "gpus_per_node"}),
    ],
)
def test_spec_fields_take_their_defaults_from_the_registry(spec_class, fields_by_key: dict[str, str]) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(spec_class)}
    for key, field_name in fields_by_key.items():
        assert defaults[field_name] == option(key).default, (spec_class.__name__, key)


def test_defaults_of_a_bare_job_are_the_declared_ones(tmp_path) -> None:
    spec = build_job_spec({"shard": 1}, cwd=tmp_path)
    values = {
        "nodes": spec.nodes,
        "gpus_per_node": spec.gpus_per_node,
        "job_name": spec.scheduler.job_name,
        "exclusive": spec.scheduler.exclusive,
        "signal": spec.scheduler.signal,
        "requeue": spec.scheduler.requeue,
        "device": spec.run.device,
        "timeout": spec.run.timeout_s,
        "comm_stats": spec.run.comm_stats,
        "launcher": spec.launch.launcher,
        "distribution": spec.launch.distribution,
        "debug": spec.environment.debug,
        "python": spec.environment.python,
    }
    assert values == {key: option(key).default for key in values}
    assert spec.run.training == TrainingSpec()


def test_the_python_api_takes_every_config_key_and_the_file_selectors() -> None:
    accepted = api_options({declared.key: None for declared in OPTIONS})
    assert set(accepted) == {declared.key for declared in OPTIONS}
    with pytest.raises(SpecError, match="unknown option 'comm-stats'"):
        api_options({"comm-stats": True})


# ----------------------------------------------------------------------------- to_args round trip

_SAMPLES = {
    "shard": 2,
    "run_dir": "/runs/round-trip",
    "entry": "mypkg.train:main",
    "model": "mypkg.models:build",
    "shard_unit": "Block",
    "heads": 2,
    "width": 68,
    "data": "/data/train",
    "val_data": "/data/val",
    "tracker": "wandb,mlflow",
}


def _non_default(declared) -> object:
    if declared.key in _SAMPLES:
        return _SAMPLES[declared.key]
    if declared.kind == "bool":
        return not declared.default
    if declared.choices:
        return next(choice for choice in declared.choices if choice != declared.default)
    if declared.kind == "int":
        return 7 if declared.default is None else declared.default + 1
    if declared.kind == "float":
        return declared.default + 0.25
    raise AssertionError(f"no sample value for {declared.key}")


_RUN_OPTIONS = [option(key) for key in RUN_ARGUMENTS] + list(TRAINING_OPTIONS)


def _run_spec(values: dict) -> RunSpec:
    own = {"shard_size": 1, "run_dir": "/runs/base"}
    training = {}
    for declared in _RUN_OPTIONS:
        if declared.key in values:
            (training if declared.training else own)[declared.attribute] = values[declared.key]
    if "val_data" in training:
        training.setdefault("data", _SAMPLES["data"])
    return RunSpec(**own, training=TrainingSpec(**training))


def _parsed_back(spec: RunSpec) -> RunSpec:
    return run_spec_from_options(run.make_context("run", spec.to_args()).params)


def test_every_option_reaching_the_tasks_is_an_argument_of_run() -> None:
    reaching = {declared.key for declared in OPTIONS if declared.reaches == RUN_ARGUMENT}
    assert reaching == {declared.key for declared in _RUN_OPTIONS}
    assert [declared.key for declared in options_of("run")] == [declared.key for declared in _RUN_OPTIONS]


@pytest.mark.parametrize("declared", _RUN_OPTIONS, ids=lambda declared: declared.key)
def test_run_parses_to_args_back_to_the_same_spec(declared) -> None:
    value = _non_default(declared)
    spec = _run_spec({declared.key: value})
    owner = spec.training if declared.training else spec
    assert getattr(owner, declared.attribute) == value
    assert declared.flag in spec.to_args() or f"--no-{declared.flag[2:]}" in spec.to_args()
    assert _parsed_back(spec) == spec


def test_run_parses_to_args_back_with_every_option_set_at_once() -> None:
    spec = _run_spec({declared.key: _non_default(declared) for declared in _RUN_OPTIONS})
    assert _parsed_back(spec) == spec
    assert _parsed_back(_run_spec({})) == _run_spec({})


# ----------------------------------------------------------------------------- layers


def test_the_job_layer_imports_no_cli_and_the_plan_layer_no_job() -> None:
    code = (
        "import sys, hpc_hsdp.job.scheduler, hpc_hsdp.job.options;"
        "assert not [m for m in sys.modules if m.startswith('hpc_hsdp.cli')], 'job imports cli';"
        "assert 'click' not in sys.modules and 'torch' not in sys.modules;"
        "[sys.modules.pop(m) for m in list(sys.modules) if m.startswith('hpc_hsdp')];"
        "import hpc_hsdp.plan.slurm_env, hpc_hsdp.plan.estimates, hpc_hsdp.plan.slurm_facts;"
        "assert not [m for m in sys.modules if m.startswith('hpc_hsdp.job')], 'plan imports job'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
