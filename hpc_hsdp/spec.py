"""Job specifications: frozen, keyword-only dataclasses, checked on construction.

The same spec feeds ``render`` (the sbatch text), ``submit`` and, on each task,
``hpc-hsdp run``; nothing downstream re-validates or re-defaults a value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from hpc_hsdp.errors import SpecError

_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def check_entry(entry: str | None) -> None:
    if entry is not None and not _ENTRY.match(entry):
        raise SpecError(f"--entry {entry!r} is not module:function; write e.g. 'mypkg.train:main'")


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """Options of the built-in payload: a small decoder-only transformer on synthetic tokens."""

    layers: int = 2
    """Transformer blocks (each is wrapped with fully_shard)."""
    width: int = 64
    """Model width (embedding dimension)."""
    heads: int = 4
    """Attention heads; must divide width."""
    seq_len: int = 32
    """Tokens per sample."""
    batch_size: int = 4
    """Samples per rank per step."""
    vocab_size: int = 256
    """Size of the synthetic vocabulary."""
    steps: int = 20
    """Optimizer steps to train (in total, across restarts)."""
    seed: int = 0
    """Seed of the model initialisation and of the synthetic data."""
    lr: float = 3e-3
    """AdamW learning rate."""
    checkpoint_every: int = 0
    """Save a distributed checkpoint every K steps (0: only at the end)."""
    keep_checkpoints: int = 2
    """Complete checkpoints to keep (older ones are deleted)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "lr":
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    raise SpecError(f"--lr {value!r} must be a positive number, e.g. 3e-3")
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise SpecError(f"--{f.name.replace('_', '-')} {value!r} must be an integer")
            minimum = 0 if f.name in ("seed", "checkpoint_every") else 1
            if value < minimum:
                raise SpecError(f"--{f.name.replace('_', '-')} {value} must be at least {minimum}")
        if self.width % self.heads:
            raise SpecError(f"--width {self.width} is not divisible by --heads {self.heads}; pick a width that is a multiple of it")

    def to_args(self) -> list[str]:
        """The options that reproduce this spec on ``hpc-hsdp run``; defaults are left out."""
        args: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                args += [f"--{f.name.replace('_', '-')}", repr(value) if isinstance(value, float) else str(value)]
        return args


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What ``hpc-hsdp run`` needs on each task besides its SLURM environment."""

    shard_size: int
    """S: the inner ("shard") mesh axis."""
    run_dir: str
    """Directory of the run: layout.json, metrics.jsonl, checkpoints/, logs."""
    device: str = "auto"
    """``auto`` (the layout's GPU when CUDA is usable, else CPU), ``cpu`` or ``cuda``."""
    entry: str | None = None
    """``module:function`` called with the run context on every rank; None: the built-in payload."""
    training: TrainingSpec = TrainingSpec()
    """Options of the built-in payload."""
    timeout_s: int = 300
    """Process-group timeout for collectives, in seconds."""

    def __post_init__(self) -> None:
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise SpecError(f"--shard {self.shard_size!r} must be a positive integer such as 4")
        if self.device not in ("auto", "cpu", "cuda"):
            raise SpecError(f"--device {self.device!r} is unknown; choose auto, cpu or cuda")
        if not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise SpecError(f"--timeout {self.timeout_s!r} must be a positive number of seconds")
        check_entry(self.entry)

    def to_args(self) -> list[str]:
        """Arguments of ``hpc-hsdp run`` that reproduce this spec."""
        args = ["--shard", str(self.shard_size), "--run-dir", self.run_dir]
        if self.device != "auto":
            args += ["--device", self.device]
        if self.entry is not None:
            args += ["--entry", self.entry]
        if self.timeout_s != 300:
            args += ["--timeout", str(self.timeout_s)]
        return args + self.training.to_args()
