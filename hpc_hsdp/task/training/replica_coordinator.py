"""Replica-level fault tolerance (``--fault-tolerance replica``) on one replica group, with torchft.

The job's replica groups (:mod:`hpc_hsdp.plan.replica_layout`) each run as a job of their own: a
process group and a mesh of the group's ranks, ``fully_shard`` on it as always. Across the
groups, :class:`ReplicaGroup`, the step coordinator the engine is given
(:mod:`hpc_hsdp.task.training.coordinator`), puts torchft in three places of the engine's step:

- the quorum (``OptimizerWrapper.zero_grad`` -> ``Manager.start_quorum``, synchronous:
  ``use_async_quorum=False``; FSDP2's hooks do not survive the asynchronous one) decides
  which groups train the step; a group that is behind (relaunched, or on a spare) loads the
  state from a live peer in it (:meth:`ReplicaGroup.state_dict` / ``load_state_dict``);
- the gradient average: every FSDP unit's reduce-scatter output goes through
  ``Manager.allreduce`` (``FSDPModule.set_all_reduce_hook``) over a torchft process group
  (gloo on CPU, NCCL on GPU) of the same rank of every live group;
- the commit: ``OptimizerWrapper.step`` steps the optimizer only when every live group
  agrees (``should_commit``); a step that failed (a group died in it) is trained again, with
  the groups that are left, under the same number.

The step's rows (:func:`hpc_hsdp.plan.replica_layout.group_rows`) follow from the step number and
the live groups alone: whatever the membership, every sample of every step is trained once.
Membership changes are appended to ``<run-dir>/replicas.jsonl`` (time, step, replicas, cause).
Below ``--min-replicas`` (:class:`QuorumLost`) one surviving group saves the last committed
step for all (:meth:`ReplicaGroup.claim_fallback_save`) before the job falls back to a requeue.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hpc_hsdp.files import open_for_writing
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.rundir.files import append_jsonl
from hpc_hsdp.rundir.observation.replica_membership import MEMBERSHIP_LOG
from hpc_hsdp.task.observation.log import note, say
from hpc_hsdp.task.parallelism.dist import RunContext
from hpc_hsdp.task.parallelism.tensor_parallel import local_value, loss_context
from hpc_hsdp.task.training.optimizer import local_shard
from hpc_hsdp.task.training.step import local_grads


class QuorumLost(RuntimeError):
    """No quorum of ``--min-replicas`` groups within ``--quorum-timeout``: the job falls back to a
    requeue (:meth:`ReplicaGroup.fall_back_save` saves the last committed step first, one group for all)."""


QUORUM_TRY_S = 10.0
"""One quorum request's timeout; a failed one is asked again until ``--quorum-timeout``. torchft's
manager does not answer a request whose lighthouse call failed (the lighthouse was restarted in
the meantime): its ranks would wait out the whole timeout for a quorum the new lighthouse gives."""

FALLBACK_LOCK = ".fallback-save.lock"
"""Under ``<run-dir>/checkpoints``: held by the one surviving group that saves on a fall back."""


class Waitable(Protocol):
    """A collective in flight (torchft's ``Work``)."""

    def wait(self) -> object: ...


class ReplicaManager(Protocol):
    """What a replica group asks of torchft's ``Manager`` (:func:`torchft_manager`; tests give a stand-in)."""

    _quorum_future: object
    """The quorum request in flight; None lets ``start_quorum`` ask again after a failed one."""
    _quorum_id: int
    """The lighthouse's number of the current quorum (a new one when its members change)."""

    def load_state_dict(self, state_dict: dict[str, int]) -> None: ...

    def allreduce(self, tensor: torch.Tensor, reduce_op=...) -> Waitable: ...

    def start_quorum(self, *, timeout: timedelta) -> None: ...

    def current_step(self) -> int: ...

    def num_participants(self) -> int: ...

    def participating_rank(self) -> int | None: ...

    def shutdown(self, wait: bool = ...) -> None: ...


def _to_local_tree(value):
    """A state with every DTensor replaced by this rank's local shard (a copy: sent to a peer)."""
    if isinstance(value, DTensor):
        return local_shard(value).detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _to_local_tree(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_local_tree(v) for v in value)
    return value


def heal_transport(timeout: timedelta, address: str | None):
    """torchft's HTTP checkpoint transport (how a healing group fetches a live peer's state)
    with two changes: its server listens on ``address`` only (torchft's binds every interface;
    None: as torchft does), and what it fetches is unpickled with ``weights_only=True`` (torchft
    loads it with ``weights_only=False``: whoever reaches the port of a rank that heals could
    make it run code). The state it carries is tensors and plain data only
    (:meth:`ReplicaGroup.state_dict`)."""
    import urllib.request  # noqa: PLC0415 - only a fault-tolerant job needs it
    from http.server import ThreadingHTTPServer  # noqa: PLC0415 - as above
    from socket import AF_INET, AF_INET6  # noqa: PLC0415 - as above
    from threading import Thread  # noqa: PLC0415 - as above

    from torch.distributed._serialization import _streaming_load  # noqa: PLC0415 - torch >= 2.7, as torchft
    from torchft.checkpointing.http_transport import HTTPTransport  # noqa: PLC0415 - the optional extra

    class BoundHTTPTransport(HTTPTransport):
        _server: ThreadingHTTPServer
        _thread: Thread

        def __init__(self) -> None:
            self._host = address  # before torchft's __init__, which logs address()
            super().__init__(timeout=timeout, num_chunks=0)
            if address is None:
                return
            handler = self._server.RequestHandlerClass  # torchft's, defined in its __init__
            self._server.shutdown()
            self._thread.join()
            self._server.server_close()
            family = AF_INET6 if ":" in address else AF_INET

            class Server(ThreadingHTTPServer):
                address_family = family
                request_queue_size = 1024

            self._server = Server((address, 0), handler)
            self._thread = Thread(target=self._serve, daemon=True)
            self._thread.start()

        def address(self) -> str:
            if self._host is None:
                return super().address()
            host = f"[{self._host}]" if ":" in self._host else self._host
            return f"http://{host}:{self._server.socket.getsockname()[1]}/checkpoint/"

        @classmethod
        def _load_from_address(cls, url: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return BoundHTTPTransport()


def heal_address(env) -> str | None:
    """The address this rank's heal server listens on: this node's on the job's network (the
    emulator's loopback); None (every interface, as torchft) where none can be told."""
    from hpc_hsdp.errors import SlurmEnvError  # noqa: PLC0415 - only a fault-tolerant job needs it
    from hpc_hsdp.plan.address import reachable_address  # noqa: PLC0415 - as above
    from hpc_hsdp.scheduler.backends import task_backend  # noqa: PLC0415 - as above

    if not task_backend(env).separate_machines:  # the emulator: every node is this machine
        return "127.0.0.1"
    try:
        return reachable_address(env)
    except SlurmEnvError:
        return None


def torchft_manager(group: ReplicaGroup) -> ReplicaManager:
    """torchft's ``Manager`` of ``group`` (collective: the group's ranks): a torchft process group
    (NCCL on GPU, gloo on CPU) to the same rank of every live group, the group's own store, the
    lighthouse of ``TORCHFT_LIGHTHOUSE``; the heal's state comes and goes through the group's
    :meth:`~ReplicaGroup.state_dict` and :meth:`~ReplicaGroup.load_state_dict`."""
    from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # noqa: PLC0415 - the optional extra

    ctx, training = group.ctx, group.training
    timeout = timedelta(seconds=training.resilience.quorum_timeout)
    pg = ProcessGroupNCCL(timeout=timeout) if ctx.device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    layout = ctx.layout
    return Manager(
        pg=pg,
        min_replica_size=training.resilience.min_replicas,
        load_state_dict=group.load_state_dict,
        state_dict=group.state_dict,
        replica_id=f"hpc_hsdp_replica_{group.replica_id}",
        use_async_quorum=False,
        init_sync=False,  # every group initialises from the same seed (or resumes the same checkpoint)
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        rank=ctx.rank,
        world_size=ctx.world_size,
        store_addr=layout.master_addr,
        store_port=layout.master_port,
        hostname=layout.master_addr,
        checkpoint_transport=heal_transport(timeout, heal_address(os.environ)),
    )


class ReplicaGroup:
    """torchft on one replica group, the engine's step coordinator
    (:class:`~hpc_hsdp.task.training.coordinator.StepCoordinator`): see the module docstring.
    ``make_manager(group)``: torchft's manager of the group (:func:`torchft_manager`)."""

    def __init__(
        self,
        ctx: RunContext,
        training: TrainingSpec,
        *,
        make_manager: Callable[[ReplicaGroup], ReplicaManager] | None = None,
    ) -> None:
        self.ctx, self.training = ctx, training
        self.replica_id, self.num_groups, self.attempt = ctx.replica or (0, 1, 0)
        self._make_manager = make_manager or torchft_manager
        self.replicas: int | None = None
        """Replica groups in the current step's quorum."""
        self.index: int | None = None
        """This group's place among them (0: the step's leader, which writes metrics and checkpoints)."""
        self.healed_at: int | None = None
        """The step this group last fetched from a live peer (None: it never healed)."""
        self.retries = 0
        """Attempts of the coming step that the live groups did not commit (a group was lost in it)."""
        self._last_members: tuple[int, int] | None = None

    def open(self, data, adapter, model, optimizer, *, start_step, state, save_now) -> None:
        """Collective (the group's ranks): torchft's manager at ``start_step``, the optimizer
        wrapped so that it steps only on a commit, the gradient average hooked into every FSDP unit."""
        from torchft.optim import OptimizerWrapper  # noqa: PLC0415 - the optional extra

        self.data, self.adapter, self.model, self.raw_optimizer = data, adapter, model, optimizer
        self._engine_state, self._save_now = state, save_now
        self.manager = self._make_manager(self)
        self.manager.load_state_dict({"step": start_step, "batches_committed": 0})
        self.optimizer = OptimizerWrapper(self.manager, optimizer)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(self._average_across_groups)

    # ------------------------------------------------------------------ the step

    def _average_across_groups(self, reduced: torch.Tensor) -> None:
        self.manager.allreduce(reduced).wait()

    def steps(self, done: Callable[[], int]) -> Iterable[int]:
        """The step after the last committed one (``done()``) until ``--steps``: a step the live
        groups did not commit comes again; one that healed goes on from the peer's step."""
        while done() < self.training.optimizer.steps:
            yield done() + 1

    def begin(self, number: int) -> tuple[int, list, float]:
        """Collective: the quorum (:meth:`quorum`), then this rank's micro-batches of the step it
        gives, read now (:meth:`read_batches`). Without a quorum, the fall back's save first
        (:meth:`fall_back_save`)."""
        try:
            number = self.quorum()
        except Exception:
            self.fall_back_save()
            raise
        began = time.perf_counter()
        batches = self.read_batches(number)
        return number, batches, time.perf_counter() - began

    def quorum(self) -> int:
        """Collective (the group, then every live group): the quorum, the heal if this group is
        behind, the gradients zeroed; the number of the step to train now."""
        before = self.manager.current_step()
        began = time.time()
        deadline = began + self.training.resilience.quorum_timeout
        while True:
            left = deadline - time.time()
            try:
                # what OptimizerWrapper.zero_grad does, with one try's timeout: start_quorum (synchronous)
                self.manager.start_quorum(timeout=timedelta(seconds=max(1.0, min(QUORUM_TRY_S, left))))
                break
            except Exception as exc:  # torchft raises what its quorum RPC raised (a timeout)
                if time.time() + 1.0 < deadline:
                    self.manager._quorum_future = None  # noqa: SLF001 - else start_quorum raises this failure again
                    continue
                raise QuorumLost(
                    f"replica group {self.replica_id}: no quorum of --min-replicas {self.training.resilience.min_replicas} "
                    f"groups within --quorum-timeout {self.training.resilience.quorum_timeout:g} s after step {before} "
                    f"({type(exc).__name__}: {' '.join(str(exc).split())[:160]})"
                ) from exc
        self.raw_optimizer.zero_grad(set_to_none=True)
        number = self.manager.current_step() + 1
        self.replicas = self.manager.num_participants()
        self.index = self.manager.participating_rank()
        if self.index is None:
            raise RuntimeError(f"replica group {self.replica_id} is not in the quorum of step {number}")
        members = (self.manager._quorum_id, self.replicas)  # noqa: SLF001 - torchft exposes no getter
        if members != self._last_members:
            cause = "start" if self._last_members is None else "membership changed"
            if self.manager.current_step() != before:
                cause = f"healed from a live peer at step {self.manager.current_step()}"
                self.healed_at = self.manager.current_step()
            elif self._last_members is not None and self.replicas < self._last_members[1]:
                cause = "a replica group was lost"
            elif self._last_members is not None and self.replicas > self._last_members[1]:
                cause = "a replica group joined"
            self._record_membership(number, cause, waited_s=time.time() - began)
            self._last_members = members
        return number

    def read_batches(self, number: int) -> list:
        """This rank's micro-batches of step ``number`` when ``self.replicas`` groups train it
        (:func:`~hpc_hsdp.plan.replica_layout.group_rows`), read now: which rows are this rank's is
        known only after the step's quorum. An empty micro-batch carries one row of weight 0."""
        from hpc_hsdp.plan.replica_layout import group_rows  # noqa: PLC0415 - beside the loader's imports
        from hpc_hsdp.task.training.loader import MicroBatch, read_rows  # noqa: PLC0415 - no cycle at import

        data, ctx = self.data, self.ctx
        assert self.replicas is not None and self.index is not None  # quorum() found them
        layout = data.layout
        positions = layout.step_positions(number)
        spans = group_rows(
            layout.global_batch,
            participants=self.replicas,
            group_index=self.index,
            group_world=ctx.data_world_size,  # a tp group's ranks read the same rows
            rank=ctx.data_rank,
            max_rows=layout.rank_batch,
        )
        batches = []
        for micro, (start, stop) in enumerate(spans):
            ids = data.order.sample_ids(positions[start:stop])
            inputs, targets = read_rows(data.train, ids if len(ids) else data.order.sample_ids(positions[:1]))
            batches.append(MicroBatch(number, micro, inputs, targets, ids).to(ctx.device))
        return batches

    def train_step(self, batches, *, lr: float, stop_code) -> tuple[torch.Tensor, bool]:
        """One step of the group: ``([global mean loss, global grad norm, agreed stop code], committed)``.

        Each micro-batch's loss is weighted by its rows so that, after FSDP's average over the
        group's ranks and torchft's over the live groups, the gradient is the global batch's
        mean, whatever each group's share of it. The loss, the row count and the stop codes are
        summed over the group, then over the live groups (torchft); the squared gradient norm
        (the gradients are the same in every group by then) over the group only."""
        from hpc_hsdp.task.resilience.preemption import NONE, TERMINATE, WARNING, split_stop_code  # noqa: PLC0415 - beside step.py's

        model, adapter, ctx = self.model, self.adapter, self.ctx
        assert self.replicas is not None  # quorum() found them
        device = batches[0].inputs.device
        scale = ctx.data_world_size * self.replicas / self.data.layout.global_batch
        loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        accum = len(batches)
        for index, batch in enumerate(batches):
            if accum > 1:
                model.set_requires_all_reduce(index == accum - 1)
            rows = len(batch.sample_ids)
            with loss_context(ctx, adapter):
                loss = adapter.loss(model, batch.inputs, batch.targets)
                (loss * (rows * scale)).backward()
            loss_sum += local_value(loss.detach()).float() * (rows / ctx.dims.tp)  # T ranks add each row
        grads, squared = local_grads(model, device, ctx.dims)
        code = split_stop_code(stop_code())[0] if stop_code is not None else NONE  # no debugger here
        rows_here = float(sum(len(b.sample_ids) for b in batches)) / ctx.dims.tp
        fused = torch.stack(
            [
                loss_sum,
                torch.full((), rows_here, device=device),
                torch.full((), float(code == WARNING), device=device),
                torch.full((), float(code == TERMINATE), device=device),
                squared,
            ]
        )
        dist.all_reduce(fused, op=dist.ReduceOp.SUM)
        across = self.allreduce_sum(fused[:4].clone())
        mean_loss = across[0] / torch.clamp(across[1], min=1.0)
        grad_norm = (fused[4] / self.ctx.plan.num_replicas).sqrt()
        agreed = torch.where(across[3] > 0, float(TERMINATE), torch.where(across[2] > 0, float(WARNING), float(NONE)))
        clip_grad = self.training.optimizer.clip_grad
        if clip_grad > 0 and grads:
            torch._foreach_mul_(grads, torch.clamp(clip_grad / (grad_norm + 1e-6), max=1.0))
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        committed = self.commit()
        return torch.stack([mean_loss, grad_norm, agreed]), committed

    def commit(self) -> bool:
        """Collective: step the optimizer when every live group agrees; whether it did (an
        attempt that did not commit counts in the next record's ``retries``)."""
        before = self.manager.current_step()
        self.optimizer.step()  # should_commit, then the inner optimizer's step
        committed = self.manager.current_step() == before + 1
        if not committed:
            self.retries += 1
        return committed

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the step's live groups (same-rank peers), in place."""
        from torch.distributed import ReduceOp  # noqa: PLC0415 - beside the others

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return tensor

    debuggable = False
    """``hpc-hsdp debug`` is not offered: the groups meet at a step through the quorum, not at one boundary."""

    @property
    def leads(self) -> bool:
        """This group writes the step's record and checkpoint (the first of the live groups)."""
        return self.index == 0

    @property
    def prints_step_lines(self) -> bool:
        """Every group's rank 0 prints its steps' lines."""
        return self.ctx.rank == 0

    @property
    def rank_label(self) -> str:
        """``<replica id>-<rank in the group>``."""
        return f"{self.replica_id}-{self.ctx.rank}"

    def take_record_fields(self) -> dict:
        """The step's quorum (``replicas`` of ``replica_groups``), this group's ``replica_id`` and
        the attempts of the step that did not commit (``retries``, then counted afresh)."""
        fields = {
            "replicas": self.replicas,
            "replica_groups": self.num_groups,
            "replica_id": self.replica_id,
            "retries": self.retries,
        }
        self.retries = 0
        return fields

    def _record_membership(self, number: int, cause: str, *, waited_s: float) -> None:
        record = {
            "time": time.time(),
            "step": number,
            "replicas": self.replicas,
            "of": self.num_groups,
            "replica_id": self.replica_id,
            "attempt": self.attempt,
            "cause": cause,
            "quorum_s": round(waited_s, 3),
        }
        if self.ctx.rank == 0:
            note(
                f"replica group {self.replica_id}: step {number} trains with {self.replicas}/{self.num_groups} "
                f"replica groups ({cause}; quorum {waited_s:.2f} s)"
            )
            if self.ctx.run_dir is not None:
                append_jsonl(Path(self.ctx.run_dir) / MEMBERSHIP_LOG, record)

    # ------------------------------------------------------------------ the state a joining group fetches

    def state_dict(self) -> dict:
        """This rank's part of the group's state: its local shards, optimizer state (shards),
        the step and the engine's own state (the data position follows from the step)."""
        return {
            "model": {name: local_shard(p).detach().clone() for name, p in self.model.named_parameters()},
            "optimizer": _to_local_tree(self.raw_optimizer.state_dict()),
            "step": self.manager.current_step(),
            "engine": json.loads(json.dumps(self._engine_state)),
        }

    def load_state_dict(self, state: dict) -> None:
        """A live peer's state (same rank in its group): shards copied into the parameters; the
        optimizer's shards rebuilt as DTensors shaped like their parameters."""
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, local in state["model"].items():
                local_shard(params[name]).copy_(local.to(self.ctx.device))
        ordered = [p for group in self.raw_optimizer.param_groups for p in group["params"]]
        optim = state["optimizer"]
        rebuilt = {}
        for index, entry in optim.get("state", {}).items():
            param = ordered[int(index)]
            rebuilt[index] = {
                key: (
                    DTensor.from_local(
                        value.to(self.ctx.device),
                        param.device_mesh,
                        param.placements,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0
                    else value
                )
                for key, value in entry.items()
            }
        self.raw_optimizer.load_state_dict({"state": rebuilt, "param_groups": optim["param_groups"]})
        self._engine_state.clear()
        self._engine_state.update(state.get("engine") or {})

    def claim_fallback_save(self) -> bool:
        """Rank 0: whether this group writes the fall back's checkpoint (the first to lock the
        file, while no complete checkpoint of its step exists); held until the process ends."""
        import fcntl  # noqa: PLC0415 - the fall back only

        from hpc_hsdp.rundir.checkpointing.state import checkpoint_root, complete_checkpoints  # noqa: PLC0415 - as fcntl

        if self.ctx.run_dir is None:
            return False
        root = checkpoint_root(self.ctx.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        self._lock = open_for_writing(root / FALLBACK_LOCK, append=True)  # held to the end of the process
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        step = self.manager.current_step()
        return step > 0 and all(saved != step for saved, _ in complete_checkpoints(self.ctx.run_dir))

    def fall_back_save(self) -> None:
        """Collective in a group whose quorum failed (below ``--min-replicas``): one surviving
        group saves the last committed step, so that the requeued job resumes exactly."""
        claim = torch.zeros(1, device=self.ctx.device)
        if self.ctx.rank == 0:
            claim[0] = float(self.claim_fallback_save())
        dist.broadcast(claim, src=0)
        if claim.item():
            self.index = 0  # this group saves for all
            saved = self._save_now()
            if self.ctx.rank == 0:
                say(f"replica group {self.replica_id}: below --min-replicas; saved step {saved} to requeue")

    def close_steps(self) -> None:
        pass  # nothing reads ahead: a step's rows are read after its quorum

    def close(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception as exc:  # noqa: BLE001 - at the end: nothing left to save
            note(f"torchft manager shutdown: {exc}")
