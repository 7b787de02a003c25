"""Distributed checkpoints: torch.distributed.checkpoint, atomic, verified, keep the last K.

Layout (see :mod:`hpc_hsdp.rundir.checkpointing.state`, which reads it without torch):
``<run_dir>/checkpoints/step-000010/`` holds DCP's files (``.metadata``, ``__<rank>_0.distcp``),
``train_state.json`` (step, seed, world size, batch size, the mesh it was written from),
``manifest.json`` (every file's size and CRC-32) and ``COMPLETE``.

A save goes to ``step-000010.tmp`` (first removing any ``.tmp`` a crash left). Before writing,
the ranks agree that the disk has room for it (``CheckpointSpaceError`` naming the path and the
bytes needed, nothing written, otherwise). After every rank has written, each rank measures
its own files, rank 0 writes the manifest, ``train_state.json`` and ``COMPLETE`` and renames
the directory: a directory without ``.tmp`` and with ``COMPLETE`` was whole when written. A
write that fails (a full disk, a quota) removes the ``.tmp`` and raises on every rank; the
previous checkpoints are untouched. DCP stores replicated shards once and reshards on load,
so a checkpoint loads into another mesh shape or world size.

On load, :func:`latest_checkpoint` checks the newest complete checkpoint against its manifest
(sizes on rank 0, CRC-32s shared out over the ranks) and falls back to the previous one with
a warning when files were truncated, deleted or changed, or when its pickles would run code
(:mod:`hpc_hsdp.task.checkpointing.safe_dcp`: DCP's metadata and non-tensor entries are read as plain
data only); with none left it raises ``CheckpointError``.

Saves are synchronous (:func:`save`: on a stop signal, at the end) or asynchronous
(:class:`AsyncSaver`: the periodic ones; the state is copied to host memory at once and
written by a background thread over a gloo group of its own while training goes on).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpc_hsdp.errors import HsdpError, SpecError
from hpc_hsdp.rundir.checkpointing.checkpoint_store import StoreError, resume_candidates, retrying, short
from hpc_hsdp.rundir.checkpointing.state import (
    COMPLETE,
    MANIFEST,
    MANIFEST_FORMAT,
    TRAIN_STATE,
    check_data_position,
    checkpoint_root,
    complete_checkpoints,
    crc32_of,
    damage,
    file_record,
    read_manifest,
    saved_train_state,
    step_dir_name,
)
from hpc_hsdp.rundir.files import atomic_write_text
from hpc_hsdp.scheduler.backends import task_environment
from hpc_hsdp.task.checkpointing.safe_dcp import load_state, unsafe_content
from hpc_hsdp.task.observation.log import note, say
from hpc_hsdp.task.resilience import injected_faults
from hpc_hsdp.task.training.run_data import data_state, source_table

if TYPE_CHECKING:
    from torch import nn

    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.job.training_sections import CheckpointSection
    from hpc_hsdp.task.parallelism.dist import RunContext
    from hpc_hsdp.task.training.run_data import TrainData

__all__ = [
    "COMPLETE",
    "TRAIN_STATE",
    "AsyncSaver",
    "CheckpointError",
    "CheckpointSpaceError",
    "checkpoint_root",
    "complete_checkpoints",
    "latest_checkpoint",
    "load",
    "prune",
    "resume",
    "save",
    "save_checkpoint",
    "step_dir_name",
]

METADATA = ".metadata"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointError(HsdpError):
    """No usable checkpoint, or one could not be written; one line that says what and the fix."""


class CheckpointSpaceError(CheckpointError):
    """The disk or quota has no room for a checkpoint."""


# ----------------------------------------------------------------------------- load


def latest_checkpoint(run_dir: str | Path, *, verify: bool = True, store=None) -> tuple[int, Path] | None:
    """Collective: the newest complete checkpoint that is whole, agreed by every rank.

    Rank 0 checks each candidate's file sizes against its manifest; then every rank recomputes
    the CRC-32 of its share of the files. A damaged checkpoint is skipped with a warning (rank
    0's log); when checkpoints exist but none is whole, raises :class:`CheckpointError`. With a
    ``store`` (:class:`~hpc_hsdp.rundir.checkpointing.checkpoint_store.CheckpointStore`), its committed steps are
    candidates too (:func:`latest_whole`)."""
    found = latest_whole(run_dir, verify=verify, store=store)
    return None if found is None else (found[0], found[1])


def latest_whole(run_dir: str | Path, *, verify: bool = True, store=None) -> tuple[int, Path, bool] | None:
    """:func:`latest_checkpoint` and whether the step is committed in ``store``. A step of the
    store newer than the run directory's, or whose local copy differs from the store's manifest,
    is first fetched into the run directory (:func:`_fetch`: each rank its share, checked against
    the store's manifest) and then checked and loaded as a local one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    candidates: list[list[tuple[int, str, bool, bool]]] = [[]]  # rank 0's, after the broadcast
    if rank == 0:
        candidates[0] = _candidates(run_dir, store)
    dist.broadcast_object_list(candidates, src=0)
    problems = []
    for step, local_path, stored, fetch in candidates[0]:
        path = Path(local_path)
        if fetch:
            path, problem = _fetch(store, run_dir, step)
            if problem is not None:
                problems.append(f"{step_dir_name(step)} in {store.url}: {problem}")
                if rank == 0:
                    note(f"warning: step {step} of {store.url} is not usable ({problem}); trying the one before it")
                continue
        found_damage: list[str | None] = [None]
        if rank == 0:
            # the checks of the files (accidents), then of what they hold (nothing that runs)
            found_damage[0] = (damage(path) or unsafe_content(path)) if verify else unsafe_content(path)
        dist.broadcast_object_list(found_damage, src=0)
        if found_damage[0] is None and verify:
            manifest = read_manifest(path) or {}
            mine = sorted(manifest.get("files", {}))[rank::world]
            try:
                local = damage(path, checksum_files=mine) if mine else None
            except OSError as exc:
                local = f"unreadable ({exc.strerror})"
            found: list[str | None] = [None] * world
            dist.all_gather_object(found, local)
            found_damage[0] = next((p for p in found if p is not None), None)
        if found_damage[0] is None:
            if problems and rank == 0:
                note(
                    f"warning: resuming from the previous whole checkpoint {path}; newer ones are "
                    f"damaged: {'; '.join(problems)}"
                )
            return step, Path(path), stored
        problems.append(f"{Path(path).name}: {found_damage[0]}")
        if rank == 0:
            note(f"warning: checkpoint {path} is damaged ({found_damage[0]}); trying the one before it")
    if problems:
        where = checkpoint_root(run_dir) if store is None else f"{checkpoint_root(run_dir)} or {store.url}"
        raise CheckpointError(
            f"no whole checkpoint left in {where} ({'; '.join(problems)}); restore the files, or "
            f"remove {checkpoint_root(run_dir)} to start from step 0, or use a new --run-dir"
        )
    return None


STORE_LIST_WAIT_S = 60.0
"""How long a resume waits for the store to list its steps before it goes on with the local ones."""


def _candidates(run_dir, store) -> list[tuple[int, str, bool, bool]]:
    """Rank 0: (step, local path, committed in the store, fetch from the store) newest first."""
    local = dict(complete_checkpoints(run_dir))
    committed: list[int] = []
    if store is not None:
        try:
            limit = time.monotonic() + STORE_LIST_WAIT_S
            committed, _ = retrying(store.listing, what=f"listing {store.url}", deadline=lambda: limit)
        except StoreError as exc:
            note(f"warning: {exc}; resuming from the run directory's checkpoints only")
    out = []
    for candidate in resume_candidates(local, committed):
        path = local.get(candidate.step)
        if candidate.stored and (path is None or not _matches_store(path, store, candidate.step)):
            out.append((candidate.step, str(checkpoint_root(run_dir) / step_dir_name(candidate.step)), True, True))
        else:
            out.append((candidate.step, str(path), candidate.stored, False))
    return out


def _matches_store(path: Path, store, step: int) -> bool:
    """Whether a local copy holds what the store's manifest lists (same names, sizes, CRC-32s)."""
    local = read_manifest(path)
    try:
        remote = store.manifest(step)
    except Exception:  # noqa: BLE001 - an unreadable store manifest: the local copy is what there is
        return True
    return local is not None and remote is not None and local.get("files") == remote.get("files")


def _fetch(store, run_dir, step: int) -> tuple[Path, str | None]:
    """Collective: the store's ``step`` into ``checkpoints/step-N`` (through ``.tmp``): rank 0 reads
    the manifest and the objects' sizes, every rank downloads its share of the files and checks
    their CRC-32s against the manifest, rank 0 marks the copy complete. (path, problem)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root, final, tmp = _paths(run_dir, step)
    head: list[Any] = [None, None]  # (the manifest, the problem), rank 0's after the broadcast
    if rank == 0:
        try:
            manifest = store.manifest(step)
            sizes = store.sizes(step)
            head = [manifest, None] if manifest is not None else [None, "its manifest is missing or unreadable"]
            for name, record in sorted((manifest or {}).get("files", {}).items()):
                if sizes.get(name) != record["bytes"]:
                    head = [None, f"{name} has {sizes.get(name, 0):,} bytes, {record['bytes']:,} in the manifest"]
                    break
            if head[1] is None:
                root.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
        except Exception as exc:  # noqa: BLE001 - the store failed: the step is not usable now
            head = [None, f"unreadable ({short(exc)})"]
    dist.broadcast_object_list(head, src=0)
    manifest, problem = head
    if problem is not None:
        return final, problem
    files = manifest["files"]
    mine = sorted(files)[rank::world] + ([TRAIN_STATE, MANIFEST] if rank == 0 else [])
    local: str | None = None
    try:
        limit = time.monotonic() + STORE_LIST_WAIT_S
        retrying(lambda: store.get(step, mine, tmp), what=f"downloading step {step}", deadline=lambda: limit)
        for name in mine:
            saved = files.get(name, {}).get("crc32")
            if saved is not None and crc32_of(tmp / name) != saved:
                local = f"{name} has the manifest's size but not its bytes (CRC-32 differs)"
                break
    except (StoreError, OSError) as exc:
        local = short(exc)
    found: list[str | None] = [None] * world
    dist.all_gather_object(found, local)
    problem = next((p for p in found if p is not None), None)
    if rank == 0:
        if problem is None:
            atomic_write_text(tmp / COMPLETE, f"step {step}\n")
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            say(f"fetched step {step} from {store.url} into {final}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return final, problem


def load(path: str | Path, model, optimizer) -> dict:
    """Collective: load model and optimizer state into the (possibly resharded) model;
    returns the saved ``train_state.json``."""
    path = Path(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}  # DCP's load may put new entries in
    load_state(state, path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return saved_train_state(path)


# ----------------------------------------------------------------------------- save: the parts


def _state(model, optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


_BYTES_PER_ITEM = 1664
"""What an item (a tensor) adds to DCP's files beyond its bytes: its framing in the .distcp
file and its entry in .metadata (measured: 440 KB written for 411 KB of shards in 272 items
on a (2, 2) mesh, replicas stored once)."""


def _local_bytes(obj) -> tuple[int, int]:
    """(bytes, items) of the tensors this rank holds in a state dict (its shards of DTensors)."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.numel() * local.element_size(), 1
    parts = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    sizes = [_local_bytes(v) for v in parts]
    return sum(b for b, _ in sizes), sum(n for _, n in sizes)


def _replicas(obj) -> int:
    """R of the ("replicate", "shard") mesh the state's DTensors live on (1 without)."""
    if isinstance(obj, torch.Tensor):
        mesh = getattr(obj, "device_mesh", None)
        return mesh.size(0) if mesh is not None and mesh.ndim == 2 else 0
    for value in obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ():
        found = _replicas(value)
        if found:
            return found
    return 0


def _prepare(root: Path, group=None) -> None:
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob("step-*.tmp"):  # left by a crash during an earlier save
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier(group=group)


def _collective_device(group=None):
    """Where a small tensor for a collective over ``group`` lives: the CPU on gloo, else this rank's GPU."""
    return "cpu" if dist.get_backend(group) == "gloo" else torch.device("cuda", torch.cuda.current_device())


def _space_needed(state: dict, run_dir, root: Path) -> tuple[int, int]:
    """Collective: (bytes the checkpoint will take, bytes free where it goes). The size of the
    previous checkpoint of the run when there is one (same model, same state), else the ranks'
    shards and their framing, replicated ones counted once (DCP writes them once)."""
    rank0 = dist.get_rank() == 0
    free, previous = 0, 0
    if rank0:
        free = shutil.disk_usage(root).free
        found = complete_checkpoints(run_dir)
        previous = (read_manifest(found[-1][1]) or {}).get("total_bytes", 0) if found else 0
    device = _collective_device()
    size, items = _local_bytes(state)
    totals = torch.tensor([size + _BYTES_PER_ITEM * items, free, previous], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    estimate, free, previous = (int(x) for x in totals.tolist())
    return previous or estimate // max(_replicas(state), 1), free


def _no_space(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT error inside what DCP raised (a CheckpointException per rank), if any."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return e
        for failure in getattr(e, "failures", {}).values():
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [e.__cause__, e.__context__]
    return None


def _ran_out_of_space(exc: BaseException, tmp: Path, needed: int, group=None) -> bool:
    """Collective over ``group``, on every rank whose save failed (DCP raises on all of them),
    before the partial files are removed: did the write run out of space on any rank? The
    errno does not always survive: DCP hands every rank's error to every rank pickled, which
    drops the OSError that ``torch.save``'s "unexpected pos" RuntimeError was raised from (a
    disk filling up inside a tensor's write). So each rank also looks at the space left where
    the checkpoint goes: less than one rank's share of it means the disk is full."""
    mine = _no_space(exc) is not None
    if not mine:
        with contextlib.suppress(OSError):
            mine = shutil.disk_usage(tmp.parent).free < needed // max(dist.get_world_size(group), 1)
    try:
        agreed = torch.tensor([float(mine)], dtype=torch.float64, device=_collective_device(group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        return bool(agreed.item())
    except Exception:  # noqa: BLE001 - the ranks could not agree (a peer gone): this rank's own view
        return mine


def _space_error(step: int, tmp: Path, needed: int, free: int | None, run_dir) -> CheckpointSpaceError:
    """``free`` None: the writes themselves failed (ENOSPC, EDQUOT), the free space is what the
    ranks' partial files left, different on each."""
    previous = complete_checkpoints(run_dir)
    kept = f"the previous checkpoint {previous[-1][1]} is intact" if previous else "no earlier checkpoint exists"
    when = "ran out of space while writing" if free is None else "has no room for"
    had = "" if free is None else f", {free:,} free"
    return CheckpointSpaceError(
        f"the disk of {tmp.parent} {when} the checkpoint of step {step} ({tmp}): about {needed:,} bytes needed{had}; "
        f"{kept}; free space or raise the quota, or give a --run-dir on a larger disk"
    )


def _own_files(tmp: Path, rank: int) -> list[str]:
    names = [p.name for p in tmp.glob(f"__{rank}_*.distcp")]
    if rank == 0 and (tmp / METADATA).is_file():
        names.append(METADATA)
    return sorted(names)


def _commit(
    run_dir, tmp: Path, final: Path, *, step: int, train_state: dict, keep: int, group=None, uploads=None
) -> None:
    """Collective over ``group``, after every rank's files are written: manifest, train state,
    COMPLETE, rename, prune; then each rank hands the checkpoint to its ``uploads`` (``--checkpoint-store``)."""
    rank = dist.get_rank(group)
    records = {name: file_record(tmp / name, checksum=True) for name in _own_files(tmp, dist.get_rank())}
    gathered: list[dict[str, dict]] | None = [{} for _ in range(dist.get_world_size(group))] if rank == 0 else None
    dist.gather_object(records, gathered, dst=0, group=group)
    if gathered is not None:  # rank 0
        files = {name: record for part in gathered for name, record in part.items()}
        manifest = {
            "format": MANIFEST_FORMAT,
            "version": 1,
            "step": step,
            "files": files,
            "total_bytes": sum(r["bytes"] for r in files.values()),
        }
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        atomic_write_text(tmp / TRAIN_STATE, json.dumps(dict(train_state, step=step), indent=1) + "\n")
        atomic_write_text(tmp / COMPLETE, f"step {step}\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        prune(run_dir, keep=keep, protect=uploads.protected() if uploads is not None else ())
    dist.barrier(group=group)  # nobody reads checkpoints/ while rank 0 renames and prunes
    if uploads is not None:
        uploads.enqueue(step, final)


def _abandon(tmp: Path) -> None:
    """After a failed write (every rank knows: DCP's own collectives carried the error)."""
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _paths(run_dir, step: int) -> tuple[Path, Path, Path]:
    root = checkpoint_root(run_dir)
    return root, root / step_dir_name(step), root / (step_dir_name(step) + ".tmp")


def _check_space(state, root, tmp, *, step, run_dir) -> int:
    needed, free = _space_needed(state, run_dir, root)
    if needed > free and not injected_faults.skip_space_check():
        raise _space_error(step, tmp, needed, free, run_dir)
    return needed


# ----------------------------------------------------------------------------- save


def save(run_dir: str | Path, model, optimizer, *, step: int, train_state: dict, keep: int, uploads=None) -> Path:
    """Collective, synchronous: every rank writes its shards; returns the final directory.
    Raises :class:`CheckpointSpaceError` on every rank when the disk or quota has no room (the
    partial ``.tmp`` removed, earlier checkpoints untouched)."""
    for saver in list(_open_savers):  # a background save in flight is committed first
        saver.wait()
    root, final, tmp = _paths(run_dir, step)
    _prepare(root)
    state = _state(model, optimizer)
    needed = _check_space(state, root, tmp, step=step, run_dir=run_dir)
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except (Exception, dcp.api.CheckpointException) as exc:  # CheckpointException is a BaseException
        no_space = _ran_out_of_space(exc, tmp, needed)
        _abandon(tmp)
        if no_space:
            raise _space_error(step, tmp, needed, None, run_dir) from None
        raise
    injected_faults.in_save(dist.get_rank(), step)  # test hook: a rank dies with the checkpoint half written
    _commit(run_dir, tmp, final, step=step, train_state=train_state, keep=keep, uploads=uploads)
    return final


def prune(run_dir: str | Path, *, keep: int, protect=()) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (rank 0 only), except the steps in
    ``protect`` (still uploading to ``--checkpoint-store``)."""
    found = complete_checkpoints(run_dir)
    doomed = [path for step, path in found[: max(0, len(found) - keep)] if step not in set(protect)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


class AsyncSaver:
    """Asynchronous periodic saves, one in flight at a time (collective constructor: it makes
    the gloo group the background writes use).

    ``save()`` copies the state to host memory (the training stall) and returns; a background
    thread writes it (``dcp.async_save``) and commits it as :func:`save` does. ``wait()``
    (every rank, e.g. before a synchronous save on a stop signal or at the end) blocks until
    the save in flight is committed and raises its error, the same on every rank."""

    def __init__(self, run_dir: str | Path, *, keep: int, timeout_s: float = 300, uploads=None) -> None:
        self.run_dir = run_dir
        self.keep = keep
        self.uploads = uploads
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self._pending: Future | None = None
        self._pending_step: int | None = None
        self._commit_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpc-hsdp-checkpoint")
        self.last_committed: Path | None = None
        _open_savers.append(self)

    @classmethod
    def for_run(cls, ctx, checkpoint: CheckpointSection, *, uploads=None) -> AsyncSaver | None:
        """The saver of a run with periodic checkpoints (``--checkpoint-every``), else None."""
        if ctx.run_dir is None or not checkpoint.checkpoint_every:
            return None
        return cls(
            ctx.run_dir,
            keep=checkpoint.keep_checkpoints,
            timeout_s=ctx.spec.timeout_s if ctx.spec is not None else 300,
            uploads=uploads,
        )

    def save(self, model, optimizer, *, step: int, train_state: dict) -> None:
        self.wait()
        root, final, tmp = _paths(self.run_dir, step)
        _prepare(root)
        state = _state(model, optimizer)
        needed = _check_space(state, root, tmp, step=step, run_dir=self.run_dir)
        written = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
        assert isinstance(written, Future)  # the upload's future (a response with both futures: an async stager only)
        rank = dist.get_rank()

        def finish() -> Path:
            try:
                written.result()
            except (Exception, dcp.api.CheckpointException) as exc:
                no_space = _ran_out_of_space(exc, tmp, needed, group=self.group)
                _abandon(tmp)
                if no_space:
                    raise _space_error(step, tmp, needed, None, self.run_dir) from None
                raise CheckpointError(
                    f"the checkpoint of step {step} could not be written to {tmp}: {' '.join(str(exc).split())[:300]}"
                ) from None
            injected_faults.in_save(rank, step)
            _commit(
                self.run_dir,
                tmp,
                final,
                step=step,
                train_state=train_state,
                keep=self.keep,
                group=self.group,
                uploads=self.uploads,
            )
            return final

        self._pending, self._pending_step = self._commit_thread.submit(finish), step

    @property
    def in_flight(self) -> int | None:
        """Step of the save being written (None: none)."""
        return self._pending_step if self._pending is not None and not self._pending.done() else None

    def wait(self) -> Path | None:
        """Block until the save in flight is committed; its final directory (None: none was)."""
        if self._pending is None:
            return None
        pending, self._pending, self._pending_step = self._pending, None, None
        self.last_committed = pending.result()
        return self.last_committed

    def close(self) -> None:
        """Wait for the save in flight, then stop the background thread (the group goes with
        the process group's shutdown)."""
        try:
            self.wait()
        finally:
            self._commit_thread.shutdown(wait=True)
            if self in _open_savers:
                _open_savers.remove(self)


_open_savers: list[AsyncSaver] = []


def finish_open_saves() -> None:
    """Commit the saves still in flight when the payload ends by an exception (``run_task``
    calls it before tearing the process group down), so that a crash after a periodic save
    keeps it; a save that cannot finish is reported, not raised over the original error."""
    for saver in list(_open_savers):
        try:
            saver.close()
        except BaseException as exc:  # noqa: BLE001 - the payload's own error is the one to raise
            note(f"the checkpoint in flight could not be finished: {' '.join(str(exc).split())[:300]}")


# ----------------------------------------------------------------------------- a run's checkpoints


def save_checkpoint(
    ctx: RunContext,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    step: int,
    training: TrainingSpec,
    data: TrainData,
    model_name: str = "builtin",
    model_layout: str | None = None,
    extra: dict | None = None,
    background: AsyncSaver | None = None,
    uploads=None,
) -> Path:
    """Collective: model, optimizer and the data position after ``step`` (plus ``extra``, any
    JSON-able state of a custom loop) into ``<run_dir>/checkpoints/step-N`` atomically; with
    ``background``, written by it while training goes on (else before returning); with ``uploads``
    (:class:`~hpc_hsdp.task.checkpointing.checkpoint_upload.StoreUploads`), uploaded to the store after."""
    train_state = {
        "seed": training.optimizer.seed,
        "world_size": ctx.world_size,
        "batch_size": data.layout.rank_batch,
        "grad_accum": data.layout.grad_accum,
        "mesh_shape": list(ctx.plan.mesh_shape),
        "model": model_name,
        **({"model_layout": model_layout} if model_layout else {}),
        "data": data_state(data, step, training.optimizer.seed),
        "extra": extra or {},
    }
    assert ctx.run_dir is not None  # a run without a run directory saves nothing
    if background is not None:
        background.save(model, optimizer, step=step, train_state=train_state)
        return checkpoint_root(ctx.run_dir) / step_dir_name(step)
    return save(
        ctx.run_dir,
        model,
        optimizer,
        step=step,
        train_state=train_state,
        keep=training.checkpoint.keep_checkpoints,
        uploads=uploads,
    )


def resume(
    ctx: RunContext,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data: TrainData,
    training: TrainingSpec,
    verbose: bool = True,
    model_layout: str | None = None,
    uploads=None,
) -> tuple[int, dict]:
    """Load the newest complete checkpoint of ``ctx.run_dir`` (collective); returns
    ``(step, train_state)``, ``(0, {})`` on a fresh start. Refuses a data position this
    run cannot continue (another global batch, seed or dataset), and a checkpoint whose model
    lays its tensors out otherwise than ``model_layout`` (the adapter's ``layout``). With
    ``uploads`` (``--checkpoint-store``) the store's committed steps count too, and a step resumed
    from the run directory that the store has not committed is uploaded again."""
    if ctx.run_dir is None:
        return 0, {}
    found = latest_whole(ctx.run_dir, store=uploads.store if uploads is not None else None)
    if found is None:
        return 0, {}
    step, path, stored = found
    if uploads is not None:
        if stored:
            uploads.noted_committed(step)
        else:
            uploads.enqueue(step, path, share=True)
    saved = saved_train_state(path)
    if (
        model_layout is not None
        and saved.get("model", "builtin") == "builtin"
        and saved.get("model_layout") != model_layout
    ):
        raise SpecError(
            f"checkpoint {path.name} (step {step}) holds the built-in model in an earlier layout (its attention's "
            f"qkv rows q|k|v, now {model_layout}): finish this run with the hpc-hsdp that started it, or start a "
            f"new --run-dir"
        )
    check_data_position(
        saved.get("data"),
        global_batch=data.layout.global_batch,
        num_samples=data.train.num_samples,
        seed=training.optimizer.seed,
        where=f"checkpoint {path.name} (step {step})",
        sources=source_table(data),
    )
    state = load(path, model, optimizer)
    if ctx.is_rank0 and verbose:
        restart = (ctx.preemption or task_environment(os.environ)).restart_count
        say(
            f"resumed from step {step} (restart {restart}): {path}, saved on mesh "
            f"{state.get('mesh_shape')}, now {list(ctx.plan.mesh_shape)}"
        )
    return int(state["step"]), state
