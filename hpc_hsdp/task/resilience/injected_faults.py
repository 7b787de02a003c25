"""Test hooks: injected faults, read from the task's environment. All of them, in one place.

They exist so that tests (and people checking a cluster) can make a rank fail in a
precise way; nothing sets them in normal use. ``<rank>`` is the node-major torch rank,
``<step>`` an optimizer step (1-based).

``HPC_HSDP_FAULT_RAISE_AT=<rank>:<step>``
    that rank raises :class:`InjectedFault` at the start of that step.
``HPC_HSDP_FAULT_KILL_AT=<rank>:<step>``
    that rank sends itself SIGKILL at the start of that step.
``HPC_HSDP_FAULT_KILL_IN_SAVE=<rank>:<step>``
    that rank sends itself SIGKILL in the middle of writing that step's checkpoint: after
    its own shards are in ``step-N.tmp``, before the checkpoint is marked COMPLETE.
``HPC_HSDP_FAULT_KILL_IN_UPLOAD=<rank>:<step>``
    that rank sends itself SIGKILL in the middle of uploading that step's checkpoint to
    ``--checkpoint-store``: after its first file, before its marker.
``HPC_HSDP_FAULT_SKIP_SPACE_CHECK=1``
    checkpoint saves skip their free-space check, so that a test reaches the disk filling up in
    the middle of a write (ENOSPC from the writes themselves).
``HPC_HSDP_FAULT_FREEZE_AT=<rank>:<step>``
    that rank stops at the start of that step as a rank stuck in a collective would: it sleeps
    (signals still run their handlers) and never reaches the step's collectives.
``HPC_HSDP_FAULT_SIGNAL_AT=<rank>:<step>``
    that rank sends itself the job's warning signal (SIGUSR2) at the start of that step,
    as ``scancel --signal=USR2`` would: the ranks agree to stop after that step and save.
``HPC_HSDP_FAULT_STEP_DELAY_S=<seconds>`` or ``=@<file>``
    every rank sleeps that long in every step, so that a tiny job lasts long enough for a
    test to signal it mid-training. With ``@<file>`` the seconds are read from that file at
    every step (no file, or an empty one: no sleep), so that a test paces a run while it
    runs (slow until something it waits for has happened).
``HPC_HSDP_FAULT_SLOW_RANK=<rank>:<seconds>[,<rank>:<seconds>...]``
    that rank sleeps that long inside every step's timed work (a straggler: its own time
    grows, the others wait for it in the collectives).
``HPC_HSDP_FAULT_SAMPLE_LOG=<directory>``
    every rank appends, after each step, the dataset sample ids it trained on to
    ``<directory>/samples-rank<rank>.jsonl`` (``{"step", "rank", "world_size", "sample_ids"}``),
    so that a test compares the sample stream of runs on different meshes and restarts.

``HPC_HSDP_FAULT_STAGE_FREE_BYTES=<bytes>``
    ``--stage-data`` sees that much free space on every node's disk (too little: the nodes read
    the shared copy), so that a test reaches the fall back without filling a disk.

(``HPC_HSDP_FAULT_RANK_FROM_PROCID`` in :mod:`hpc_hsdp.task.parallelism.dist` and
``HPC_HSDP_FAULT_READ_LATENCY=<seconds>@<directory>`` in :mod:`hpc_hsdp.data.tokens`, which adds
that wait to every read of a token file under the directory, as a loaded shared file system
would, are the other hooks.)
:func:`install` is called by ``run_task`` with the task's environment; ``clear`` undoes it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

RAISE_AT = "HPC_HSDP_FAULT_RAISE_AT"
KILL_AT = "HPC_HSDP_FAULT_KILL_AT"
KILL_IN_SAVE = "HPC_HSDP_FAULT_KILL_IN_SAVE"
KILL_IN_UPLOAD = "HPC_HSDP_FAULT_KILL_IN_UPLOAD"
STEP_DELAY_S = "HPC_HSDP_FAULT_STEP_DELAY_S"
SKIP_SPACE_CHECK = "HPC_HSDP_FAULT_SKIP_SPACE_CHECK"
FREEZE_AT = "HPC_HSDP_FAULT_FREEZE_AT"
SLOW_RANK = "HPC_HSDP_FAULT_SLOW_RANK"
SIGNAL_AT = "HPC_HSDP_FAULT_SIGNAL_AT"
SAMPLE_LOG = "HPC_HSDP_FAULT_SAMPLE_LOG"
STAGE_FREE_BYTES = "HPC_HSDP_FAULT_STAGE_FREE_BYTES"


class InjectedFault(RuntimeError):
    """Raised by ``HPC_HSDP_FAULT_RAISE_AT``."""


def _rank_step(env: Mapping[str, str], name: str) -> tuple[int, int] | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    rank, sep, step = value.partition(":")
    if not sep or not rank.strip().isdigit() or not step.strip().isdigit():
        raise ValueError(f"{name}={value!r} is not <rank>:<step>; write e.g. {name}=3:5")
    return int(rank), int(step)


def _slow_ranks(env: Mapping[str, str]) -> dict[int, float]:
    value = env.get(SLOW_RANK, "").strip()
    slow: dict[int, float] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        rank, sep, seconds = item.partition(":")
        try:
            slow[int(rank)] = float(seconds)
        except ValueError:
            raise ValueError(
                f"{SLOW_RANK}={value!r} is not <rank>:<seconds>[,...]; write e.g. {SLOW_RANK}=3:0.2"
            ) from None
        if not sep or slow[int(rank)] < 0:
            raise ValueError(f"{SLOW_RANK}={value!r} is not <rank>:<seconds>[,...]; write e.g. {SLOW_RANK}=3:0.2")
    return slow


@dataclass(frozen=True)
class Faults:
    raise_at: tuple[int, int] | None = None
    kill_at: tuple[int, int] | None = None
    kill_in_save: tuple[int, int] | None = None
    kill_in_upload: tuple[int, int] | None = None
    step_delay_s: float = 0.0
    step_delay_file: str | None = None
    skip_space_check: bool = False
    freeze_at: tuple[int, int] | None = None
    slow_ranks: tuple[tuple[int, float], ...] = ()
    signal_at: tuple[int, int] | None = None
    sample_log: str | None = None
    stage_free_bytes: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Faults:
        delay = env.get(STEP_DELAY_S, "").strip()
        delay_file = delay[1:] if delay.startswith("@") else None
        return cls(
            raise_at=_rank_step(env, RAISE_AT),
            kill_at=_rank_step(env, KILL_AT),
            kill_in_save=_rank_step(env, KILL_IN_SAVE),
            kill_in_upload=_rank_step(env, KILL_IN_UPLOAD),
            step_delay_s=float(delay) if delay and delay_file is None else 0.0,
            step_delay_file=delay_file,
            skip_space_check=env.get(SKIP_SPACE_CHECK, "") == "1",
            freeze_at=_rank_step(env, FREEZE_AT),
            slow_ranks=tuple(sorted(_slow_ranks(env).items())),
            signal_at=_rank_step(env, SIGNAL_AT),
            sample_log=env.get(SAMPLE_LOG, "").strip() or None,
            stage_free_bytes=int(env[STAGE_FREE_BYTES]) if env.get(STAGE_FREE_BYTES, "").strip() else None,
        )


_active = Faults()


def install(env: Mapping[str, str]) -> Faults:
    global _active
    _active = Faults.from_env(env)
    return _active


def clear() -> None:
    global _active
    _active = Faults()


def _kill_self(what: str) -> None:
    print(f"[hpc-hsdp] fault injected: {what}: SIGKILL at {time.time():.3f} (test hook)", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _paced_delay(path: str) -> float:
    try:
        text = open(path).read().strip()
    except FileNotFoundError:
        return 0.0
    return float(text) if text else 0.0


def at_step(rank: int, step: int) -> None:
    """Called by the payload at the start of every step."""
    if _active.step_delay_s:
        time.sleep(_active.step_delay_s)
    if _active.step_delay_file:
        time.sleep(_paced_delay(_active.step_delay_file))
    if _active.raise_at == (rank, step):
        raise InjectedFault(f"fault injected: rank {rank} raised at step {step} ({RAISE_AT}, test hook)")
    if _active.kill_at == (rank, step):
        _kill_self(f"rank {rank} at step {step} ({KILL_AT})")
    if _active.signal_at == (rank, step):
        os.kill(os.getpid(), signal.SIGUSR2)
    if _active.freeze_at == (rank, step):
        print(
            f"[hpc-hsdp] fault injected: rank {rank} freezes at step {step} ({FREEZE_AT}, test hook)",
            file=sys.stderr,
            flush=True,
        )
        while True:
            time.sleep(3600)


def stage_free_bytes() -> int | None:
    """``HPC_HSDP_FAULT_STAGE_FREE_BYTES``: the free space ``--stage-data`` sees (None: the disk's)."""
    return _active.stage_free_bytes


def skip_space_check() -> bool:
    """Whether checkpoint saves skip their free-space check (``HPC_HSDP_FAULT_SKIP_SPACE_CHECK``)."""
    return _active.skip_space_check


def in_step(rank: int) -> None:
    """Called by the loop inside every step's timed work."""
    for slow_rank, seconds in _active.slow_ranks:
        if slow_rank == rank:
            time.sleep(seconds)


def after_step(rank: int | str, world_size: int, step: int, batches) -> None:
    """Called by the loop after every step with this rank's micro-batches (``.sample_ids`` each); ``rank``:
    the coordinator's label of it (a replica group's names its group too)."""
    if _active.sample_log is None:
        return
    line = json.dumps(
        {"step": step, "rank": rank, "world_size": world_size, "sample_ids": [b.sample_ids.tolist() for b in batches]}
    )
    with open(os.path.join(_active.sample_log, f"samples-rank{rank}.jsonl"), "a", encoding="utf-8") as out:
        out.write(line + "\n")


def in_save(rank: int, step: int) -> None:
    """Called by ``checkpoint.save`` after this rank wrote its shards, before COMPLETE."""
    if _active.kill_in_save == (rank, step):
        _kill_self(f"rank {rank} while writing the checkpoint of step {step} ({KILL_IN_SAVE})")


def in_upload(rank: int, step: int) -> None:
    """Called by the upload to ``--checkpoint-store`` after this rank's first file, before its marker."""
    if _active.kill_in_upload == (rank, step):
        _kill_self(f"rank {rank} while uploading the checkpoint of step {step} ({KILL_IN_UPLOAD})")
