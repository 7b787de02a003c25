"""Click options shared by ``run``, ``render`` and ``submit``."""

from __future__ import annotations

from dataclasses import fields

import click

from hpc_hsdp.spec import TrainingSpec

TRAINING_HELP = {
    "layers": "Transformer blocks (each wrapped with fully_shard).",
    "width": "Model width (embedding dimension).",
    "heads": "Attention heads; must divide --width.",
    "seq_len": "Tokens per sample.",
    "batch_size": "Samples per rank per step.",
    "vocab_size": "Size of the synthetic vocabulary.",
    "steps": "Optimizer steps in total, across restarts.",
    "seed": "Seed of the model initialisation and the synthetic data.",
    "lr": "AdamW learning rate.",
    "checkpoint_every": "Save a distributed checkpoint every K steps (0: only at the end).",
    "keep_checkpoints": "Complete checkpoints to keep.",
}


def training_options(command):
    """Add one option per TrainingSpec field (``--layers``, ``--steps``, ...); defaults None
    so that a config file can fill what the command line leaves out."""
    for f in reversed(fields(TrainingSpec)):
        command = click.option(
            f"--{f.name.replace('_', '-')}",
            f"training_{f.name}",
            type=float if f.name == "lr" else int,
            default=None,
            help=f"{TRAINING_HELP[f.name]}  [default: {f.default}]",
        )(command)
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
