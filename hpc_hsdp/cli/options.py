"""Click options derived from :class:`hpc_hsdp.job.spec.TrainingSpec`, shared by ``run``,
``render`` and ``submit``: one option per field, its help, bound and choices taken from
the field, so that an option is defined once."""

from __future__ import annotations

from dataclasses import fields

import click

from hpc_hsdp.job.spec import TrainingSpec, option_flag, training_field_kind

_CLICK_TYPES = {"int": int, "float": float, "str": str}


def _training_option(f):
    kind, meta = training_field_kind(f), f.metadata
    flag = option_flag(f.name)
    default_text = (
        "none" if f.default is None else ("yes" if f.default is True else "no" if f.default is False else f.default)
    )
    help_text = f"{meta['help']}  [default: {default_text}]"
    if kind == "bool":
        return click.option(f"{flag}/--no-{flag[2:]}", f"training_{f.name}", default=None, help=help_text)
    click_type = click.Choice(meta["choices"]) if meta.get("choices") else _CLICK_TYPES[kind]
    return click.option(
        flag, f"training_{f.name}", type=click_type, default=None, metavar=meta.get("metavar"), help=help_text
    )


def training_options(command):
    """Add one option per TrainingSpec field (``--layers``, ``--steps``, ...); defaults None
    so that a config file can fill what the command line leaves out."""
    for f in reversed(fields(TrainingSpec)):
        command = _training_option(f)(command)
    return command


def training_from_kwargs(kwargs: dict, base: dict | None = None) -> TrainingSpec:
    """Pop the ``training_*`` options from click's kwargs into a TrainingSpec (given values
    override ``base``)."""
    values = dict(base or {})
    for f in fields(TrainingSpec):
        value = kwargs.pop(f"training_{f.name}", None)
        if value is not None:
            values[f.name] = value
    return TrainingSpec(**values)
