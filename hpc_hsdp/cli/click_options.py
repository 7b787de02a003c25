"""Click options built from the option registry (:mod:`hpc_hsdp.job.options`): every option of
``render``, ``submit``, ``run`` and ``plan`` comes from its one declaration there, and nothing
else in the CLI declares a job option."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import click

from hpc_hsdp.job.options import DECLARED, LAYERED, RUN_ARGUMENTS, TRAINING_OPTIONS, JobOption, option, options_of
from hpc_hsdp.job.spec import RunSpec, TrainingSpec


class NodeCount(click.ParamType):
    """``--nodes``: ``2`` (an int) or ``1-2`` (a flexible allocation, kept as text)."""

    name = "nodes"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value is None:
            return value
        text = str(value).strip()
        return int(text) if text.isdigit() else text  # MIN-MAX and typos: checked with the spec, one line


_CLICK_TYPES: dict[str, type | click.ParamType] = {
    "int": int,
    "float": float,
    "str": str,
    "path": str,
    "data": str,
    "nodes": NodeCount(),
}


def _default_text(value: object) -> str | None:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None or value == ():
        return None
    return str(value)


def click_option(declared: JobOption, command: str):
    """The click option of ``declared`` on ``command``. A LAYERED option defaults to None (a config
    file, its profile, then the declared default fill it) and says its default in the help; one
    with a default of the command's own carries it (``run`` reads no config file)."""
    shown = declared.shown_on(command)
    help_text = shown.help or declared.help
    metavar = declared.metavar if shown.metavar == "" else shown.metavar
    layered = shown.default is LAYERED
    if layered:
        default = None
        default_text = shown.default_text or declared.default_text or _default_text(declared.default)
    else:
        default = declared.default if shown.default is DECLARED else shown.default
        default_text = None if isinstance(default, bool) else _default_text(default)
    if default_text is not None:
        help_text = f"{help_text}  [default: {default_text}]"
    flag, param = declared.flag, declared.click_param
    if declared.kind == "bool":
        if layered:
            return click.option(f"{flag}/--no-{flag[2:]}", param, default=None, help=help_text)
        return click.option(flag, param, is_flag=True, default=default, help=help_text)
    if declared.kind in ("list", "table"):
        return click.option(flag, param, multiple=True, metavar=metavar, help=help_text)
    click_type: type | click.ParamType
    if declared.choices:
        click_type = click.Choice(declared.choices)
    elif shown.directory:
        click_type = click.Path(file_okay=False)
    else:
        click_type = _CLICK_TYPES[declared.kind]
    optional_value: dict[str, Any] = (
        {"is_flag": False, "flag_value": declared.flag_value} if declared.flag_value is not None else {}
    )
    return click.option(
        flag,
        param,
        type=click_type,
        default=default,
        metavar=metavar,
        required=shown.required,
        help=help_text,
        **optional_value,
    )


def command_options(command: str, *, leaving_out: tuple[str, ...] = ()):
    """A decorator adding every option that ``command`` takes, in the order of its ``--help``; a
    command that borrows another's options (``check`` takes ``submit``'s) leaves out the keys it refuses."""

    def decorate(function):
        for declared in reversed([o for o in options_of(command) if o.key not in leaving_out]):
            function = click_option(declared, command)(function)
        return function

    return decorate


def job_option(key: str, command: str):
    """One registry option of ``command``, for a command that places it among options of its own (plan)."""
    declared = option(key)
    if command not in declared.commands:
        raise ValueError(f"option {key} is not declared for {command!r}")
    return click_option(declared, command)


def run_spec_from_options(kwargs: Mapping[str, Any]) -> RunSpec:
    """The RunSpec of ``hpc-hsdp run``'s click kwargs (unset training options: their defaults)."""
    training = {
        declared.key: kwargs[declared.click_param]
        for declared in TRAINING_OPTIONS
        if kwargs.get(declared.click_param) is not None
    }
    own = {option(key).attribute: kwargs[option(key).click_param] for key in RUN_ARGUMENTS}
    return RunSpec(**own, training=TrainingSpec.of(**training))
