"""Job specifications: frozen, keyword-only dataclasses, checked on construction.

The same spec feeds ``render`` (the sbatch text), ``submit`` and, on each task,
``hpc-hsdp run``; nothing downstream re-validates or re-defaults a value.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
from dataclasses import dataclass, field, fields
from math import gcd as _gcd

from hpc_hsdp.errors import SpecError, TopologyError
from hpc_hsdp.job.options import (
    DEVICES,
    LAUNCHERS,
    NO_TRACKER,
    RUN_ARGUMENTS,
    TRACKERS,
    TRAINING_OPTIONS,
    JobOption,
    default,
    option,
)
from hpc_hsdp.plan.mixture import Mixture, is_mixture, parse_mixture
from hpc_hsdp.plan.replicas import replica_shape
from hpc_hsdp.plan.slurm_facts import (
    DEFAULT_SIGNAL,  # noqa: F401  (render.warning_signal_name imports it from here)
    DISTRIBUTIONS,
    check_signal,
    check_text,
    check_time,
    signal_lead_seconds,
    time_limit_seconds,
)
from hpc_hsdp.plan.topology import TopologyPlan, check_sizes, format_tasks_per_node, plan_for

_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


def check_entry(entry: str | None) -> None:
    if entry is not None and not _ENTRY.match(entry):
        raise SpecError(f"--entry {entry!r} is not module:function; write e.g. 'mypkg.train:main'")


MODEL_FORMS = "builtin, hf:PATH (a local transformers directory or config.json) or MODULE:FUNCTION (your factory)"


def check_model(model: str) -> str:
    """``--model``: ``builtin``, ``hf:PATH`` or ``MODULE:FUNCTION``; returns it unchanged.
    Only the form is checked here (no file is read: a script may be rendered where the
    model's files are not); ``submit`` looks for them (:mod:`hpc_hsdp.job.preflight`)."""
    check_text("--model", model)
    if model == "builtin":
        return model
    if model.startswith("hf:"):
        if not model[3:].strip():
            raise SpecError("--model hf: needs a path: hf:/path/to/model-dir or hf:/path/to/config.json")
        return model
    if _ENTRY.match(model):
        return model
    raise SpecError(f"--model {model!r} is not one of {MODEL_FORMS}; e.g. --model hf:/models/llama-1b")


def model_with_absolute_path(model: str, base_dir: str | os.PathLike) -> str:
    """``hf:relative/dir`` -> ``hf:/base/relative/dir`` (the job may start elsewhere); other forms unchanged."""
    if not model.startswith("hf:"):
        return model
    path = os.path.expanduser(model[3:])
    return "hf:" + os.path.normpath(os.path.join(base_dir, path))


def _flag(option: str, value: object) -> None:
    if not isinstance(value, bool):
        raise SpecError(f"{option} {value!r} must be true or false")


TORCHFT_PIN = "torchft==0.2.0"


def require_torchft() -> None:
    """``--fault-tolerance replica`` needs torchft where the job is made and where it runs:
    SpecError (one line, exit 2) without it; asks the import system only (nothing is imported)."""
    import importlib.util  # noqa: PLC0415 - only with --fault-tolerance replica

    try:
        found = importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise SpecError(
            f"--fault-tolerance replica needs torchft, which is not installed: pip install 'hpc-hsdp[ft]' "
            f"({TORCHFT_PIN}), or --fault-tolerance none"
        )


def _training_field(key: str):
    """A TrainingSpec field: its default from the option's declaration in :mod:`hpc_hsdp.job.options`,
    which the field's metadata carries (``metadata["option"]``) for the checks."""
    declared = option(key)
    return field(default=declared.default, metadata={"option": declared})


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """The training loop's options (``hpc-hsdp run``, ``render``, ``submit``, config files).

    Each field is one option, declared once in :mod:`hpc_hsdp.job.options`: ``--seq-len`` on
    the command line, ``seq_len`` (or ``seq-len``) in a config file, the same keyword in the
    Python API.
    """

    # ------------------------------------------------------------------ the model
    model: str = _training_field("model")
    shard_unit: str | None = _training_field("shard_unit")
    layers: int = _training_field("layers")
    width: int = _training_field("width")
    heads: int = _training_field("heads")
    vocab_size: int = _training_field("vocab_size")
    # ------------------------------------------------------------------ the data
    data: str | None = _training_field("data")
    val_data: str | None = _training_field("val_data")
    seq_len: int = _training_field("seq_len")
    batch_size: int = _training_field("batch_size")
    global_batch_size: int | None = _training_field("global_batch_size")
    grad_accum: int = _training_field("grad_accum")
    # ------------------------------------------------------------------ the optimisation
    steps: int = _training_field("steps")
    seed: int = _training_field("seed")
    lr: float = _training_field("lr")
    weight_decay: float = _training_field("weight_decay")
    lr_schedule: str = _training_field("lr_schedule")
    warmup_steps: int = _training_field("warmup_steps")
    min_lr: float = _training_field("min_lr")
    clip_grad: float = _training_field("clip_grad")
    precision: str = _training_field("precision")
    activation_checkpointing: bool = _training_field("activation_checkpointing")
    compile: bool = _training_field("compile")
    reshard_after_forward: str = _training_field("reshard_after_forward")
    # ------------------------------------------------------------------ eval and checkpoints
    eval_every: int = _training_field("eval_every")
    eval_batches: int = _training_field("eval_batches")
    checkpoint_every: int = _training_field("checkpoint_every")
    keep_checkpoints: int = _training_field("keep_checkpoints")
    straggler_every: int = _training_field("straggler_every")
    tracker: str = _training_field("tracker")
    # ------------------------------------------------------------------ failures
    hang_timeout: float = _training_field("hang_timeout")
    fault_tolerance: str = _training_field("fault_tolerance")
    min_replicas: int = _training_field("min_replicas")
    quorum_timeout: float = _training_field("quorum_timeout")
    max_restarts: int = _training_field("max_restarts")

    def __post_init__(self) -> None:
        for f in fields(self):
            check_option_value(f.metadata["option"], getattr(self, f.name))
        check_model(self.model)
        if self.width % self.heads:
            raise SpecError(
                f"--width {self.width} is not divisible by --heads {self.heads}; pick a width that is a multiple of it"
            )
        if self.val_data is not None and self.data is None:
            raise SpecError("--val-data without --data: give the training data too (--data PATH)")
        object.__setattr__(self, "tracker", ",".join(tracker_names(self.tracker)) or NO_TRACKER)
        if self.val_data is not None and is_mixture(self.data):
            raise SpecError(
                "--val-data with a --data mixture: each source is evaluated on its own val split "
                "(eval_loss/NAME); leave --val-data out"
            )
        if self.fault_tolerance == "replica":
            if is_mixture(self.data):
                raise SpecError(
                    "--fault-tolerance replica with a --data mixture: the replica groups' share of a step "
                    "follows one dataset's order only; give one dataset, or leave --fault-tolerance out"
                )
            require_torchft()

    @property
    def trackers(self) -> tuple[str, ...]:
        """``--tracker`` as names, in the order given (empty for ``none``)."""
        return tracker_names(self.tracker)

    @property
    def mixture(self) -> Mixture | None:
        """``--data``'s mixture, parsed (None: one dataset, or synthetic tokens)."""
        return parse_mixture(self.data) if is_mixture(self.data) else None

    def to_args(self) -> list[str]:
        """The options that reproduce this spec on ``hpc-hsdp run``; defaults are left out."""
        return [arg for declared in TRAINING_OPTIONS for arg in run_arguments(declared, getattr(self, declared.key))]

    def rank_batch_size(self, world_size: int) -> int:
        """Samples per rank per micro-batch: ``--batch-size``, or ``--global-batch-size`` split
        over ``world_size`` ranks and ``--grad-accum`` micro-batches."""
        if self.global_batch_size is None:
            return self.batch_size
        per_step = world_size * self.grad_accum
        if self.global_batch_size % per_step:
            raise SpecError(
                f"--global-batch-size {self.global_batch_size} is not divisible by {world_size} ranks x "
                f"--grad-accum {self.grad_accum} = {per_step}; pick a multiple of {per_step}"
            )
        return self.global_batch_size // per_step

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step over all ranks."""
        return self.rank_batch_size(world_size) * world_size * self.grad_accum


def tracker_names(value: str) -> tuple[str, ...]:
    """``--tracker tensorboard,wandb`` -> ``("tensorboard", "wandb")``; ``none`` -> ``()``."""
    names = tuple(name.strip().lower() for name in value.split(","))
    if names == (NO_TRACKER,):
        return ()
    choose = f"choose from {', '.join(TRACKERS)} (comma-separated), or {NO_TRACKER}"
    for name in names:
        if name not in TRACKERS:
            raise SpecError(f"--tracker {value!r}: {name!r} is no tracker; {choose}")
    if len(set(names)) != len(names):
        raise SpecError(f"--tracker {value!r} names a tracker twice; {choose}")
    return names


def run_arguments(declared: JobOption, value: object) -> list[str]:
    """The ``hpc-hsdp run`` arguments that give an option this value; none for its default."""
    if value == declared.default:
        return []
    if isinstance(value, bool):
        return [declared.flag if value else f"--no-{declared.flag[2:]}"]
    return [declared.flag, repr(value) if isinstance(value, float) else str(value)]


def check_option_value(declared: JobOption, value: object) -> None:
    """Check one value against its option's kind, bound and choices."""
    flag, kind = declared.flag, declared.kind
    if value is None and declared.default is None:
        return
    if kind == "bool":
        _flag(flag, value)
        return
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        raise SpecError(f"{flag} {value!r} must be an integer")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value):
        raise SpecError(f"{flag} {value!r} must be a number, e.g. {declared.default!r}")
    if kind in ("str", "path", "data"):
        check_text(flag, value)
    if kind == "data" and is_mixture(value):
        parse_mixture(value, flag=flag)
    if declared.choices and value not in declared.choices:
        raise SpecError(f"{flag} {value!r} is unknown; choose {', '.join(declared.choices)}")
    if declared.minimum is not None and value < declared.minimum:
        raise SpecError(f"{flag} {value} must be at least {declared.minimum}")
    if declared.positive and not value > 0:
        raise SpecError(f"{flag} {value!r} must be a positive number, e.g. {declared.default!r}")


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What ``hpc-hsdp run`` needs on each task besides its SLURM environment."""

    shard_size: int
    """S: the inner ("shard") mesh axis."""
    run_dir: str
    """Directory of the run: layout.json, metrics.jsonl, checkpoints/, logs."""
    device: str = default("device")
    """``auto`` (the layout's GPU when CUDA is usable, else CPU), ``cpu`` or ``cuda``."""
    entry: str | None = default("entry")
    """``module:function`` called with the run context on every rank; None: the built-in payload."""
    training: TrainingSpec = TrainingSpec()
    """Options of the built-in payload."""
    timeout_s: int = default("timeout")
    """Process-group timeout for collectives, in seconds."""
    comm_stats: bool = default("comm_stats")
    """Record every rank's collectives per step (kind, mesh axis, tensor and wire bytes,
    intra-/inter-node); rank 0 adds the totals to metrics.jsonl as ``comm``."""

    def __post_init__(self) -> None:
        check_option_value(option("comm_stats"), self.comm_stats)
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise SpecError(f"--shard {self.shard_size!r} must be a positive integer such as 4")
        if self.device not in DEVICES:
            raise SpecError(f"--device {self.device!r} is unknown; choose auto, cpu or cuda")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int) or self.timeout_s < 1:
            raise SpecError(f"--timeout {self.timeout_s!r} must be a positive number of seconds")
        check_entry(self.entry)
        if self.device == "cpu" and self.training.precision == "fp8":
            raise SpecError(
                "--precision fp8 with --device cpu: Float8 training needs GPUs of compute capability >= 8.9; "
                "use --precision bf16 or fp32 on CPU"
            )

    def to_args(self) -> list[str]:
        """Arguments of ``hpc-hsdp run`` that reproduce this spec."""
        own = [arg for key in RUN_ARGUMENTS for arg in run_arguments(option(key), getattr(self, option(key).attribute))]
        return own + self.training.to_args()


# ----------------------------------------------------------------------------- the job (render, submit)

_MEM = re.compile(r"^[0-9]+[KMGT]?$", re.IGNORECASE)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")

# #SBATCH options the job spec writes itself -> the hpc-hsdp option that sets them.
OWNED_SBATCH_KEYS: dict[str, str] = {
    "job-name": "--job-name",
    "nodes": "--nodes",
    "ntasks": "--ntasks",
    "ntasks-per-node": "--gpus-per-node (one task per GPU) or --ntasks",
    "gpus-per-node": "--gpus-per-node",
    "gpus": "--gpus-per-node",
    "gres": "--gpus-per-node",
    "gpus-per-task": "--gpus-per-node (every task sees its node's GPUs; the layout picks one)",
    "cpus-per-task": "--cpus-per-task",
    "mem": "--mem",
    "time": "--time",
    "partition": "--partition",
    "account": "--account",
    "qos": "--qos",
    "constraint": "--constraint",
    "exclusive": "--exclusive",
    "output": "--run-dir (logs go to <run-dir>/logs)",
    "error": "--run-dir (logs go to <run-dir>/logs)",
    "open-mode": "nothing: the script appends so requeued runs keep their logs",
    "signal": "--signal",
    "requeue": "--requeue/--no-requeue",
    "no-requeue": "--requeue/--no-requeue",
    "export": "--env KEY=VALUE or --pass-env NAME (the script keeps --export=ALL)",
    "distribution": "--distribution",
    "chdir": "--run-dir (every path in the script is absolute)",
}


