"""Process group, DeviceMesh and the realized-group check, from a RankLayout.

``init`` is the one place a task joins the job: it derives the node-major layout from
SLURM's (or torchrun's) variables, exports RANK/WORLD_SIZE/... for torch, picks the
device, creates the process group explicitly (NCCL on CUDA, gloo on CPU), builds the
``("replicate", "shard")`` mesh and checks the groups torch built against the plan on
every rank. Hung jobs: ``kill -QUIT <pid>`` (or ``scancel --signal=QUIT <job>``: it reaches
every task and the job keeps running) prints every thread's stack of a rank to its stderr, i.e.
its log, and the rank goes on. Which device a task gets: :func:`hpc_hsdp.task.parallelism.device.pick_device`.
"""

from __future__ import annotations

import ctypes
import errno
import faulthandler
import os
import platform
import signal
import socket
import time
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hpc_hsdp.batch_shell.code_snapshot import SNAPSHOT_VARIABLE
from hpc_hsdp.errors import HsdpError, SlurmEnvError
from hpc_hsdp.job.spec import DEVICES
from hpc_hsdp.plan.replica_layout import ATTEMPT_ENV, REPLICA_GROUPS_ENV, REPLICA_ID_ENV
from hpc_hsdp.plan.topology import ParallelDims, RankLayout, TopologyPlan
from hpc_hsdp.rundir.layout import RANK_FIELDS
from hpc_hsdp.rundir.layout import write_layout as layout_file
from hpc_hsdp.rundir.lifecycle.provenance_record import write_task_provenance
from hpc_hsdp.rundir.observation.flight_recorder import HANG_DIR, TRACE_PREFIX
from hpc_hsdp.task.observation.comm_stats import recorder_for as comm_recorder
from hpc_hsdp.task.observation.log import note
from hpc_hsdp.task.parallelism.device import pick_device
from hpc_hsdp.task.parallelism.verify import GroupMismatchError, compare_groups, mismatch_message

if TYPE_CHECKING:
    from hpc_hsdp.job.spec import RunSpec
    from hpc_hsdp.task.observation.comm_stats import CommStats
    from hpc_hsdp.task.resilience.preemption import Preemption

MESH_AXES = ("replicate", "shard")

STACK_DUMP_SIGNAL = signal.SIGQUIT
"""Dumps all threads' stacks (faulthandler). SLURM sends TERM/KILL on cancel and
USR1/USR2 for preemption warnings (submitit uses USR2); NCCL and gloo use none. QUIT
would otherwise kill the rank with a core dump; here the rank prints and continues."""

FLIGHT_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""torch's flight recorder size (the second is the older name); 0, torch's default, records nothing."""
FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives the NCCL flight recorder keeps per rank unless the job sets its own size: the
hang watchdog dumps them, so that a hang shows which collective each rank was in."""


FLIGHT_RECORDER_DUMP_VARIABLES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
"""Where torch writes a rank's trace when its own NCCL watchdog times a collective out (the
rank is appended; the second is the older name)."""
DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"


