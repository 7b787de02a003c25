"""The upload of each local checkpoint to ``--checkpoint-store``, in the background, per rank.

After a checkpoint is committed in ``RUN_DIR/checkpoints`` (:mod:`hpc_hsdp.task.checkpointing.checkpoint`,
as without a store), every rank hands it to its :class:`StoreUploads`: a thread that uploads the
rank's own DCP files (concurrently, multipart for big ones: s3fs's), each failure retried with a
growing wait for as long as it takes, then the rank's marker. Rank 0 then waits until every
rank's marker is there and names the manifest's files (:func:`missing_uploads`), uploads
``train_state.json`` and ``manifest.json`` and writes ``COMPLETE`` last; then it deletes the
store's steps beyond ``--keep-checkpoints`` and the local ones it kept for the upload. Steps go
up in the order they were saved; training never waits for them, except the save on a stop signal
and at the end (:meth:`StoreUploads.finish`), which waits for the commit as long as SLURM leaves.
No collectives: a rank that dies mid-upload leaves its step uncommitted, and that is all.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpc_hsdp.rundir.checkpointing.checkpoint_store import (
    CheckpointStore,
    StoreError,
    backoff_s,
    doomed_steps,
    missing_uploads,
    own_files,
    retrying,
    short,
    wait_limit_s,
)
from hpc_hsdp.rundir.checkpointing.state import MANIFEST, TRAIN_STATE, read_manifest
from hpc_hsdp.rundir.checkpointing.store_record import write_store_record
from hpc_hsdp.task.checkpointing.checkpoint import prune
from hpc_hsdp.task.observation.log import note, say
from hpc_hsdp.task.resilience import injected_faults

if TYPE_CHECKING:
    from hpc_hsdp.job.training_sections import CheckpointSection


class StoreUploads:
    """This rank's uploads (one thread); see the module docstring."""

    def __init__(self, store: CheckpointStore, run_dir: str | Path, *, rank: int, world_size: int, keep: int) -> None:
        self.store = store
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self._queue: deque[tuple[int, Path, bool]] = deque()
        self._busy: int | None = None
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._stopped = False
        self.unfinished: set[int] = set()
        """Steps handed over and not yet committed (or given up): rank 0 keeps their local copies."""
        self.committed: int | None = None
        self.failed: dict[int, str] = {}
        self._record: dict[str, Any] = {
            "url": str(store.url),
            "committed_step": None,
            "uploading": None,
            "retrying": None,
        }
        self._thread = threading.Thread(target=self._run, name="hpc-hsdp-upload", daemon=True)
        self._thread.start()

    @classmethod
    def for_run(cls, ctx, checkpoint: CheckpointSection) -> StoreUploads | None:
        """The uploads of a run with ``--checkpoint-store`` (None without one, or without a run directory)."""
        url = checkpoint.checkpoint_store
        if not url or ctx.run_dir is None:
            return None
        return cls(
            CheckpointStore.open(url),
            ctx.run_dir,
            rank=ctx.rank,
            world_size=ctx.world_size,
            keep=checkpoint.keep_checkpoints,
        )

    # ------------------------------------------------------------------ the training side

    def enqueue(self, step: int, directory: Path, *, share: bool = False) -> None:
        """Upload the committed local checkpoint ``directory`` of ``step`` (every rank): each rank
        its own files, or with ``share`` (a checkpoint of an earlier attempt, maybe of another world
        size) every rank an equal share of them."""
        with self._cond:
            self._queue.append((step, Path(directory), share))
            self.unfinished.add(step)
            self._cond.notify_all()

    def protected(self) -> set[int]:
        """The steps whose local copies rank 0 keeps: handed over, not yet committed."""
        with self._cond:
            return set(self.unfinished)

    def noted_committed(self, step: int) -> None:
        """The store already holds ``step`` committed (found on resume)."""
        self.committed = max(self.committed or 0, step)
        if self.rank == 0:
            self._write_record(committed_step=self.committed)

    def wait(self, timeout_s: float) -> bool:
        """Block until every step handed over is uploaded (rank 0: committed), at most ``timeout_s``;
        after that the thread gives up the step it is on. Whether all went up."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._deadline = deadline
            self._cond.notify_all()
            while self._queue or self._busy is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=min(left, 1.0))
            done = not self._queue and self._busy is None
            self._deadline = None
        return done and not self.failed

    def finish(self, env=None, *, term_at: float | None = None, verbose: bool = True) -> bool:
        """The way out (after the final save): wait for the uploads as long as SLURM leaves, and say so."""
        with self._cond:
            steps = sorted(self.unfinished)
        if not steps:
            return True
        limit = wait_limit_s(os.environ if env is None else env, now=time.time(), term_at=term_at)
        began = time.monotonic()
        if self.rank == 0 and verbose:
            say(f"waiting up to {limit:,.0f} s for the upload of step {steps[-1]} to {self.store.url}")
        done = self.wait(limit)
        if self.rank == 0 and verbose:
            spent = time.monotonic() - began
            if done:
                say(f"checkpoint step {steps[-1]} committed in {self.store.url} ({spent:,.1f} s after the save)")
            else:
                where = f"step {self.committed}" if self.committed is not None else "no step"
                why = "; ".join(self.failed.values()) or "not finished"
                note(
                    f"warning: the upload of step {steps[-1]} to {self.store.url} did not complete in {spent:,.0f} s "
                    f"({why[:300]}); the store's newest committed step is {where}, the run directory holds step "
                    f"{steps[-1]} and the next job uploads it"
                )
        return done

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                step, directory, share = self._queue.popleft()
                self._busy = step
            try:
                self._upload(step, directory, share=share)
            except Exception as exc:  # noqa: BLE001 - a failed upload never stops training
                self.failed[step] = f"step {step}: {short(exc, 300)}"
                if self.rank == 0:
                    self._write_record(uploading=None)
                    note(f"warning: the upload of step {step} to {self.store.url} failed: {short(exc, 300)}")
            finally:
                with self._cond:
                    self._busy = None
                    self.unfinished.discard(step)
                    self._cond.notify_all()

    def _deadline_now(self) -> float | None:
        return self._deadline

    def _retrying(self, action, what: str):
        def on_retry(attempts: int, exc: BaseException, wait: float) -> None:
            if self.rank == 0:
                self._write_record(
                    retrying={"what": what, "attempts": attempts, "error": short(exc), "since": time.time()}
                )

        result = retrying(action, what=what, deadline=self._deadline_now, on_retry=on_retry)
        if self.rank == 0 and self._record.get("retrying"):
            self._write_record(retrying=None)
        return result

    def _upload(self, step: int, directory: Path, *, share: bool) -> None:
        manifest = read_manifest(directory)
        if manifest is None:
            raise StoreError(f"{directory} has no readable manifest: not uploaded")
        files = manifest["files"]
        mine = sorted(files)[self.rank :: self.world_size] if share else own_files(files, self.rank)
        if self.rank == 0:
            self._write_record(uploading={"step": step, "since": time.time(), "waiting": "uploading"})
        self._retrying(lambda: self.store.put(step, directory, mine[:1]), f"the upload of step {step}")
        injected_faults.in_upload(self.rank, step)  # test hook: a rank dies with its files half uploaded
        self._retrying(lambda: self.store.put(step, directory, mine[1:]), f"the upload of step {step}")
        marker = {name: files[name] for name in mine}
        self._retrying(lambda: self.store.write_marker(step, self.rank, marker), f"the marker of step {step}")
        if self.rank == 0:
            self._commit(step, directory, manifest)

    def _commit(self, step: int, directory: Path, manifest: dict) -> None:
        """Rank 0: wait for every rank's marker, then the train state, the manifest and COMPLETE."""
        attempt = 0
        while True:
            markers = self._retrying(lambda: self.store.markers(step), f"reading the markers of step {step}")
            problem = missing_uploads(manifest, self.world_size, markers)
            if problem is None:
                break
            self._write_record(
                uploading={"step": step, "since": self._record["uploading"]["since"], "waiting": problem}
            )
            limit = self._deadline
            wait = backoff_s(attempt, base=0.05, cap=0.25)
            if limit is not None and time.monotonic() + wait > limit:
                raise StoreError(f"step {step} not committed: {problem}")
            time.sleep(wait)
            attempt += 1
        names = [TRAIN_STATE, MANIFEST]  # the manifest after everything it names
        for name in names:
            self._retrying(lambda n=name: self.store.put(step, directory, [n]), f"the upload of step {step}")
        self._retrying(lambda: self.store.commit(step), f"the commit of step {step}")
        self.committed = max(self.committed or 0, step)
        self._write_record(committed_step=self.committed, committed_at=time.time(), uploading=None)
        self._retention()

    def _retention(self) -> None:
        try:
            committed, uncommitted = self.store.listing()
            for doomed in doomed_steps(committed, uncommitted, self.keep):
                self.store.remove(doomed)
        except Exception as exc:  # noqa: BLE001 - the next commit tries again
            note(f"warning: old checkpoints in {self.store.url} could not be deleted: {short(exc)}")
        prune(self.run_dir, keep=self.keep, protect=self.protected() - {self._busy})

    def _write_record(self, **fields) -> None:
        self._record.update(fields)
        try:
            write_store_record(self.run_dir, self._record)
        except OSError as exc:
            note(f"warning: {self.run_dir} could not record the uploads: {exc}")
