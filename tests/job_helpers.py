"""The tiny job the tests train, written once: a one-layer transformer small enough that a run of
a few steps on CPU processes takes seconds (every tier's tests built its own argument list)."""

from __future__ import annotations

MODEL_DEFAULTS = {"width": 32, "heads": None, "layers": 1, "seq_len": 8, "batch_size": 2, "vocab_size": 64}
"""The tiny model and batch; ``heads`` None: the model's own default for that width."""


def tiny_job(**options: object) -> list[str]:
    """The command-line arguments of the tiny job: :data:`MODEL_DEFAULTS`, then ``options``
    (``seq_len=16`` -> ``--seq-len 16``; ``vocab_size=None`` leaves ``--vocab-size`` out; any other
    option the same way, e.g. ``device="cpu"``, ``steps=2``), each option once."""
    merged = {**MODEL_DEFAULTS, **options}
    argv: list[str] = []
    for key, value in merged.items():
        if value is not None:
            argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv
