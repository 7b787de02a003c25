"""Job specifications: frozen, keyword-only dataclasses, checked on construction.

The same spec feeds ``render`` (the sbatch text), ``submit`` and, on each task,
``hpc-hsdp run``; nothing downstream re-validates or re-defaults a value.

Each spec class is a :func:`~hpc_hsdp.job.option_fields.section`: its job options are fields
written out here (type, default, docstring; the flag, config key, help and ``#SBATCH`` lines
as the field's ``metadata["option"]``), each checked against its declaration
(:func:`~hpc_hsdp.job.option_fields.check_option_value`), then the fields and checks of its
own that tie options together. :mod:`hpc_hsdp.job.options` lists the options from them.
"""

from __future__ import annotations

import dataclasses
import posixpath
import re
from collections.abc import Iterable, Mapping
from math import gcd as _gcd
from operator import attrgetter

from hpc_hsdp.errors import SpecError, TopologyError
from hpc_hsdp.job.option_fields import (
    CLUSTERS,
    DECLARED,
    DEVICES,  # noqa: F401  (hpc_hsdp.task.parallelism.dist imports it from here)
    ENVIRONMENT,
    LAUNCHERS,
    MODULE_FUNCTION,
    ON_EVERY_TASK,
    RENDER_SUBMIT,
    RUN_ARGUMENT,
    SBATCH_LINE,
    SCRIPT_LINE,
    SUBMIT_SIDE,
    SbatchKey,
    Shown,
    option_field,
    owned_sbatch_keys,
    run_arguments,
    section,
    section_options,
)
from hpc_hsdp.job.training_sections import (  # noqa: F401  (imported from here too)
    MODEL_FORMS,
    NO_STAGE,
    TORCHFT_PIN,
    TRAINING_SECTIONS,
    CheckpointSection,
    ComputeSection,
    DataSection,
    EvaluationSection,
    ModelSection,
    ObservationSection,
    OptimizerSection,
    ResilienceSection,
    TrainingSpec,
    check_model,
    model_with_absolute_path,
    require_torchft,
    tracker_names,
)
from hpc_hsdp.plan.replica_layout import replica_shape
from hpc_hsdp.plan.slurm_facts import (
    DEFAULT_SIGNAL,  # noqa: F401  (render.warning_signal_name imports it from here)
    DISTRIBUTIONS,
    check_segment,
    check_signal,
    check_switches,
    check_text,
    check_time,
    signal_lead_seconds,
    time_limit_seconds,
)
from hpc_hsdp.plan.switches import TOPOLOGY_MODES
from hpc_hsdp.plan.topology import TopologyPlan, check_sizes, format_tasks_per_node, plan_for

_LOGS_IN_RUN_DIR = "--run-dir (logs go to <run-dir>/logs)"


@section("run", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class RunSpec:
    """What ``hpc-hsdp run`` needs on each task besides its SLURM environment: the options that
    reach the tasks as its arguments (``shard_size`` is S, the inner "shard" mesh axis; ``run_dir``
    holds layout.json, metrics.jsonl, checkpoints/ and the logs) and the training options."""

    shard_size: int = option_field(
        key="shard",
        kind="int",
        positive=True,
        refusal="must be a positive integer such as 4",
        param="shard_size",
        commands=(*ON_EVERY_TASK, "plan"),
        help="Shard-group size S (required here or in the config): divides a node or is a multiple of it.",
        shown={
            "run": Shown(help="Shard-group size S (inner mesh axis).", default=1),
            "plan": Shown(
                help="Shard-group size S: ranks that shard one model copy. Divides a node, or is a multiple "
                "of it. Required unless --recommend."
            ),
        },
    )
    """S, the size of a shard group: the ranks that shard one model copy (the inner mesh axis)."""
    tp_size: int = option_field(
        default=1,
        key="tp",
        kind="int",
        positive=True,
        refusal="must be a positive integer such as 2",
        param="tp_size",
        commands=(*ON_EVERY_TASK, "plan"),
        metavar="T",
        help="Tensor-parallel size T: each layer split over T consecutive ranks of one node (the innermost "
        'mesh axis, "tp"); divides the GPUs per node and the model\'s heads, key/value heads, feed-forward '
        "width and vocabulary, and the built-in model's sequence length (checked before submitting; a "
        "--model MODULE:FUNCTION's own "
        "plan is checked on the tasks). The S x T consecutive ranks of one replica then hold one copy of the model; a shard group is S of them, T apart.",
        shown={
            "run": Shown(default=1),
            "plan": Shown(default=DECLARED),
        },
    )
    """T, the tensor-parallel size: ranks of one node that split each layer (the innermost mesh axis)."""
    run_dir: str = option_field(
        kind="path",
        metavar="DIR",
        sbatch=(  # %t is 0 for the batch step, as submitit writes it
            SbatchKey("output", lambda job: f"{job.log_dir}/%j_0_log.out", place=110, instead=_LOGS_IN_RUN_DIR),
            SbatchKey("error", lambda job: f"{job.log_dir}/%j_0_log.err", place=110, instead=_LOGS_IN_RUN_DIR),
            SbatchKey(
                "open-mode",
                lambda job: "append",
                place=110,
                instead="nothing: the script appends so requeued runs keep their logs",
            ),
            SbatchKey("chdir", None, instead="--run-dir (every path in the script is absolute)"),
        ),
        default_text="render: ./hpc-hsdp-runs/<job-name>; submit: a new ./hpc-hsdp-runs/<job-name>-<date-time>",
        help="Run directory (made absolute); logs in DIR/logs; an existing one resumes.",
        shown={
            "run": Shown(
                help="Run directory: layout.json, metrics.jsonl, checkpoints/.",
                default=DECLARED,
                metavar=None,
                required=True,
                directory=True,
            )
        },
    )
    """Absolute run directory: layout.json, metrics.jsonl, checkpoints/ and logs/."""
    device: str = option_field(
        default="auto",
        kind="str",
        choices=DEVICES,
        help="Device of each rank.",
        shown={"run": Shown(help="auto: this task's GPU when CUDA is usable, else CPU.", default=DECLARED)},
    )
    """Each rank's device: ``auto`` (its GPU when CUDA is usable, else CPU), ``cpu`` or ``cuda``."""
    entry: str | None = option_field(
        default=None,
        kind="str",
        pattern=MODULE_FUNCTION,
        refusal="is not module:function; write e.g. 'mypkg.train:main'",
        metavar="MODULE:FUNCTION",
        default_text="the built-in payload",
        help="Your training function, called on every rank.",
        shown={
            "run": Shown(
                help="module:function called with the run context on every rank instead of the built-in "
                "payload, e.g. mypkg.train:main.",
                default=DECLARED,
                metavar=None,
            )
        },
    )
    """The user's ``module:function`` called on every rank (None: the built-in loop)."""
    timeout_s: int = option_field(
        default=300,
        key="timeout",
        kind="int",
        positive=True,
        refusal="must be a positive number of seconds",
        maximum=7 * 24 * 3600,
        metavar="SECONDS",
        help="Process-group timeout.",
        shown={"run": Shown(help="Process-group timeout for collectives, in seconds.", default=DECLARED, metavar=None)},
    )
    """Seconds a collective may wait (the process group's timeout)."""
    comm_stats: bool = option_field(
        default=False,
        kind="bool",
        help="Record each step's collectives (bytes per mesh axis, intra-/inter-node) in metrics.jsonl.",
        shown={
            "run": Shown(
                help="Record each step's collectives (bytes per mesh axis, intra-/inter-node) in metrics.jsonl "
                "as 'comm'.",
                default=DECLARED,
            )
        },
    )
    """Record each step's collectives per mesh axis in metrics.jsonl."""
    topology: str = option_field(
        default="auto",
        kind="str",
        choices=TOPOLOGY_MODES,
        commands=(*ON_EVERY_TASK, "plan"),
        help="auto: where SLURM gives the nodes' switches, order the nodes by them (a shard group spanning "
        "nodes under one leaf switch, replicate groups across switches); off: the node-list order; strict: "
        "as auto, and refuse a job whose shard groups must cross leaf switches.",
        shown={
            "run": Shown(default=DECLARED),
            "plan": Shown(
                help="As the job would run (auto, off, strict): with --node-switches, the node order and "
                "strict's refusal.",
                default=DECLARED,
            ),
        },
    )
    """How the nodes' switches order the mesh: ``auto``, ``off`` or ``strict``."""

    training: TrainingSpec = TrainingSpec()
    """Options of the built-in payload."""

    def __post_init__(self) -> None:
        if self.device == "cpu" and self.training.compute.precision == "fp8":
            raise SpecError(
                "--precision fp8 with --device cpu: Float8 training needs GPUs of compute capability >= 8.9; "
                "use --precision bf16 or fp32 on CPU"
            )

    def to_args(self) -> list[str]:
        """Arguments of ``hpc-hsdp run`` that reproduce this spec."""
        own = [
            arg
            for declared in section_options(RunSpec)
            for arg in run_arguments(declared, getattr(self, declared.attribute))
        ]
        return own + self.training.to_args()


# ----------------------------------------------------------------------------- the job (render, submit)

_MEM = r"^(0|[0-9]+[KMGT])$"
"""``--mem``: a number with its unit, or 0 (all of the node's memory). SLURM reads a bare number
as megabytes, which nobody means by ``--mem 512``: a unit is asked for, as ``--gpu-memory`` does."""
_IDENTIFIER = r"^[A-Za-z_][A-Za-z0-9_]*$"
_SBATCH_KEY = r"^[a-z][a-z0-9-]*$"


def _positive_int(option: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"{option} {value!r} must be a positive integer")


def _signal_with_lead(value: str, lead: int) -> str:
    return f"{value.partition('@')[0]}@{max(lead, 1)}"


def check_sbatch_key(key: str) -> str:
    """A ``--sbatch`` passthrough key: a long sbatch option this spec does not write itself
    (:func:`~hpc_hsdp.job.options.owned_sbatch_keys`), nor an abbreviation of one: sbatch, as
    getopt_long, takes any prefix that names one option alone (``out=`` is ``--output=``,
    ``no-requeu`` is ``--no-requeue``), and a later line wins. No sbatch option is itself a
    prefix of one that the job writes, so every prefix of those is refused."""
    check_text("--sbatch", key)
    if not re.match(_SBATCH_KEY, key):
        raise SpecError(
            f"--sbatch key {key!r} is not a long sbatch option name; write KEY=VALUE with KEY like 'mail-type' "
            f"(lowercase letters, digits, '-', no leading dashes)"
        )
    owned = owned_sbatch_keys(option for each in SECTIONS for option in section_options(each))
    if key in owned:
        raise SpecError(f"--sbatch {key}=... is written by hpc-hsdp itself; use {owned[key]} instead")
    abbreviated = sorted(name for name in owned if name.startswith(key))
    if abbreviated:
        raise SpecError(
            f"--sbatch {key}=... abbreviates --{abbreviated[0]} (sbatch takes any unique prefix of an option), "
            f"which hpc-hsdp writes itself; use {owned[abbreviated[0]]} instead"
        )
    return key


def check_env_name(option: str, name: str) -> str:
    check_text(option, name)
    if not re.match(_IDENTIFIER, name):
        raise SpecError(
            f"{option} name {name!r} is not a shell variable name; use letters, digits and '_' (e.g. MY_VAR)"
        )
    return name


def _pairs(
    value: Mapping[str, str | None] | Iterable[tuple[str, str | None]],
) -> tuple[tuple[str, str | None], ...]:
    merged = dict(value)  # a later pair wins
    return tuple(sorted(merged.items()))


@section("scheduler", reaches=SBATCH_LINE)
class SchedulerSpec:
    """The #SBATCH header besides the topology: what SLURM allocates and how it treats the job.

    Its fields are the options that write #SBATCH lines (``JobOption.reaches``); None leaves a
    line out (the partition's default time limit, the user's default account, ...), ``signal``
    None sends no warning signal. ``extra`` is the ``--sbatch KEY=VALUE`` passthrough, sorted by
    key; a None value writes ``--KEY`` alone.
    """

    job_name: str = option_field(
        default="hpc-hsdp",
        kind="str",
        sbatch=(SbatchKey("job-name", place=10),),
        help="#SBATCH --job-name.",
    )
    """``#SBATCH --job-name``."""
    partition: str | None = option_field(
        default=None,
        kind="str",
        help="#SBATCH --partition.",
    )
    """``#SBATCH --partition`` (None: the cluster's default)."""
    account: str | None = option_field(
        default=None,
        kind="str",
        help="#SBATCH --account.",
    )
    """``#SBATCH --account`` (None: the user's default)."""
    qos: str | None = option_field(
        default=None,
        kind="str",
        help="#SBATCH --qos.",
    )
    """``#SBATCH --qos`` (None: the default)."""
    time: str | None = option_field(
        default=None,
        kind="str",
        param="time_limit",
        metavar="TIME",
        sbatch=(SbatchKey("time", place=70),),
        help="Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS.",
    )
    """``#SBATCH --time``, the job's time limit (None: the partition's)."""
    constraint: str | None = option_field(
        default=None,
        kind="str",
        help="#SBATCH --constraint (node features, e.g. 'h100&ib').",
    )
    """``#SBATCH --constraint``: node features the job needs."""
    switches: str | None = option_field(
        default=None,
        kind="str",
        metavar="N[@TIME]",
        help="#SBATCH --switches (topology/tree): the job's nodes under at most N leaf switches, SLURM waiting "
        "up to TIME for them (e.g. 1, or 1@30:00).",
    )
    """``#SBATCH --switches``: at most N leaf switches, waited for up to TIME (``N[@TIME]``)."""
    segment: int | None = option_field(
        default=None,
        kind="int",
        positive=True,
        refusal="is not a node count; give the nodes per block segment, e.g. --segment 2",
        metavar="N",
        help="#SBATCH --segment (topology/block): the job's nodes in segments of N, each segment within one block.",
    )
    """``#SBATCH --segment``: nodes per block segment (topology/block)."""
    exclusive: bool = option_field(
        default=True,
        kind="bool",
        sbatch=(SbatchKey("exclusive", place=90),),
        help="Whole nodes (#SBATCH --exclusive): every rank gets an equal share of its node's CPUs and memory.",
    )
    """``#SBATCH --exclusive``: whole nodes."""
    mem: str | None = option_field(
        default=None,
        kind="str",
        default_text="0 with --exclusive",
        sbatch=(SbatchKey("mem", attrgetter("scheduler.mem_per_node"), place=60),),
        help="Memory per node with its unit, e.g. 512G or 4000M (0: all of it); a bare number is refused.",
    )
    """``#SBATCH --mem``, memory per node (None: 0, all of it, with ``exclusive``)."""
    cpus_per_task: int | None = option_field(
        default=None,
        kind="int",
        positive=True,
        sbatch=(SbatchKey("cpus-per-task", place=50),),
        default_text="the node's CPUs / its tasks, at run time",
        help="CPUs per task (also passed to srun).",
    )
    """``#SBATCH --cpus-per-task`` (None: the node's CPUs over its tasks, at run time)."""
    signal: str = option_field(
        default=DEFAULT_SIGNAL,
        kind="str",
        off_word="none",
        metavar="SIG@SECONDS",
        commands=(*RENDER_SUBMIT, "plan"),
        sbatch=(SbatchKey("signal", place=120),),
        help="Signal sent before the time limit; 'none' for no signal.",
        shown={
            "plan": Shown(
                help="The job's warning signal (as for submit): the save on it must finish within SECONDS.",
                default=DECLARED,
            )
        },
    )
    """The warning signal before the time limit, ``SIG@SECONDS`` (None: none)."""
    requeue: bool = option_field(
        default=True,
        kind="bool",
        default_text="requeue",
        sbatch=(
            SbatchKey("requeue", place=130, instead="--requeue/--no-requeue"),
            SbatchKey("no-requeue", lambda job: not job.scheduler.requeue, place=130, instead="--requeue/--no-requeue"),
        ),
        help="Let SLURM requeue the job.",
    )
    """Whether SLURM may requeue the job (``--requeue`` or ``--no-requeue``)."""
    extra: tuple[tuple[str, str | None], ...] = option_field(
        default=(),
        key="sbatch",
        kind="table",
        param="sbatch_options",
        metavar="KEY=VALUE",
        sbatch=(),
        help="Extra '#SBATCH --KEY=VALUE' (KEY alone: a flag); repeatable.",
    )
    """The ``--sbatch KEY=VALUE`` passthrough, sorted by key (a None value writes ``--KEY`` alone)."""

    @property
    def mem_per_node(self) -> str | None:
        """What ``#SBATCH --mem`` says: ``mem``, or ``0`` (all of it) for an exclusive job."""
        if self.mem is not None:
            return self.mem
        return "0" if self.exclusive else None

    def __post_init__(self) -> None:
        if self.time is not None:
            check_time(self.time)
        if self.mem is not None and re.fullmatch(r"[0-9]+", self.mem) and int(self.mem) != 0:
            raise SpecError(
                f"--mem {self.mem!r} has no unit, and SLURM would read it as {self.mem} megabytes; write "
                f"{self.mem}G or {self.mem}M (or 0 for all of the node's memory)"
            )
        if self.mem is not None and not re.match(_MEM, self.mem, re.IGNORECASE):
            raise SpecError(
                f"--mem {self.mem!r} is not a SLURM size; write a number with its unit, K, M, G or T "
                f"(e.g. 512G, or 0 for all)"
            )
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
        if self.switches is not None:
            check_switches(self.switches)
        if self.segment is not None:
            check_segment(self.segment)
        extra = _pairs(self.extra)
        for key, value in extra:
            check_sbatch_key(key)
            if value is not None:
                check_text(f"--sbatch {key}=", value, allow_empty=True)
        object.__setattr__(self, "extra", extra)


@section("environment", reaches=SCRIPT_LINE)
class EnvironmentSpec:
    """The setup section of the script: what runs before the rendezvous and launch. ``setup``
    lines run first, in order (the one unquoted input); ``env`` is sorted by name and exported
    after the NCCL/torch defaults, so it wins; ``pass_env`` is sorted, its values are never
    written; ``venv`` is an absolute path (None: no activation)."""

    setup: tuple[str, ...] = option_field(
        default=(),
        kind="list",
        metavar="LINE",
        help="A raw shell line run before launch (module load ...); repeatable; not quoted.",
    )
    """Raw shell lines run before launch, in order (the one unquoted input)."""
    env: tuple[tuple[str, str | None], ...] = option_field(
        default=(),
        kind="table",
        param="env_vars",
        metavar="KEY=VALUE",
        reaches=ENVIRONMENT,
        sbatch=(
            SbatchKey(
                "export",
                lambda job: "ALL",
                place=140,
                instead="--env KEY=VALUE or --pass-env NAME (the script keeps --export=ALL)",
            ),
        ),
        help="Export a variable (value quoted); repeatable.",
    )
    """Variables exported to every task, sorted by name (after the NCCL/torch defaults, so they win)."""
    pass_env: tuple[str, ...] = option_field(
        default=(),
        kind="list",
        metavar="NAME",
        reaches=ENVIRONMENT,
        help="Pass a variable by name from the submitting environment (never written); repeatable.",
    )
    """Variables passed by name from the submitting environment, sorted (values never written)."""
    debug: bool = option_field(
        default=False,
        kind="bool",
        reaches=ENVIRONMENT,
        help="NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL, ...",
    )
    """Export NCCL and torch.distributed debugging variables."""
    venv: str | None = option_field(
        default=None,
        kind="path",
        metavar="PATH",
        default_text="the running interpreter's venv",
        help="Virtualenv to activate ('none': no activation).",
    )
    """Absolute path of the virtualenv to activate (None: no activation)."""
    conda_env: str | None = option_field(
        default=None,
        kind="str",
        metavar="NAME",
        help="Conda environment to activate instead of a venv.",
    )
    """Conda environment to activate instead of a venv."""
    python: str = option_field(
        default="python",
        kind="str",
        help="Interpreter name the script calls.",
    )
    """The interpreter the script calls."""
    snapshot_code: bool = option_field(
        default=False,
        kind="bool",
        help="Copy the code the job runs (hpc-hsdp and the --entry or --model module's package) into RUN_DIR/code at "
        "submit; every attempt, requeues included, runs that copy, whatever changes on disk afterwards.",
    )
    """Copy the job's code into RUN_DIR/code at submit; every attempt runs that copy."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "setup", tuple(self.setup))
        if self.venv is not None and not self.venv.startswith("/"):
            raise SpecError(
                f"--venv {self.venv!r} is not an absolute path; the job may start elsewhere, give /path/to/venv"
            )
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


TORCHRUN_SIGNALS_VAR = "PET_SIGNALS_TO_HANDLE"
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP"
"""What torchrun's agent handles (``--signals-to-handle``, read from ``PET_SIGNALS_TO_HANDLE``;
torch >= 2.9). Its default adds SIGQUIT, with which ``scancel --signal=QUIT`` would end the
job instead of printing stacks; older agents ignore the variable and still do."""


@section("launch", reaches=SCRIPT_LINE)
class LaunchSpec:
    """How the job step starts the ranks: srun or torchrun, srun's distribution (``cyclic``
    scrambles SLURM_PROCID, which the node-major layout ignores), pyxis's container (None: none)."""

    launcher: str = option_field(
        default="srun",
        kind="str",
        choices=LAUNCHERS,
        help="srun: one task per GPU; torchrun: one task per node, static rendezvous.",
    )
    """How the step starts the ranks: ``srun`` (one task per GPU) or ``torchrun`` (one per node)."""
    distribution: str = option_field(
        default="block",
        kind="str",
        choices=DISTRIBUTIONS,
        sbatch=(SbatchKey("distribution", None),),
        help="srun --distribution; the layout is node-major either way.",
    )
    """srun's ``--distribution`` (the layout is node-major either way)."""
    container_image: str | None = option_field(
        default=None,
        kind="str",
        help="Pyxis container image for srun.",
    )
    """Pyxis container image of the job step (None: no container)."""
    container_mounts: str | None = option_field(
        default=None,
        kind="str",
        help="Pyxis container mounts for srun (/src:/dst,...).",
    )
    """Pyxis container mounts, ``/src:/dst,...``."""
    check: bool = option_field(
        default=False,
        kind="bool",
        help="Measure every node and link before training (the job's first step, a few seconds): each GPU's "
        "matmul, host-to-device copy and free memory, the all-reduce inside each node and between pairs "
        "of nodes; a node below its peers is left out (a spare node, --spare-nodes, takes its place; "
        "without one the job is requeued once without it). check.json in the run directory.",
    )
    """Measure every node and link before training and leave out one below its peers."""
    check_threshold: float = option_field(
        default=0.7,
        kind="float",
        positive=True,
        maximum=0.99,
        refusal="must be a share of the median between 0 and 1, e.g. 0.7",
        reaches=ENVIRONMENT,
        metavar="SHARE",
        help="--check: a node or link below this share of its peers' median is named (and left out).",
    )
    """The share of its peers' median below which the check names a node or link."""

    def __post_init__(self) -> None:
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


