"""``--stage-data`` on the tasks: every rank stages its node's copies of the token files
(:func:`hpc_hsdp.data.staging_copies.stage_files`: one copier per node under a lock, the node's other
ranks wait) in a thread while the model is built, then the ranks gather what each node did, and
the datasets read the copies from then on. Rank 0 logs the copy's time and writes ``staging.json`` (:mod:`hpc_hsdp.rundir.training.staging_record`).
A rank that cannot stage (the directory cannot be made or written, a shared file does not match
its sidecar's sha256) fails every rank with its one line (exit 2), not a hang."""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.distributed as dist

from hpc_hsdp.data.staging_copies import StageResult, launch_token, stage_files, stage_root
from hpc_hsdp.data.tokens import TokenDataset
from hpc_hsdp.errors import DataError, HsdpError
from hpc_hsdp.plan.staging_dir import stage_base
from hpc_hsdp.rundir.training.staging_record import node_staging, staging_lines, write_staging_record
from hpc_hsdp.task.observation.log import say
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.resilience import injected_faults
from hpc_hsdp.task.training.run_data import TrainData

POLL_S = 2.0
"""How often the ranks agree whether every node's copy is ready."""


def token_datasets(data: TrainData) -> list[TokenDataset]:
    """The token datasets the run reads (train, held-out; a mixture's sources' of both)."""
    found: list[TokenDataset] = []
    for entry in data.datasets:
        for ds in entry if isinstance(entry, tuple) else (entry,):
            if ds is not None and all(ds is not seen for seen in found):
                found.append(ds)
    return found


def _injected_free_bytes(root) -> int:
    free = injected_faults.stage_free_bytes()
    assert free is not None  # used only while the fault sets it
    return free


class Staging:
    """``--stage-data`` under way: this rank's part runs in a thread from :func:`start_staging`
    (file work only, no collective), so the node's copy overlaps the model's build; :meth:`finish`
    (collective) waits for it, gathers every rank's, switches the datasets to the copies, and
    on rank 0 writes ``staging.json`` and logs."""

    def __init__(self, ctx: RunContext, datasets: list, value: str, env) -> None:
        self.ctx, self.datasets, self.value = ctx, datasets, value
        layout = ctx.layout
        self._files = [f for ds in datasets for f in ds.files]
        self._launch = launch_token(
            env, rendezvous=f"{layout.master_addr}:{layout.master_port}", parent_pid=os.getppid()
        )
        self._env = env
        self._free_bytes = None if injected_faults.stage_free_bytes() is None else _injected_free_bytes
        self._result: StageResult | None = None
        self._error: str | None = None
        self._thread = threading.Thread(target=self._stage, name="hpc-hsdp-stage-data", daemon=True)
        self._thread.start()

    def _stage(self) -> None:
        node = self.ctx.layout.node
        try:
            root = stage_root(stage_base(self.value, self._env))
            self._result = stage_files(self._files, root, launch=self._launch, free_bytes=self._free_bytes)
        except HsdpError as exc:
            self._error = " ".join(str(exc).split())
        except OSError as exc:  # a disk that fails mid-copy (ENOSPC after the check, EIO): one line too
            self._error = f"--stage-data on {node}: {exc}"
        except BaseException as exc:  # noqa: BLE001 - every rank must reach the gather
            self._error = f"--stage-data on {node}: {type(exc).__name__}: {exc}"

    def finish(self, *, verbose: bool = True) -> dict:
        """Collective: wait for this rank's part, gather all; DataError (one line, every rank)
        when a rank could not stage. Returns the run's staging record."""
        began = time.perf_counter()
        self._wait_for_every_node()
        waited = time.perf_counter() - began
        node = self.ctx.layout.node
        result = self._result
        mine: tuple[str, dict]
        if self._error:
            mine = (node, {"error": self._error})
        else:
            assert result is not None  # the part ended without an error
            mine = (node, {**result.as_record(), "waited_s": waited})
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        failed = [(node, r["error"]) for node, r in gathered if "error" in r]
        if failed:
            node, error = failed[0]
            raise DataError(error if node in error else f"{error} (on {node})")
        assert result is not None  # no rank failed, this one neither
        for ds in self.datasets:
            ds.read_from(result.local_paths())
        record = node_staging(gathered, self.value)
        if self.ctx.is_rank0:
            if self.ctx.run_dir is not None:
                write_staging_record(self.ctx.run_dir, record)
            if verbose:
                for line in staging_lines(record):
                    say(line)
        return record

    def _wait_for_every_node(self) -> None:
        """Until every rank's part is done, a one-number all_reduce every few seconds: a node that
        copies for longer than the process-group timeout (--timeout: a dataset of terabytes) keeps
        the others waiting in short collectives, never in one that times out."""
        timeout_s = (
            self.ctx.spec.timeout_s if self.ctx.spec is not None else None
        )  # --timeout (None: a TrainingRun of one's own)
        poll = min(POLL_S, timeout_s / 4) if timeout_s else POLL_S
        busy = torch.ones(1, device=self.ctx.device)
        while True:
            self._thread.join(timeout=poll)
            busy.fill_(1.0 if self._thread.is_alive() else 0.0)
            dist.all_reduce(busy, op=dist.ReduceOp.MAX)
            if busy.item() == 0.0:
                return


def start_staging(ctx: RunContext, data: TrainData, value: str, *, env=None) -> Staging | None:
    """Begin this rank's part of ``--stage-data`` (None: the run reads no token files)."""
    datasets = token_datasets(data)
    if not datasets:
        return None
    return Staging(ctx, datasets, value, os.environ if env is None else env)
