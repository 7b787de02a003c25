"""The option registry (hpc_hsdp.job.options, read from the typed sections' fields) and what is
derived from it agree: the click options of every command that takes an option, the config keys
and kinds, the spec fields' types and defaults, the Python API keywords and the `hpc-hsdp run`
arguments of the rendered script."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from operator import attrgetter
from pathlib import Path

import click
import click.testing
import pytest

from hpc_hsdp.cli.click_options import run_spec_from_options
from hpc_hsdp.cli.plan_cmd import plan
from hpc_hsdp.cli.render_cmd import render
from hpc_hsdp.cli.run_cmd import run
from hpc_hsdp.cli.submit_cmd import submit
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.config import OPTION_KINDS, build_job_spec
from hpc_hsdp.job.option_fields import section_options
from hpc_hsdp.job.options import (
    OPTIONS,
    RUN_ARGUMENT,
    RUN_ARGUMENTS,
    SBATCH_LINE,
    SECTIONS,
    TRAINING_OPTIONS,
    option,
    options_in,
    options_of,
    owned_sbatch_keys,
    sbatch_lines,
)
from hpc_hsdp.job.spec import EnvironmentSpec, JobSpec, LaunchSpec, RunSpec, SchedulerSpec, TrainingSpec
from hpc_hsdp.job.training_sections import (
    SECTION_FIELDS,
    TRAINING_SECTIONS,
    CheckpointSection,
    ComputeSection,
    DataSection,
    EvaluationSection,
    ModelSection,
    ObservationSection,
    OptimizerSection,
    ResilienceSection,
)
from hpc_hsdp.submit_host.api import api_options
from hpc_hsdp.submit_host.render import render_sbatch

COMMANDS = {"render": render, "submit": submit, "run": run, "plan": plan}
OWN_OPTIONS = {  # what a command has besides the registry's options
    "render": {"output_path", "make_log_dir"},
    "submit": {"wait", "dry_run"},
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


def test_check_takes_submits_options_but_the_ones_it_refuses() -> None:
    from hpc_hsdp.cli.check_cmd import check  # noqa: PLC0415

    params = _params(check)
    refused = {"sweep", "sweep_mode", "array_parallelism", "check"}
    assert {option(key).click_param for key in refused}.isdisjoint(params)
    assert {declared.click_param for declared in options_of("submit") if declared.key not in refused} <= set(params)
    shown = click.testing.CliRunner().invoke(check, ["--help"]).output
    assert "--sweep" not in shown and "--array-parallelism" not in shown


def test_render_and_submit_take_the_same_options_and_every_option_has_a_command() -> None:
    assert options_of("render") == tuple(o for o in options_of("submit") if o.key != "cluster")
    assert all(declared.commands for declared in OPTIONS)
    assert len({declared.key for declared in OPTIONS}) == len(OPTIONS)


def test_every_option_is_a_config_key_of_its_kind_except_the_file_selectors_and_plans_own() -> None:
    assert set(OPTION_KINDS) == {declared.key for declared in OPTIONS} - {"config", "profile", "upload_bandwidth"}
    for declared in OPTIONS:
        if declared.in_config:
            assert OPTION_KINDS[declared.key] == declared.kind


def test_the_training_options_are_the_fields_of_the_training_sections_in_order() -> None:
    assert [f.name for f in dataclasses.fields(TrainingSpec)] == list(SECTION_FIELDS)
    assert [type(getattr(TrainingSpec(), name)) for name in SECTION_FIELDS] == list(TRAINING_SECTIONS)
    by_section = [declared for each in TRAINING_SECTIONS for declared in section_options(each)]
    assert by_section == list(TRAINING_OPTIONS)
    assert {declared.section for declared in TRAINING_OPTIONS} == {f"run.training.{name}" for name in SECTION_FIELDS}
    assert TrainingSpec.of(lr=0.5, model="mypkg.models:build").optimizer.lr == 0.5
    assert TrainingSpec.of(model="mypkg.models:build").model.name == "mypkg.models:build"
    assert TrainingSpec.of(**TrainingSpec().options()) == TrainingSpec()
    with pytest.raises(TypeError, match="'learning_rate'"):
        TrainingSpec.of(learning_rate=0.1)


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
    "stage_data": "/local/stage",
    "checkpoint_store": "s3://ckpt/runs/round-trip",
    "eval_job": "python eval.py --ckpt {checkpoint} --name \"$(id)\" '{step}'",
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
            if declared.training:
                training[declared.key] = values[declared.key]
            else:
                own[declared.attribute] = values[declared.key]
    if "val_data" in training or "stage_data" in training:
        training.setdefault("data", _SAMPLES["data"])
    return RunSpec(**own, training=TrainingSpec.of(**training))


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
    assert attrgetter(declared.path.removeprefix("run."))(spec) == value
    assert declared.flag in spec.to_args() or f"--no-{declared.flag[2:]}" in spec.to_args()
    assert _parsed_back(spec) == spec


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], None),
        (["--stage-data"], "auto"),  # alone: the node-local temporary directory
        (["--stage-data", "--steps", "3"], "auto"),  # alone before another option
        (["--steps", "3", "--stage-data"], "auto"),
        (["--stage-data", "/local/ssd"], "/local/ssd"),
        (["--stage-data=$LOCAL_SCRATCH/x"], "$LOCAL_SCRATCH/x"),
        (["--stage-data", "none"], None),  # the off word, as in a config file
    ],
)
def test_stage_data_is_a_flag_with_an_optional_directory(args, expected) -> None:
    spec = run_spec_from_options(
        run.make_context("run", ["--shard", "1", "--run-dir", "/r", "--data", "/d", *args]).params
    )
    assert spec.training.dataset.stage_data == expected
    assert _parsed_back(spec) == spec


def test_run_parses_to_args_back_with_every_option_set_at_once() -> None:
    spec = _run_spec({declared.key: _non_default(declared) for declared in _RUN_OPTIONS})
    assert _parsed_back(spec) == spec
    assert _parsed_back(_run_spec({})) == _run_spec({})


# ----------------------------------------------------------------------------- layers


def test_the_job_layer_imports_no_cli_and_the_plan_layer_no_job() -> None:
    code = (
        "import sys, hpc_hsdp.submit_host.api, hpc_hsdp.submit_host.handle, hpc_hsdp.job.options;"
        "assert not [m for m in sys.modules if m.startswith('hpc_hsdp.cli')], 'job imports cli';"
        "assert 'click' not in sys.modules and 'torch' not in sys.modules;"
        "[sys.modules.pop(m) for m in list(sys.modules) if m.startswith('hpc_hsdp')];"
        "import hpc_hsdp.plan.slurm_env, hpc_hsdp.plan.estimates, hpc_hsdp.plan.slurm_facts;"
        "assert not [m for m in sys.modules if m.startswith('hpc_hsdp.job')], 'plan imports job'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


# ----------------------------------------------------------------------------- the registry comes from the sections

SPEC_CLASSES = {
    "": JobSpec,
    "run": RunSpec,
    "run.training.model": ModelSection,
    "run.training.dataset": DataSection,
    "run.training.optimizer": OptimizerSection,
    "run.training.compute": ComputeSection,
    "run.training.evaluation": EvaluationSection,
    "run.training.checkpoint": CheckpointSection,
    "run.training.observation": ObservationSection,
    "run.training.resilience": ResilienceSection,
    "scheduler": SchedulerSpec,
    "environment": EnvironmentSpec,
    "launch": LaunchSpec,
}
OWN_FIELDS = {  # what a spec class has besides its options' fields
    "": ["min_nodes", "run", "scheduler", "environment", "launch"],
    "run": ["training"],
}


_RECORDS = {c.__name__: c for c in (*SPEC_CLASSES.values(), TrainingSpec)}


def _nested_sections(cls: type, place: str = "") -> dict[str, type]:
    """The sections of a JobSpec with option fields, by their place in it: its own, then each field
    that is a spec class (TrainingSpec holds the training loop's sections and no option of its own)."""
    found = {place: cls} if section_options(cls) else {}
    for each in dataclasses.fields(cls):
        if isinstance(each.type, str) and each.type in _RECORDS:
            found.update(_nested_sections(_RECORDS[each.type], ".".join(filter(None, (place, each.name)))))
    return found


def test_every_option_in_a_config_is_the_field_of_one_section_and_nothing_else_is() -> None:
    assert _nested_sections(JobSpec) == SPEC_CLASSES
    assert list(SECTIONS) == list(SPEC_CLASSES.values())  # render --help's order: the JobSpec's, then nested
    in_some_part = []
    for place, spec_class in SPEC_CLASSES.items():
        fields = dataclasses.fields(spec_class)
        declared = options_in(place)
        assert section_options(spec_class) == declared, place
        assert [f.metadata.get("option") for f in fields[: len(declared)]] == list(declared), place
        assert [f.name for f in fields[: len(declared)]] == [each.attribute for each in declared], place
        assert [f.name for f in fields[len(declared) :]] == OWN_FIELDS.get(place, []), place
        assert all(each.section == place for each in declared), place
        in_some_part += declared
    assert sorted(each.key for each in in_some_part) == sorted(
        declared.key for declared in OPTIONS if declared.in_config
    )


_ANNOTATION_OF_KIND = {
    "int": "int",
    "nodes": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
    "path": "str",
    "data": "str",
    "list": "tuple[str, ...]",
    "table": "tuple[tuple[str, str | None], ...]",
}


@pytest.mark.parametrize("declared", [d for d in OPTIONS if d.in_config], ids=lambda declared: declared.key)
def test_every_option_field_is_typed_by_its_kind_and_defaults_to_its_declaration(declared) -> None:
    (field,) = [f for f in dataclasses.fields(SPEC_CLASSES[declared.section]) if f.name == declared.attribute]
    optional = declared.default is None and not declared.spec_required
    assert field.type == _ANNOTATION_OF_KIND[declared.kind] + (" | None" if optional else "")
    assert (field.default is dataclasses.MISSING) == declared.spec_required
    if not declared.spec_required:
        assert field.default == declared.default


_BAD_VALUES = {
    "int": "7",
    "nodes": "7",
    "float": "0.5",
    "bool": "yes",
    "str": 5,
    "path": 5,
    "data": 5,
    "list": (5,),
    "table": {"BAD KEY": "x"},
}


def _spec_with(place: str, attribute: str, value: object):
    run = {"shard_size": 1, "run_dir": "/runs/checked"}
    if place == "":
        return JobSpec(run=RunSpec(**run), **{attribute: value})
    if place == "run":
        return RunSpec(**{**run, attribute: value})
    return SPEC_CLASSES[place](**{attribute: value})


@pytest.mark.parametrize("declared", [d for d in OPTIONS if d.in_config], ids=lambda declared: declared.key)
def test_every_option_field_is_checked_against_its_declaration(declared) -> None:
    with pytest.raises(SpecError) as info:
        _spec_with(declared.section, declared.attribute, _BAD_VALUES[declared.kind])
    said = str(info.value)
    assert declared.flag in said and "\n" not in said


def test_a_required_option_field_refuses_none_and_an_off_word_makes_none_valid() -> None:
    for key in ("shard", "run_dir"):
        declared = option(key)
        assert declared.spec_required
        with pytest.raises(SpecError, match=declared.flag):
            _spec_with(declared.section, declared.attribute, None)
    assert option("signal").off_word == "none" and SchedulerSpec(signal=None).signal is None
    with pytest.raises(SpecError, match="--job-name None must be a string"):
        SchedulerSpec(job_name=None)


@pytest.mark.parametrize("entry", ["", "no_function", "mod:fn()", 5])
def test_an_entry_that_is_not_module_function_is_refused_in_the_declarations_words(entry) -> None:
    with pytest.raises(SpecError, match=r"^--entry .* is not module:function; write e.g. 'mypkg.train:main'$"):
        RunSpec(shard_size=1, run_dir="/runs/entry", entry=entry)


# ----------------------------------------------------------------------------- the #SBATCH header comes from the registry

_SBATCH_SAMPLES = {
    "nodes": 2,
    "gpus_per_node": 4,
    "job_name": "sampled",
    "partition": "gpu",
    "account": "acct",
    "qos": "high",
    "time": "01:00:00",
    "constraint": "h100",
    "switches": "1@10:00",
    "segment": 2,
    "exclusive": False,
    "mem": "64G",
    "cpus_per_task": 4,
    "signal": "none",
    "requeue": False,
    "sbatch": {"mail-type": "END"},
    "spare_nodes": 2,
}


def _header(tmp_path, **options) -> list[str]:
    spec = build_job_spec({"shard": 1, "run_dir": "/runs/header", **options}, cwd=tmp_path)
    return [line for line in render_sbatch(spec).splitlines() if line.startswith("#SBATCH")]


def test_every_option_that_reaches_an_sbatch_line_changes_the_header(tmp_path) -> None:
    reaching = [declared for declared in OPTIONS if declared.reaches == SBATCH_LINE]
    assert {declared.key for declared in reaching} == set(_SBATCH_SAMPLES)
    base = _header(tmp_path)
    for declared in reaching:
        context = {"fault_tolerance": "replica", "nodes": 2} if declared.key == "spare_nodes" else {}
        changed = _header(tmp_path, **context, **{declared.key: _SBATCH_SAMPLES[declared.key]})
        assert changed != (_header(tmp_path, **context) if context else base), declared.key


def test_every_declared_line_is_written_in_the_declared_order(tmp_path) -> None:
    written: set[str] = set()
    for options in (
        {},
        {
            key: _SBATCH_SAMPLES[key]
            for key in ("partition", "account", "qos", "time", "constraint", "switches", "segment", "mem")
        },
        {"cpus_per_task": 4, "requeue": False, "sbatch": {"mail-type": "END"}},
        {"fault_tolerance": "replica", "nodes": 2, "spare_nodes": 2},
    ):
        names = [line.split("=")[0].removeprefix("#SBATCH --") for line in _header(tmp_path, **options)]
        order = [line.name for line in sbatch_lines()]
        own = [name for name in names if name in order]
        assert own == sorted(own, key=order.index), options
        assert names[len(own) :] == sorted(options.get("sbatch", {})), "the passthrough comes last"
        written.update(own)
    assert written == {line.name for line in sbatch_lines()}


def test_the_passthrough_may_not_write_what_an_option_owns() -> None:
    owned = owned_sbatch_keys()
    lines = {line.name for line in sbatch_lines()}
    assert lines - set(owned) == {"no-kill"}  # written only for --fault-tolerance replica; a job may ask for it
    for key, instead in owned.items():
        with pytest.raises(SpecError, match=f"--sbatch {key}=... is written by hpc-hsdp itself; use .* instead"):
            SchedulerSpec(extra={key: "1"})
        assert instead.startswith("--") or instead.startswith("nothing")
    assert SchedulerSpec(extra={"no-kill": None}).extra == (("no-kill", None),)


_NEW_SBATCH_OPTION = (
    '    reservation: str | None = option_field(default=None, kind="str", help="#SBATCH --reservation.")\n'
    '    """``#SBATCH --reservation``: the reservation the job runs in."""\n'
)


def test_a_new_sbatch_option_is_one_declaration(tmp_path) -> None:
    """Add one field to SchedulerSpec in a copy of spec.py, as hpc_hsdp.job.options says: the config
    key, the command-line flag, the #SBATCH line and the passthrough's refusal follow."""
    spec_path = Path(sys.modules[JobSpec.__module__].__file__)
    source = spec_path.read_text()
    end_of_fields = "\n    @property\n    def mem_per_node(self)"
    assert source.count(end_of_fields) == 1
    code = f"""
import json, sys, types
source = {source!r}.replace({end_of_fields!r}, {_NEW_SBATCH_OPTION!r} + {end_of_fields!r})
module = types.ModuleType("hpc_hsdp.job.spec")
module.__file__ = {str(spec_path)!r}
sys.modules[module.__name__] = module
exec(compile(source, module.__file__, "exec"), module.__dict__)

from click.testing import CliRunner
from hpc_hsdp.cli.render_cmd import render
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.config import build_job_spec, parse_config
from hpc_hsdp.submit_host.render import render_sbatch
from hpc_hsdp.submit_host.api import api_options

spec = build_job_spec({{"shard": 1, "reservation": "r1", "partition": "gpu"}}, cwd={str(tmp_path)!r})
header = [line for line in render_sbatch(spec).splitlines() if line.startswith("#SBATCH")]
plain = render_sbatch(build_job_spec({{"shard": 1}}, cwd={str(tmp_path)!r}))
cli = CliRunner().invoke(render, ["--shard", "1", "--reservation", "r3"])
try:
    build_job_spec({{"shard": 1, "sbatch": {{"reservation": "x"}}}}, cwd={str(tmp_path)!r})
    refused = None
except SpecError as exc:
    refused = str(exc)
print(json.dumps({{
    "field": spec.scheduler.reservation,
    "header": header,
    "plain": "--reservation" in plain,
    "config": parse_config({{"reservation": "r2"}}, path={str(tmp_path / "job.toml")!r})["reservation"],
    "api": api_options({{"reservation": "r4"}}),
    "cli": [line for line in cli.output.splitlines() if "reservation" in line],
    "help": "--reservation" in CliRunner().invoke(render, ["--help"]).output,
    "refused": refused,
}}))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said["field"] == "r1" and said["config"] == "r2" and said["api"] == {"reservation": "r4"}
    header = said["header"]
    assert "#SBATCH --reservation=r1" in header
    assert header.index("#SBATCH --partition=gpu") < header.index("#SBATCH --reservation=r1")
    assert header.index("#SBATCH --reservation=r1") < header.index("#SBATCH --exclusive")
    assert not said["plain"], "an unset option writes no line"
    assert said["cli"] == ["#SBATCH --reservation=r3"] and said["help"]
    assert said["refused"] == "--sbatch reservation=... is written by hpc-hsdp itself; use --reservation instead"


@pytest.mark.parametrize("key", ["out", "outp", "chdi", "no-requeu", "requeu", "exp", "job-nam", "nod", "o", "gre"])
def test_the_passthrough_may_not_abbreviate_what_an_option_owns(key) -> None:
    """sbatch takes a unique prefix of a long option (``--out=`` is ``--output=``); the later line wins."""
    with pytest.raises(SpecError, match=f"--sbatch {key}=... abbreviates --{key}.* which hpc-hsdp writes itself"):
        SchedulerSpec(extra={key: "x"})


def test_the_passthrough_keeps_options_that_abbreviate_nothing_owned() -> None:
    for key in ("mail-type", "no-kill", "no-k", "mem-per-cpu", "reservation", "time-min", "gres-flags", "comment"):
        assert SchedulerSpec(extra={key: "x"}).extra == ((key, "x"),)