@section("", reaches=SUBMIT_SIDE)
class JobSpec:
    """A whole job: topology, what runs on each task, the #SBATCH header, setup and launcher.

    ``render_sbatch(spec)`` is a pure function of it; ``submit`` sends that very text. Of its
    option fields, ``nodes`` is the most SLURM may grant (see ``min_nodes``), ``ntasks`` None
    means nodes x GPUs, ``template`` is an absolute path (None: the packaged ``job.sbatch.j2``).
    """

    cluster: str = option_field(
        default="auto",
        kind="str",
        commands=("submit",),
        choices=CLUSTERS,
        help="auto: SLURM where sbatch is installed and configured (a controller that does not answer refuses the "
        "job: exit 2), the local emulator only where SLURM is not.",
    )
    """Where ``submit`` sends the job: ``auto``, ``slurm`` or ``local`` (the emulator); a config key too."""
    sweep: tuple[str, ...] = option_field(
        default=(),
        kind="list",
        metavar="OPTION=V1,V2",
        help="Sweep a job option over these values (repeatable): one SLURM job array, each point a whole job "
        "in <run-dir>/<OPTION=V,...> (e.g. --sweep lr=3e-4,1e-3 --sweep seed=0,1: 4 points); render prints "
        "the job arrays' scripts. Options of the #SBATCH header (--sweep nodes=1,2, --time, --partition) can be "
        "swept too: one job array per distinct header.",
    )
    """``OPTION=V1,V2`` texts: the options a sweep varies and their values (empty: one job)."""
    sweep_mode: str = option_field(
        default="grid",
        kind="str",
        choices=("grid", "zip"),
        help="With --sweep: grid, every combination of the values; zip, the values paired in order.",
    )
    """How the swept values combine: ``grid`` (every combination) or ``zip`` (paired in order)."""
    array_parallelism: int | None = option_field(
        default=None,
        kind="int",
        positive=True,
        metavar="K",
        help="With --sweep: at most K points of each job array run at once (#SBATCH --array=0-N%K); a sweep "
        "whose points differ in their #SBATCH header is one array per header, so up to K per header run at once.",
        default_text="all",
    )
    """At most this many points of each job array at once (None: all)."""
    nodes: int = option_field(
        default=1,
        kind="nodes",
        positive=True,
        metavar="N|MIN-MAX",
        commands=(*RENDER_SUBMIT, "plan"),
        sbatch=(SbatchKey("nodes", attrgetter("requested_nodes"), place=20),),
        help="Nodes in the job; MIN-MAX (e.g. 1-2): a flexible allocation, the mesh follows the nodes "
        "SLURM grants and the global batch stays the same.",
        shown={
            "plan": Shown(
                help="Nodes in the job; MIN-MAX (e.g. 1-2): a flexible allocation, shown at both ends.",
                default_text="1, or as many as --nodelist names",
            )
        },
        reaches=SBATCH_LINE,
    )
    """The most nodes SLURM may grant (see ``min_nodes`` for a flexible allocation)."""
    gpus_per_node: int = option_field(
        default=8,
        kind="int",
        positive=True,
        commands=(*RENDER_SUBMIT, "plan"),
        sbatch=(
            SbatchKey(
                "ntasks-per-node",
                attrgetter("task_slots_per_node"),
                place=30,
                instead="--gpus-per-node (one task per GPU) or --ntasks",
            ),
            SbatchKey("gpus-per-node", place=40),
            SbatchKey("gpus", None),
            SbatchKey("gres", None),
            SbatchKey(
                "gpus-per-task", None, instead="--gpus-per-node (every task sees its node's GPUs; the layout picks one)"
            ),
        ),
        help="GPUs per node; one task (srun) or torchrun worker each.",
        shown={"plan": Shown(help="GPUs (one task each) per node.", default=DECLARED)},
        reaches=SBATCH_LINE,
    )
    """GPUs per node: one task (srun) or torchrun worker each."""
    ntasks: int | None = option_field(
        default=None,
        kind="int",
        positive=True,
        reaches=SCRIPT_LINE,
        sbatch=(SbatchKey("ntasks", None),),
        help="Total tasks for an uneven allocation (e.g. 12 on 2 nodes: 8,4); replaces --ntasks-per-node.",
    )
    """Total tasks of an uneven allocation (None: ``nodes`` x ``gpus_per_node``)."""
    template: str | None = option_field(
        default=None,
        kind="path",
        metavar="PATH",
        help="Your own Jinja2 template (gets the same variables; may extend job.sbatch.j2).",
    )
    """Absolute path of the user's Jinja2 template (None: the packaged ``job.sbatch.j2``)."""
    spare_nodes: int = option_field(
        default=0,
        kind="int",
        minimum=0,
        commands=(*RENDER_SUBMIT, "plan"),
        sbatch=(),
        help="Nodes allocated beyond --nodes that wait: with --fault-tolerance replica a lost replica group "
        "is started again on them and joins from a live peer; with --check one takes the place of a node "
        "the check finds below its peers.",
        shown={"plan": Shown(default=DECLARED)},
        reaches=SBATCH_LINE,
    )
    """Nodes allocated beyond ``nodes`` that wait to replace a lost or slow one."""

    min_nodes: int | None = None
    """The fewest nodes of a flexible allocation (``--nodes MIN-MAX``, sbatch ``--nodes=MIN-MAX``);
    None: exactly ``nodes``. The mesh follows the nodes granted; the global batch stays the
    same at every count (``--global-batch-size``, derived from ``--batch-size`` at ``nodes``
    when not given), so the sample stream does not depend on what SLURM grants."""
    run: RunSpec
    """What ``hpc-hsdp run`` does on each task; its ``run_dir`` must be absolute, logs go to ``run_dir/logs``."""
    scheduler: SchedulerSpec = SchedulerSpec()
    """The rest of the #SBATCH header."""
    environment: EnvironmentSpec = EnvironmentSpec()
    """Setup lines, activation, exported and passed variables."""
    launch: LaunchSpec = LaunchSpec()
    """srun or torchrun, distribution, container."""

    def __post_init__(self) -> None:
        check_sizes(
            nodes=self.nodes,
            tasks_per_node=self.gpus_per_node,
            world_size=min(self.ntasks or self.nodes * self.gpus_per_node, self.nodes * self.gpus_per_node),
        )
        if not isinstance(self.run, RunSpec):
            raise SpecError(f"JobSpec.run must be a RunSpec, got {type(self.run).__name__}")
        if self.min_nodes is not None:
            self._check_flexible(self.min_nodes)
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
        if self.template is not None and not self.template.startswith("/"):
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
        self._check_global_batch()

    def _check_global_batch(self) -> None:
        """The job's ``--global-batch-size`` splits over its data-parallel ranks and micro-batches,
        here rather than on every task after start-up (a flexible allocation checks both ends; a
        replica group's job splits it over the live groups at each step)."""
        training = self.run.training
        if (
            training.dataset.global_batch_size is None
            or self.flexible
            or training.resilience.fault_tolerance == "replica"
        ):
            return
        ranks = self.world_size // self.run.tp_size
        per_step = ranks * training.dataset.grad_accum
        if training.dataset.global_batch_size % per_step:
            tp = f" (the {self.world_size} ranks over --tp {self.run.tp_size})" if self.run.tp_size > 1 else ""
            raise SpecError(
                f"--global-batch-size {training.dataset.global_batch_size} is not divisible by {ranks} data-parallel "
                f"ranks{tp} x --grad-accum {training.dataset.grad_accum} = {per_step}; give a multiple of {per_step}, "
                f"e.g. {max(1, round(training.dataset.global_batch_size / per_step)) * per_step}"
            )

    def _check_fault_tolerance(self) -> None:
        training = self.run.training
        if self.launch.check:
            for given, why in (
                (training.resilience.fault_tolerance == "replica", "--fault-tolerance replica"),
                (self.flexible, f"--nodes {self.nodes_text} (a flexible allocation)"),
                (self.spare_nodes and self.ntasks is not None, f"--spare-nodes with --ntasks {self.ntasks}"),
            ):
                if given:
                    raise SpecError(f"--check does not work with {why} yet; leave one of them out")
        if training.resilience.fault_tolerance != "replica":
            if self.spare_nodes and not self.launch.check:
                raise SpecError(
                    f"--spare-nodes {self.spare_nodes} needs --fault-tolerance replica (a lost group restarts on a "
                    f"spare) or --check (a spare takes the place of a node the check finds slow): without either "
                    f"the spares would only wait"
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
        if self.run.training.resilience.fault_tolerance != "replica":
            return None
        return replica_shape(
            plan_for(
                nodes=self.nodes,
                gpus_per_node=self.gpus_per_node,
                shard_size=self.run.shard_size,
                tp_size=self.run.tp_size,
            ),
            min_replicas=self.run.training.resilience.min_replicas,
            spare_nodes=self.spare_nodes,
        )

    def _check_flexible(self, min_nodes: int) -> None:
        _positive_int("--nodes MIN", min_nodes)
        if min_nodes > self.nodes:
            raise SpecError(
                f"--nodes {min_nodes}-{self.nodes}: the fewest nodes is more than the most; "
                f"write {self.nodes}-{min_nodes}"
            )
        if min_nodes == self.nodes:
            object.__setattr__(self, "min_nodes", None)
            return
        if self.ntasks is not None:
            raise SpecError(
                f"--ntasks {self.ntasks} with --nodes {self.nodes_text}: an uneven allocation needs a fixed "
                f"node count; give --nodes N, or drop --ntasks"
            )
        try:
            self.plan_at(min_nodes)
        except TopologyError as exc:
            raise TopologyError(f"--nodes {self.nodes_text}: at {min_nodes} node(s): {exc}") from None
        training = self.run.training
        gpus = self.gpus_per_node
        global_batch_size = training.dataset.global_batch_size
        given = global_batch_size is not None
        if global_batch_size is None:  # the stream must not depend on the nodes granted
            global_batch_size = training.dataset.batch_size * self.nodes * gpus * training.dataset.grad_accum
            training = training.replace(global_batch_size=global_batch_size)
            object.__setattr__(self, "run", dataclasses.replace(self.run, training=training))
        data_gpus = gpus // self.run.tp_size  # a tp group reads the same rows
        for count in (min_nodes, self.nodes):
            per_step = count * data_gpus * training.dataset.grad_accum
            if global_batch_size % per_step:
                low, high = (
                    min_nodes * data_gpus * training.dataset.grad_accum,
                    self.nodes * data_gpus * training.dataset.grad_accum,
                )
                common = low * high // _gcd(low, high)
                what = (
                    ""
                    if given
                    else f" (--batch-size {training.dataset.batch_size} x {self.nodes * gpus} ranks at {self.nodes} "
                    f"nodes x --grad-accum {training.dataset.grad_accum})"
                )
                raise SpecError(
                    f"--nodes {self.nodes_text}: the global batch {global_batch_size}{what} "
                    f"does not split over "
                    f"{count * data_gpus} data-parallel ranks x --grad-accum {training.dataset.grad_accum} at {count} node(s); give "
                    f"--global-batch-size a multiple of {common}, so every node count SLURM grants "
                    f"trains on the same samples"
                )

    @property
    def flexible(self) -> bool:
        """A flexible allocation: SLURM grants between ``min_nodes`` and ``nodes`` nodes."""
        return self.min_nodes is not None and self.min_nodes < self.nodes

    @property
    def nodes_text(self) -> str:
        """The nodes of the job: ``2``, or ``1-2`` for a flexible allocation."""
        return f"{self.min_nodes}-{self.nodes}" if self.flexible else str(self.nodes)

    @property
    def requested_nodes(self) -> str:
        """What ``#SBATCH --nodes`` asks for: :attr:`nodes_text`, and the spare nodes, which wait in the job."""
        return str(self.nodes + self.spare_nodes) if self.spare_nodes else self.nodes_text

    @property
    def task_slots_per_node(self) -> int:
        """``#SBATCH --ntasks-per-node``: one task per GPU (an uneven ``--ntasks`` step places exactly
        its planned counts in them; ``--ntasks`` alone would let SLURM put 11,1 or 6,6), one per
        node under torchrun."""
        return 1 if self.launch.launcher == "torchrun" else self.gpus_per_node

    def plan_at(self, nodes: int):
        """The plan when SLURM grants ``nodes`` nodes (a flexible allocation's ends)."""
        return plan_for(
            nodes=nodes, gpus_per_node=self.gpus_per_node, shard_size=self.run.shard_size, tp_size=self.run.tp_size
        )

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
            return plan_for(
                nodes=self.nodes,
                gpus_per_node=self.gpus_per_node,
                shard_size=self.run.shard_size,
                tp_size=self.run.tp_size,
            )
        return TopologyPlan(
            tasks_per_node=self.tasks_per_node, shard_size=self.run.shard_size, tp_size=self.run.tp_size
        )

    @property
    def world_size(self) -> int:
        return sum(self.tasks_per_node)

    @property
    def log_dir(self) -> str:
        """``<run_dir>/logs``: the #SBATCH and srun log files, and submitit's job folder."""
        return self.run.run_dir.rstrip("/") + "/logs"


SECTIONS: tuple[type, ...] = (JobSpec, RunSpec, *TRAINING_SECTIONS, SchedulerSpec, EnvironmentSpec, LaunchSpec)
"""Every section with option fields, in the order of ``render --help`` (a JobSpec's own, what runs
on each task, the training loop's sections, the #SBATCH header, the script's environment, the launch):
:mod:`hpc_hsdp.job.options` lists the options from them."""