def flight_recorder_env(env: Mapping[str, str], run_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """What to export before an NCCL process group exists so that torch records its last
    collectives; nothing when the job chose a size itself (0 included). With ``run_dir``,
    torch's own dump on a process-group timeout too, to ``<run_dir>/hang/nccl-trace-rank<N>``
    beside the hang watchdog's (unless the job chose where)."""
    if any(name in env for name in FLIGHT_RECORDER_VARIABLES):
        return {}
    chosen = dict.fromkeys(FLIGHT_RECORDER_VARIABLES, str(FLIGHT_RECORDER_ENTRIES))
    if run_dir is not None:
        chosen.setdefault(DUMP_ON_TIMEOUT, env.get(DUMP_ON_TIMEOUT) or "1")
        if not any(name in env for name in FLIGHT_RECORDER_DUMP_VARIABLES):
            prefix = str(Path(run_dir).absolute() / HANG_DIR / TRACE_PREFIX)
            chosen.update(dict.fromkeys(FLIGHT_RECORDER_DUMP_VARIABLES, prefix))
    return chosen


FAULT_RANK_FROM_PROCID = "HPC_HSDP_FAULT_RANK_FROM_PROCID"
"""Test hook: when set to 1, the torch rank is SLURM_PROCID (the classic mistake) instead of
the node-major rank, so that under cyclic distribution the realized groups straddle nodes
and the check must fail on every rank."""


def _require_numpy() -> None:
    try:
        import numpy  # noqa: F401, PLC0415 - only asks whether numpy is installed
    except ImportError:
        raise HsdpError(
            "numpy is not installed; torch.distributed's object collectives (the group check, "
            "torch.distributed.checkpoint) need it: pip install numpy"
        ) from None


PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value


def allow_same_user_tracer() -> bool:
    """Let a debugger or py-spy of this user attach to this rank (``hpc-hsdp stacks``) where
    yama's ``ptrace_scope=1`` allows only a parent to: ``prctl(PR_SET_PTRACER_ANY)``. The kernel
    still refuses other users (and everyone at ``ptrace_scope`` 2 or 3). Whether it was set."""
    if platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def node_name(env: Mapping[str, str]) -> str:
    """The node this task runs on: SLURM's name for it, else the short host name."""
    return env.get("SLURMD_NODENAME", "").strip() or socket.gethostname().split(".")[0]


@dataclass(frozen=True, eq=False)
class RunContext:
    """What a rank knows after :func:`init`: its layout, the mesh and the device (the topology,
    fixed for the run), the task's services, given when it is made, and what ends with it."""

    layout: RankLayout
    mesh: DeviceMesh
    device: torch.device
    run_dir: Path | None = None
    realized: list[dict] = field(default_factory=list)
    """Per rank (index = rank): node, slurm_procid, local_rank, device, shard_group, replicate_group."""
    replica: tuple[int, int, int] | None = None
    """With ``--fault-tolerance replica``: (replica id, replica groups, attempt) of this task's
    replica group, which is the whole world of its process group; None otherwise."""
    spec: RunSpec | None = None
    """The RunSpec when started through ``run_task`` (``hpc-hsdp run`` or submit)."""
    comm_stats: CommStats | None = None
    """The active recorder of every collective (``init(comm_stats=True)``); None: collectives are
    not wrapped at all."""
    preemption: Preemption | None = None
    """The task's signal flags (``run_task``'s); ``ctx.preemption.should_stop(step)`` at a step
    boundary agrees on them (collective). None: a context of one's own (:func:`init`)."""
    teardown: ExitStack = field(default_factory=ExitStack, repr=False)
    """What ends with the context, last in first out, given the exception it ends by: :func:`init`
    puts the process group and its variables there, then the collectives' recorder; the engine its
    observer's error record and the saves in flight."""
    _active: bool = field(default=True, repr=False)

    @property
    def plan(self) -> TopologyPlan:
        return self.layout.plan

    @property
    def rank(self) -> int:
        return dist.get_rank() if self._active and dist.is_initialized() else self.layout.rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def dims(self) -> ParallelDims:
        """The mesh's sizes: R replicas, S ranks sharding each, T ranks splitting every layer."""
        return self.plan.dims

    @property
    def data_rank(self) -> int:
        """This rank's place among the ranks that read different rows: the ranks of one tp group
        (T consecutive ranks) read the same rows."""
        return self.rank // self.dims.tp

    @property
    def data_world_size(self) -> int:
        """Ranks that read different rows: R x S."""
        return self.dims.data_world_size

    @property
    def data_mesh(self) -> DeviceMesh:
        """The ``("replicate", "shard")`` mesh FSDP2 shards over (the whole mesh without tensor parallelism)."""
        return self.mesh if self.dims.tp == 1 else self.mesh["replicate", "shard"]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The ``"tp"`` axis (None without tensor parallelism)."""
        return self.mesh["tp"] if self.dims.tp > 1 else None

    @property
    def is_rank0(self) -> bool:
        """Rank 0, which writes the run's files; of a replica group's job, rank 0 of group 0 on
        its first start only (the others write their own steps' records, not the run's files)."""
        return self.rank == 0 and (self.replica is None or (self.replica[0] == 0 and self.replica[2] == 0))

    def barrier(self) -> None:
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def shutdown(self) -> None:
        """Run :attr:`teardown`: close the recorder, destroy the process group and restore the
        variables ``init`` exported (once; a context that owns no process group does nothing)."""
        self.__exit__(None, None, None)

    def __enter__(self) -> RunContext:
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        object.__setattr__(self, "_active", False)  # the one thing that changes: the context has ended
        self.teardown.__exit__(*exc)


def _leave(saved_env: Mapping[str, str | None]) -> None:
    """Destroy the process group (if any) and put back the variables ``init`` exported."""
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _group_ranks(mesh: DeviceMesh, axis: str) -> list[int]:
    return list(dist.get_process_group_ranks(mesh.get_group(axis)))


def init(
    shard_size: int = 1,
    device: str = "auto",
    run_dir: str | os.PathLike | None = None,
    timeout_s: int = 300,
    *,
    env: Mapping[str, str] | None = None,
    verify: bool = True,
    comm_stats: bool = False,
    topology: str = "auto",
    tp_size: int = 1,
    spec: RunSpec | None = None,
    preemption: Preemption | None = None,
) -> RunContext:
    """Join the job: process group, ``("replicate", "shard")`` DeviceMesh (``("replicate", "shard",
    "tp")`` with ``tp_size`` T > 1: T consecutive ranks of one node split every layer), verified groups.

    ``env`` is the task's environment (default ``os.environ``): SLURM's variables of an
    ``srun`` task, or torchrun's. Rank 0 writes ``<run_dir>/layout.json`` when ``run_dir``
    is given. Raises :class:`HsdpError` on every rank when the realized groups differ
    from the plan. Call ``ctx.shutdown()`` (or use ``with``) to tear the group down.
    ``comm_stats=True`` records every collective until shutdown (``ctx.comm_stats.take()``:
    the totals since the last take; the built-in payload logs them per step).
    ``topology`` (``auto``, ``off``, ``strict``): the job's ``--topology``: how the nodes' switches
    (``HPC_HSDP_NODE_SWITCHES``, exported by the batch script) order them.
    """
    env = dict(os.environ if env is None else env)
    layout = _task_layout(env, shard_size=shard_size, device=device, topology=topology, tp_size=tp_size)
    torch_device, device_note = pick_device(device, layout, env)
    torch_env = _torch_env(env, layout, torch_device, run_dir)
    torch_rank = int(torch_env["RANK"])

    faulthandler.enable()
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)
    allow_same_user_tracer()

    saved = {name: os.environ.get(name) for name in torch_env}
    os.environ.update(torch_env)
    me = {
        "rank": torch_rank,
        "node": node_name(env),
        "slurm_procid": layout.slurm_procid,
        "local_rank": layout.local_rank,
        "device": str(torch_device),
        "launch_mode": layout.launch_mode,
        "node_switch": layout.node_switch,
        "pid": os.getpid(),
    }
    note(
        f"rank {torch_rank}/{layout.world_size} node {me['node']} procid {layout.slurm_procid} "
        f"local {layout.local_rank} device {torch_device} shard {list(layout.shard_group)} "
        f"replicate {list(layout.replicate_group)}{_tp_note(layout)} pid {os.getpid()} (kill -QUIT {os.getpid()}: stacks)"
    )
    if device_note:
        note(device_note, tag=False)

    ctx: RunContext | None = None
    try:
        mesh = _join(layout, torch_device, rank=torch_rank, timeout_s=timeout_s)
        me["shard_group"] = _group_ranks(mesh, "shard")
        me["replicate_group"] = _group_ranks(mesh, "replicate")
        if layout.tp_size > 1:
            me["tp_group"] = _group_ranks(mesh, "tp")
        realized: list[dict] = [None] * layout.world_size  # type: ignore[list-item]
        dist.all_gather_object(realized, me)
        teardown = ExitStack()
        teardown.callback(_leave, saved)
        recorder = teardown.enter_context(comm_recorder(mesh, realized)) if comm_stats else None
        ctx = RunContext(
            replica=_replica_of(env),
            layout=layout,
            mesh=mesh,
            device=torch_device,
            run_dir=Path(run_dir) if run_dir is not None else None,
            realized=realized,
            spec=spec,
            comm_stats=recorder,
            preemption=preemption,
            teardown=teardown,
        )
        if verify:
            _verify_groups(layout, realized)
        if ctx.run_dir is not None and torch_rank == 0:
            write_layout(ctx)
            write_versions(ctx)
        return ctx
    except BaseException:
        if ctx is not None:
            ctx.shutdown()
        else:
            _leave(saved)
        raise


def _replica_of(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    if REPLICA_ID_ENV not in env:
        return None
    return int(env[REPLICA_ID_ENV]), int(env.get(REPLICA_GROUPS_ENV, "1")), int(env.get(ATTEMPT_ENV, "0"))


def _tp_note(layout: RankLayout) -> str:
    return f" tp {list(layout.tp_group)}" if layout.tp_size > 1 else ""


def _task_layout(
    env: Mapping[str, str], *, shard_size: int, device: str, topology: str = "auto", tp_size: int = 1
) -> RankLayout:
    """This task's place in the job, refused (HsdpError) where it cannot train."""
    if dist.is_initialized():
        raise HsdpError("a torch.distributed process group already exists; call hpc_hsdp.init once per process")
    if device not in DEVICES:
        raise HsdpError(f"device {device!r} is unknown; choose {', '.join(DEVICES)}")
    _require_numpy()
    layout = RankLayout.for_task(env, shard_size=shard_size, device=device, topology=topology, tp_size=tp_size)
    if layout.launch_mode == "task-per-node":
        raise SlurmEnvError(
            f"this SLURM step runs one task per node ({layout.node}) but {layout.local_world_size} GPUs per node: "
            f"`hpc-hsdp run` must run once per GPU; use the torchrun launcher (hpc-hsdp render/submit "
            f"--launcher torchrun) or srun --ntasks-per-node {layout.local_world_size}"
        )
    return layout


def _torch_env(
    env: Mapping[str, str], layout: RankLayout, torch_device: torch.device, run_dir: str | os.PathLike | None = None
) -> dict[str, str]:
    """RANK, WORLD_SIZE, ... for torch (and the NCCL flight recorder's size and dump file on CUDA)."""
    torch_env = layout.torch_env()
    if torch_device.type == "cuda":
        torch_env.update(flight_recorder_env(env, run_dir))
        if run_dir is not None:  # torch writes its timeout dump there, it does not make the directory
            (Path(run_dir) / HANG_DIR).mkdir(parents=True, exist_ok=True)
    if env.get(FAULT_RANK_FROM_PROCID) == "1" and layout.slurm_procid is not None:
        torch_env["RANK"] = str(layout.slurm_procid)
    return torch_env


def _join(layout: RankLayout, torch_device: torch.device, *, rank: int, timeout_s: int) -> DeviceMesh:
    """The process group (NCCL on CUDA, gloo on CPU) and the ``("replicate", "shard")`` mesh."""
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    timeout = timedelta(seconds=timeout_s)
    if layout.launch_mode == "torchrun":
        init_method, store = "env://", None  # torchrun's agent already serves the store at MASTER_ADDR:PORT
    else:
        init_method, store = None, rendezvous_store(layout, rank=rank, timeout=timeout)
    dist.init_process_group(
        backend="nccl" if torch_device.type == "cuda" else "gloo",
        init_method=init_method,
        rank=rank,
        world_size=layout.world_size,
        timeout=timeout,
        store=store,
        device_id=torch_device if torch_device.type == "cuda" else None,
    )
    return init_device_mesh(torch_device.type, layout.plan.mesh_shape, mesh_dim_names=layout.plan.mesh_axis_names)


def rendezvous_store(layout: RankLayout, *, rank: int, timeout: timedelta) -> dist.TCPStore:
    """The job's TCP store at ``MASTER_ADDR:MASTER_PORT``. Rank 0 serves it on that address
    only, not on every interface as torch's ``env://`` does (torch binds all of them unless it
    is handed a listening socket); where the address is not one of this node's (a name or a
    virtual address set on purpose), it serves on every interface as before."""
    listen_fd = _listen_on(layout.master_addr, layout.master_port) if rank == 0 else None
    return dist.TCPStore(
        layout.master_addr,
        layout.master_port,
        layout.world_size,
        rank == 0,
        timeout,
        multi_tenant=True,
        master_listen_fd=listen_fd,
    )


def _listen_on(address: str, port: int) -> int | None:
    """A socket listening on ``address:port`` (its file descriptor, handed over to the store),
    or None when ``address`` is not this node's. A port in use raises, as torch's bind would."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    except OSError:
        return None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRNOTAVAIL:
            return None
        raise
    return sock.detach()


def _verify_groups(layout: RankLayout, realized: list[dict]) -> None:
    """GroupMismatchError (on every rank: all see the same ``realized``) when torch's groups differ from the plan."""
    problems = compare_groups(
        layout.plan,
        [d["node"] for d in realized],
        [d["shard_group"] for d in realized],
        [d["replicate_group"] for d in realized],
        [d["tp_group"] for d in realized] if layout.tp_size > 1 else None,
    )
    if problems:
        raise GroupMismatchError(mismatch_message(problems, layout.plan))


def write_layout(ctx: RunContext) -> Path:
    """``<run_dir>/layout.json``: the plan and, per rank, where it ran and its realized groups."""
    assert ctx.run_dir is not None
    record = {
        "plan": ctx.plan.to_dict(),
        "launch_mode": ctx.layout.launch_mode,
        "job_id": ctx.layout.job_id,
        "master_addr": ctx.layout.master_addr,
        "master_port": ctx.layout.master_port,
        "backend": dist.get_backend(),
        "ranks": [{k: d[k] for k in RANK_FIELDS if k in d and (k != "node_switch" or d[k])} for d in ctx.realized],
    }
    return layout_file(ctx.run_dir, record)


def task_versions(run_dir: Path | None = None) -> dict:
    """What only a task knows of what runs it: torch, CUDA, cuDNN and NCCL versions, Python, and
    where hpc-hsdp was imported from (``code/`` of the run directory with ``--snapshot-code``)."""
    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            found = torch.cuda.nccl.version()
            nccl = ".".join(map(str, found)) if isinstance(found, tuple) else str(found)
        except (RuntimeError, AttributeError):
            nccl = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    package = Path(__file__).resolve().parents[2]  # the hpc_hsdp package this task imported
    record = {
        "written_at": time.time(),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart": os.environ.get("SLURM_RESTART_COUNT", "0"),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn is not None else None,
        "nccl": nccl,
        "hpc_hsdp_from": str(package),
    }
    if run_dir is not None:  # the checked private copy of code/ the batch script put first on PYTHONPATH
        verified = os.environ.get(SNAPSHOT_VARIABLE)
        record["snapshot_used"] = bool(verified and package.parent == Path(verified).resolve())
    return record


def write_versions(ctx: RunContext) -> None:
    """``task_provenance.json`` of this attempt (rank 0); a failed write is said, not fatal."""
    assert ctx.run_dir is not None
    try:
        write_task_provenance(ctx.run_dir, task_versions(ctx.run_dir))
    except OSError as exc:
        note(f"task_provenance.json not written: {exc}")