def _optional_text(option: str, value: str | None) -> None:
    if value is not None:
        check_text(option, value)


def _positive_int(option: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{option} {value!r} must be a positive integer")


def _signal_with_lead(value: str, lead: int) -> str:
    return f"{value.partition('@')[0]}@{max(lead, 1)}"


def check_sbatch_key(key: str) -> str:
    """A ``--sbatch`` passthrough key: a long sbatch option this spec does not write itself."""
    check_text("--sbatch", key)
    if not _SBATCH_KEY.match(key):
        raise SpecError(
            f"--sbatch key {key!r} is not a long sbatch option name; write KEY=VALUE with KEY like 'mail-type' "
            f"(lowercase letters, digits, '-', no leading dashes)"
        )
    if key in OWNED_SBATCH_KEYS:
        raise SpecError(f"--sbatch {key}=... is written by hpc-hsdp itself; use {OWNED_SBATCH_KEYS[key]} instead")
    return key


def check_env_name(option: str, name: str) -> str:
    check_text(option, name)
    if not _IDENTIFIER.match(name):
        raise SpecError(
            f"{option} name {name!r} is not a shell variable name; use letters, digits and '_' (e.g. MY_VAR)"
        )
    return name


def _pairs(value: object) -> tuple[tuple[str, object], ...]:
    items = value.items() if isinstance(value, dict) else value
    merged = dict(items)  # a later pair wins
    return tuple(sorted(merged.items()))


@dataclass(frozen=True, kw_only=True)
class SchedulerSpec:
    """The #SBATCH header besides the topology: what SLURM allocates and how it treats the job."""

    job_name: str = default("job_name")
    """``#SBATCH --job-name``."""
    partition: str | None = None
    """``#SBATCH --partition``; None: the cluster's default partition."""
    account: str | None = None
    """``#SBATCH --account``; None: the user's default account."""
    qos: str | None = None
    """``#SBATCH --qos``."""
    time: str | None = None
    """Time limit in a SLURM form (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS); None: the partition's."""
    constraint: str | None = None
    """``#SBATCH --constraint``: node features, e.g. ``h100&ib``."""
    exclusive: bool = default("exclusive")
    """``#SBATCH --exclusive``: no other job shares the nodes. The default, as a site's
    multi-GPU jobs are run: the job gets every CPU and (with ``mem`` None) all memory of
    its nodes, shared equally by the ranks."""
    mem: str | None = None
    """Memory per node (``512G``; ``0`` is all of it); None: ``0`` with ``exclusive``, else
    the partition's default."""
    cpus_per_task: int | None = None
    """CPUs per task; also passed to srun (Slurm 22.05 srun no longer inherits it). None: an
    equal share of the node's CPUs, computed by the script from ``SLURM_CPUS_ON_NODE``
    (all the node's CPUs with ``exclusive``; without it SLURM allocates one per task)."""

    @property
    def mem_per_node(self) -> str | None:
        """What ``#SBATCH --mem`` says: ``mem``, or ``0`` (all of it) for an exclusive job."""
        if self.mem is not None:
            return self.mem
        return "0" if self.exclusive else None

    signal: str | None = default("signal")
    """``--signal`` value ``[R:|B:]SIG@SECONDS`` sent before the time limit; None: no signal."""
    requeue: bool = default("requeue")
    """``#SBATCH --requeue``: SLURM may requeue the job after preemption or node failure."""
    extra: tuple[tuple[str, str | None], ...] = ()
    """``--sbatch KEY=VALUE`` passthrough, sorted by key; a None value writes ``--KEY`` alone."""

    def __post_init__(self) -> None:
        check_text("--job-name", self.job_name)
        for flag, value in (
            ("--partition", self.partition),
            ("--account", self.account),
            ("--qos", self.qos),
            ("--constraint", self.constraint),
        ):
            _optional_text(flag, value)
        if self.time is not None:
            check_time(self.time)
        if self.mem is not None:
            check_text("--mem", self.mem)
            if not _MEM.match(self.mem):
                raise SpecError(
                    f"--mem {self.mem!r} is not a SLURM size; write a number with an optional K, M, G or T "
                    f"(e.g. 512G, or 0 for all)"
                )
        _positive_int("--cpus-per-task", self.cpus_per_task, optional=True)
        _flag("--exclusive", self.exclusive)
        _flag("--requeue", self.requeue)
        if self.signal is not None:
            check_signal(self.signal)
            if self.time is not None:
                lead, limit = signal_lead_seconds(self.signal), time_limit_seconds(self.time)
                if lead >= limit:
                    raise SpecError(
                        f"--signal {self.signal} comes {lead} s before the time limit, but --time {self.time} is only "
                        f"{limit} s: give a lead shorter than the limit "
                        f"(e.g. --signal {_signal_with_lead(self.signal, limit // 4)}) "
                        f"or a longer --time"
                    )
        extra = _pairs(self.extra)
        for key, value in extra:
            check_sbatch_key(key)
            if value is not None:
                check_text(f"--sbatch {key}=", value, allow_empty=True)
        object.__setattr__(self, "extra", extra)


@dataclass(frozen=True, kw_only=True)
class EnvironmentSpec:
    """The setup section of the script: what runs before the rendezvous and launch."""

    setup: tuple[str, ...] = ()
    """Raw shell lines (``module load cuda/12.4``), run first, in order; the one unquoted input."""
    venv: str | None = None
    """Absolute path of a virtualenv to activate (``source VENV/bin/activate``); None: none."""
    conda_env: str | None = None
    """Conda environment (name or prefix) to activate; excludes ``venv``."""
    env: tuple[tuple[str, str], ...] = ()
    """Variables exported with these values (quoted), sorted by name; after the NCCL/torch defaults, so they win."""
    pass_env: tuple[str, ...] = ()
    """Variables taken by name from the environment that runs sbatch; their values are never written."""
    debug: bool = default("debug")
    """Export NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL and friends."""
    python: str = default("python")
    """Interpreter name (or path) the script calls for ``-m hpc_hsdp``."""

    def __post_init__(self) -> None:
        setup = tuple(self.setup)
        for line in setup:
            check_text("--setup", line)
        object.__setattr__(self, "setup", setup)
        if self.venv is not None:
            check_text("--venv", self.venv)
            if not self.venv.startswith("/"):
                raise SpecError(
                    f"--venv {self.venv!r} is not an absolute path; the job may start elsewhere, give /path/to/venv"
                )
        _optional_text("--conda-env", self.conda_env)
        if self.venv is not None and self.conda_env is not None:
            raise SpecError(
                f"--venv {self.venv!r} and --conda-env {self.conda_env!r} both given; activate one "
                f"(--venv none turns the venv off)"
            )
        env = _pairs(self.env)
        for name, value in env:
            check_env_name("--env", name)
            if not isinstance(value, str):
                raise SpecError(f"--env {name}={value!r}: the value must be a string")
            check_text(f"--env {name}=", value, allow_empty=True)
        object.__setattr__(self, "env", env)
        pass_env = tuple(sorted(set(self.pass_env)))
        for name in pass_env:
            check_env_name("--pass-env", name)
            if name in dict(env):
                raise SpecError(f"{name} is given both by --env (a value) and --pass-env (by name); keep one")
        object.__setattr__(self, "pass_env", pass_env)
        check_text("--python", self.python)
        _flag("--debug", self.debug)


TORCHRUN_SIGNALS_VAR = "PET_SIGNALS_TO_HANDLE"
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP"
"""What torchrun's agent handles (``--signals-to-handle``, read from ``PET_SIGNALS_TO_HANDLE``;
torch >= 2.9). Its default adds SIGQUIT, with which ``scancel --signal=QUIT`` would end the
job instead of printing stacks; older agents ignore the variable and still do."""


@dataclass(frozen=True, kw_only=True)
class LaunchSpec:
    """How the job step starts the ranks."""

    launcher: str = default("launcher")
    """``srun``: one task per GPU; ``torchrun``: one task per node running torchrun with a static rendezvous."""
    distribution: str = default("distribution")
    """srun ``--distribution``; ``cyclic`` scrambles SLURM_PROCID, which the node-major layout ignores."""
    container_image: str | None = None
    """Pyxis ``--container-image`` for srun; None: no container."""
    container_mounts: str | None = None
    """Pyxis ``--container-mounts`` for srun (``/src:/dst,...``)."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise SpecError(f"--launcher {self.launcher!r} is unknown; choose srun or torchrun")
        if self.distribution not in DISTRIBUTIONS:
            raise SpecError(f"--distribution {self.distribution!r} is unknown; choose block or cyclic")
        _optional_text("--container-image", self.container_image)
        _optional_text("--container-mounts", self.container_mounts)
        if self.container_mounts is not None and self.container_image is None:
            raise SpecError(
                "--container-mounts without --container-image; add the image (pyxis mounts into a container)"
            )


def check_container_mounts(mounts: str | None, run_dir: str) -> None:
    """The run directory must appear inside the image at its own path: the tasks write the
    checkpoints and logs there and the batch shell (on the host) reads the requeue request."""
    same_path = []
    for item in (mounts or "").split(","):
        parts = item.strip().split(":")
        if len(parts) >= 2 and parts[0] and parts[0] == parts[1]:
            same_path.append(posixpath.normpath(parts[0]))
    run = posixpath.normpath(run_dir)
    if not any(run == m or run.startswith(m.rstrip("/") + "/") for m in same_path):
        raise SpecError(
            f"--run-dir {run_dir!r} is not mounted into the container at the same path; add it, e.g. "
            f"--container-mounts {run}:{run}"
        )


def likely_tasks_per_node(*, nodes: int, gpus_per_node: int, ntasks: int) -> tuple[int, ...]:
    """The allocation ``--ntasks`` most likely gets on ``nodes`` nodes of ``gpus_per_node``
    GPUs: earlier nodes filled first, every node at least one task (e.g. 12 on 2 x 8: 8,4)."""
    counts = [gpus_per_node] * nodes
    excess = gpus_per_node * nodes - ntasks
    for i in reversed(range(nodes)):
        take = min(excess, counts[i] - 1)
        counts[i] -= take
        excess -= take
    return tuple(counts)


def parse_nodes(value: object, *, option: str = "--nodes") -> tuple[int, int]:
    """``--nodes``: ``2`` or ``"2"`` -> (2, 2); a flexible allocation ``"1-2"`` -> (1, 2)
    (sbatch's ``--nodes=MIN-MAX``: SLURM grants between MIN and MAX nodes)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    text = value.strip() if isinstance(value, str) else ""
    match = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", text)
    if not match:
        raise SpecError(
            f"{option} {value!r} is not a node count; write N (e.g. 2) or MIN-MAX (e.g. 1-2: SLURM grants "
            f"between 1 and 2 nodes)"
        )
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) is not None else low
    if low > high:
        raise SpecError(
            f"{option} {text!r}: the fewest nodes ({low}) is more than the most ({high}); write {high}-{low}"
        )
    return low, high


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A whole job: topology, what runs on each task, the #SBATCH header, setup and launcher.

    ``render_sbatch(spec)`` is a pure function of it; ``submit`` sends that very text.
    """

    nodes: int = default("nodes")
    """Nodes in the job; with ``min_nodes``, the most SLURM may grant."""
    min_nodes: int | None = None
    """The fewest nodes of a flexible allocation (``--nodes MIN-MAX``, sbatch ``--nodes=MIN-MAX``);
    None: exactly ``nodes``. The mesh follows the nodes granted; the global batch stays the
    same at every count (``--global-batch-size``, derived from ``--batch-size`` at ``nodes``
    when not given), so the sample stream does not depend on what SLURM grants."""
    gpus_per_node: int = default("gpus_per_node")
    """GPUs per node (``#SBATCH --gpus-per-node``); one task (srun) or one torchrun worker each."""
    ntasks: int | None = None
    """Total tasks for an uneven allocation (``#SBATCH --ntasks``, e.g. 12 on 2 nodes: 8,4); None: nodes x GPUs."""
    run: RunSpec
    """What ``hpc-hsdp run`` does on each task; its ``run_dir`` must be absolute, logs go to ``run_dir/logs``."""
    scheduler: SchedulerSpec = SchedulerSpec()
    """The rest of the #SBATCH header."""
    environment: EnvironmentSpec = EnvironmentSpec()
    """Setup lines, activation, exported and passed variables."""
    launch: LaunchSpec = LaunchSpec()
    """srun or torchrun, distribution, container."""
    template: str | None = None
    """Absolute path of a user's Jinja2 template; None: the packaged ``job.sbatch.j2``."""
    spare_nodes: int = default("spare_nodes")
    """With ``--fault-tolerance replica``: nodes allocated beyond ``nodes`` that wait for a lost
    replica group to be started again on them."""

    def __post_init__(self) -> None:
        _positive_int("--nodes", self.nodes)
        _positive_int("--gpus-per-node", self.gpus_per_node)
        _positive_int("--ntasks", self.ntasks, optional=True)
        check_sizes(
            nodes=self.nodes,
            tasks_per_node=self.gpus_per_node,
            world_size=min(self.ntasks or self.nodes * self.gpus_per_node, self.nodes * self.gpus_per_node),
        )
        if not isinstance(self.run, RunSpec):
            raise SpecError(f"JobSpec.run must be a RunSpec, got {type(self.run).__name__}")
        if self.min_nodes is not None:
            self._check_flexible()
        run_dir = check_text("--run-dir", self.run.run_dir)
        if not run_dir.startswith("/"):
            raise SpecError(
                f"--run-dir {run_dir!r} is not absolute; the job may start in another directory, give /path/to/run"
            )
        if "%" in run_dir or "\\" in run_dir:
            raise SpecError(
                f"--run-dir {run_dir!r} contains '%' or a backslash, which SLURM reads as a log-file pattern; "
                f"pick a path without them"
            )
        if self.launch.container_image is not None:
            check_container_mounts(self.launch.container_mounts, run_dir)
        if self.template is not None:
            check_text("--template", self.template)
            if not self.template.startswith("/"):
                raise SpecError(f"--template {self.template!r} is not an absolute path")
        if self.ntasks is not None:
            if self.launch.launcher == "torchrun":
                raise SpecError(
                    f"--ntasks {self.ntasks} with --launcher torchrun: torchrun starts the same number of workers on "
                    f"every node; use --launcher srun for an uneven allocation"
                )
            if not self.nodes <= self.ntasks <= self.nodes * self.gpus_per_node:
                raise SpecError(
                    f"--ntasks {self.ntasks} on --nodes {self.nodes} with --gpus-per-node {self.gpus_per_node}: "
                    f"give between {self.nodes} and {self.nodes * self.gpus_per_node} tasks "
                    f"(one per GPU, each node >= 1)"
                )
        try:
            self.plan  # noqa: B018  (raises TopologyError when nodes, tasks and shard size do not fit)
        except TopologyError as exc:
            if self.ntasks is None:
                raise
            raise TopologyError(
                f"--ntasks {self.ntasks} on {self.nodes} nodes of {self.gpus_per_node} GPUs most likely gives "
                f"{format_tasks_per_node(self.tasks_per_node)} tasks per node: {exc}"
            ) from None
        self._check_fault_tolerance()

    def _check_fault_tolerance(self) -> None:
        check_option_value(option("spare_nodes"), self.spare_nodes)
        training = self.run.training
        if training.fault_tolerance != "replica":
            if self.spare_nodes:
                raise SpecError(
                    f"--spare-nodes {self.spare_nodes} needs --fault-tolerance replica: without it a lost node "
                    f"requeues the whole job and spares would only wait"
                )
            return
        for given, why in (
            (self.flexible, f"--nodes {self.nodes_text} (a flexible allocation)"),
            (self.ntasks is not None, f"--ntasks {self.ntasks} (an uneven allocation)"),
            (self.launch.launcher != "srun", f"--launcher {self.launch.launcher}"),
            (self.run.entry is not None, f"--entry {self.run.entry} (the built-in loop runs the replica steps)"),
            (self.launch.container_image is not None, "--container-image"),
        ):
            if given:
                raise SpecError(f"--fault-tolerance replica does not work with {why} yet; leave it out")
        self.replicas  # noqa: B018  (raises where the job does not split into whole-node replica groups)

    @property
    def replicas(self):
        """The replica groups, spares and lighthouse (``--fault-tolerance replica``), else None."""
        if self.run.training.fault_tolerance != "replica":
            return None
        return replica_shape(
            plan_for(nodes=self.nodes, gpus_per_node=self.gpus_per_node, shard_size=self.run.shard_size),
            min_replicas=self.run.training.min_replicas,
            spare_nodes=self.spare_nodes,
        )

    def _check_flexible(self) -> None:
        _positive_int("--nodes MIN", self.min_nodes)
        if self.min_nodes > self.nodes:
            raise SpecError(
                f"--nodes {self.min_nodes}-{self.nodes}: the fewest nodes is more than the most; "
                f"write {self.nodes}-{self.min_nodes}"
            )
        if self.min_nodes == self.nodes:
            object.__setattr__(self, "min_nodes", None)
            return
        if self.ntasks is not None:
            raise SpecError(
                f"--ntasks {self.ntasks} with --nodes {self.nodes_text}: an uneven allocation needs a fixed "
                f"node count; give --nodes N, or drop --ntasks"
            )
        try:
            self.plan_at(self.min_nodes)
        except TopologyError as exc:
            raise TopologyError(f"--nodes {self.nodes_text}: at {self.min_nodes} node(s): {exc}") from None
        training = self.run.training
        gpus = self.gpus_per_node
        given = training.global_batch_size is not None
        if not given:  # the stream must not depend on the nodes granted
            derived = training.batch_size * self.nodes * gpus * training.grad_accum
            training = dataclasses.replace(training, global_batch_size=derived)
            object.__setattr__(self, "run", dataclasses.replace(self.run, training=training))
        for count in (self.min_nodes, self.nodes):
            per_step = count * gpus * training.grad_accum
            if training.global_batch_size % per_step:
                low, high = self.min_nodes * gpus * training.grad_accum, self.nodes * gpus * training.grad_accum
                common = low * high // _gcd(low, high)
                what = (
                    ""
                    if given
                    else f" (--batch-size {training.batch_size} x {self.nodes * gpus} ranks at {self.nodes} "
                    f"nodes x --grad-accum {training.grad_accum})"
                )
                raise SpecError(
                    f"--nodes {self.nodes_text}: the global batch {training.global_batch_size}{what} "
                    f"does not split over "
                    f"{count * gpus} ranks x --grad-accum {training.grad_accum} at {count} node(s); give "
                    f"--global-batch-size a multiple of {common}, so every node count SLURM grants "
                    f"trains on the same samples"
                )

    @property
    def flexible(self) -> bool:
        """A flexible allocation: SLURM grants between ``min_nodes`` and ``nodes`` nodes."""
        return self.min_nodes is not None and self.min_nodes < self.nodes

    @property
    def nodes_text(self) -> str:
        """What ``#SBATCH --nodes`` says: ``2``, or ``1-2`` for a flexible allocation."""
        return f"{self.min_nodes}-{self.nodes}" if self.flexible else str(self.nodes)

    def plan_at(self, nodes: int):
        """The plan when SLURM grants ``nodes`` nodes (a flexible allocation's ends)."""
        return plan_for(nodes=nodes, gpus_per_node=self.gpus_per_node, shard_size=self.run.shard_size)

    @property
    def tasks_per_node(self) -> tuple[int, ...]:
        """Tasks (GPUs in use) per node; for ``ntasks``, the allocation SLURM most likely gives."""
        if self.ntasks is None:
            return (self.gpus_per_node,) * self.nodes
        return likely_tasks_per_node(nodes=self.nodes, gpus_per_node=self.gpus_per_node, ntasks=self.ntasks)

    @property
    def plan(self):
        """The TopologyPlan of the job: the same function ``hpc-hsdp plan`` and the on-node layout use."""
        if self.ntasks is None:
            return plan_for(nodes=self.nodes, gpus_per_node=self.gpus_per_node, shard_size=self.run.shard_size)
        return TopologyPlan(tasks_per_node=self.tasks_per_node, shard_size=self.run.shard_size)

    @property
    def world_size(self) -> int:
        return sum(self.tasks_per_node)

    @property
    def log_dir(self) -> str:
        """``<run_dir>/logs``: the #SBATCH and srun log files, and submitit's job folder."""
        return self.run.run_dir.rstrip("/") + "/logs"
