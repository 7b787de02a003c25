"""The job options: each one declared here once, everything else derived from it.

A declaration names the option (its config-file key and Python API keyword, ``--flag``
spelled from it), its kind of value, default, one line of help, metavar, choices or bound,
the commands that take it, how it reaches a task, the spec field it sets and the ``#SBATCH``
lines it writes. From this table come the click options of ``render``, ``submit``, ``run``
and ``plan`` (:mod:`hpc_hsdp.cli.click_options`), the spec classes' fields, their defaults and
their checks (:mod:`hpc_hsdp.job.spec`), the config keys and kinds and the copy of a
config's values into a spec (:mod:`hpc_hsdp.job.config`), the ``#SBATCH`` header of the
rendered script (:func:`sbatch_lines`, :mod:`hpc_hsdp.job.render`), the ``hpc-hsdp run``
arguments of that script (``RunSpec.to_args``), the keywords of ``hpc_hsdp.submit`` and
``--help``. Pure data: no click, no torch.

Adding an ``#SBATCH`` option is one declaration in :data:`OPTIONS`, e.g.::

    JobOption(key="reservation", kind="str", help="#SBATCH --reservation.")

``reaches`` defaults to :data:`SBATCH_LINE`, so it becomes a ``SchedulerSpec`` field
(``spec.scheduler.reservation``, None by default), a ``reservation`` key of config files and
keyword of ``hpc_hsdp.submit``, ``--reservation`` of ``render`` and ``submit``, and, when set,
the line ``#SBATCH --reservation=VALUE`` (beside ``--partition``, ``--account``, ``--qos``;
see :class:`SbatchKey` for another place, another name or a value of its own), which
``--sbatch reservation=...`` may no longer override. A bool writes ``--KEY`` alone when true.
``tests/fast/test_options.py`` adds one to a copy of this module and renders it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import field, replace
from operator import attrgetter
from types import MappingProxyType
from typing import Any

from hpc_hsdp.plan.records import record
from hpc_hsdp.plan.slurm_facts import DEFAULT_SIGNAL, DISTRIBUTIONS
from hpc_hsdp.plan.stage_dir import STAGE_AUTO
from hpc_hsdp.plan.switches import TOPOLOGY_MODES

CONFIG_ENV = "HPC_HSDP_CONFIG"
"""Environment variable naming the config file when ``--config`` is not given."""
PROFILE_ENV = "HPC_HSDP_PROFILE"
"""Environment variable naming the profile when ``--profile`` is not given."""
SLURM_TIMEOUT_ENV = "HPC_HSDP_SLURM_TIMEOUT"
"""Environment variable: seconds any one SLURM command (``sbatch``, ``squeue``, ``scontrol``,
``sacct``, ``scancel``, ``sinfo``) may take before hpc-hsdp stops waiting for it
(:func:`hpc_hsdp.job.backends.slurm_command.run_slurm`); default ``DEFAULT_SLURM_TIMEOUT_S``."""
DEFAULT_SLURM_TIMEOUT_S = 10.0

DEVICES = ("auto", "cpu", "cuda")
"""``--device``: ``auto`` (the layout's GPU when CUDA is usable, else CPU), ``cpu`` or ``cuda``."""
LAUNCHERS = ("srun", "torchrun")
PRECISIONS = ("auto", "bf16", "fp32", "fp8")
LR_SCHEDULES = ("constant", "cosine", "linear")
RESHARD_CHOICES = ("auto", "always", "never")
TRACKERS = ("tensorboard", "wandb", "mlflow")
"""``--tracker``: where every metrics row goes besides metrics.jsonl (comma-separated; ``none``: nowhere else)."""
NO_TRACKER = "none"
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tb"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""tracker -> (the module its package installs, the hpc-hsdp extra that installs it)."""
FAULT_TOLERANCE = ("none", "replica")
"""``--fault-tolerance``: ``none`` (a lost node requeues the job) or ``replica`` (torchft: each
replica group is its own job step; the others train on without it)."""

# How an option reaches the tasks of a job.
RUN_ARGUMENT = "an `hpc-hsdp run` argument in the rendered script"
SBATCH_LINE = "an #SBATCH line"
SCRIPT_LINE = "the script's setup, activation or launch lines"
ENVIRONMENT = "a variable exported to every task"
SUBMIT_SIDE = "read where the job is rendered or submitted"

PARTS: Mapping[str, str] = MappingProxyType(
    {
        "job": "",
        "run": "run",
        "training": "run.training",
        "scheduler": "scheduler",
        "environment": "environment",
        "launch": "launch",
    }
)
"""The spec classes whose fields the options are (``JobOption.part``): JobSpec, RunSpec, TrainingSpec,
SchedulerSpec, EnvironmentSpec, LaunchSpec -> where each sits in a JobSpec."""
_PART_OF_REACH = {
    RUN_ARGUMENT: "run",
    SBATCH_LINE: "scheduler",
    SCRIPT_LINE: "environment",
    ENVIRONMENT: "environment",
    SUBMIT_SIDE: "job",
}
"""The part an option's field belongs to unless its declaration says (``part``)."""

MODULE_FUNCTION = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
"""``--entry`` and ``--model MODULE:FUNCTION``: a dotted module path, a colon, a function name."""

RENDER_SUBMIT = ("render", "submit")
ON_EVERY_TASK = ("render", "submit", "run")

KINDS = ("int", "float", "str", "path", "data", "bool", "nodes", "list", "table")
"""Kinds of value (as a config file holds them): ``path`` is a string made absolute against the
config file's (or the caller's) directory, ``data`` one such path or a mixture
``NAME=PATH:WEIGHT,...`` whose every path is (:mod:`hpc_hsdp.plan.mixture`), ``nodes`` an int or ``"MIN-MAX"``, ``list`` repeatable
strings, ``table`` repeatable ``KEY=VALUE`` items."""


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


LAYERED = _Marker("LAYERED")
"""``Shown.default``: the command line leaves the option unset (None) for a config file, its
profile and then the declared default to fill."""
DECLARED = _Marker("DECLARED")
"""``Shown.default``: the command line carries the option's declared default itself."""


@record
class Shown:
    """How one command shows an option where it differs from the declaration."""

    help: str | None = None
    """Its own help text; None: the declaration's."""
    default: object = LAYERED
    """LAYERED (the command reads config files), DECLARED, or a default of this command's own."""
    default_text: str | None = None
    """What ``[default: ...]`` says for a LAYERED option; None: the declaration's."""
    metavar: str | None = ""
    """Its own metavar (None: click's); "": the declaration's."""
    required: bool = False
    directory: bool = False
    """The value names a directory (click checks that an existing path is not a file)."""


OWN_VALUE = _Marker("OWN_VALUE")
"""``SbatchKey.value``: the option's own value (its field of the JobSpec)."""
PLACE_WITH_PARTITION = 80
"""Where an option's ``#SBATCH`` line goes unless it says: with ``--partition``, ``--account``, ``--qos``
and ``--constraint`` (after ``--time``, before ``--exclusive``)."""


@record(kw_only=False)
class SbatchKey:
    """An sbatch option that a job option owns: the ``#SBATCH`` line it writes, or (without a
    ``value``) one whose ``--sbatch`` passthrough would contradict it. ``--sbatch NAME=...`` is
    refused for every one, saying to use ``instead``."""

    name: str
    """sbatch's long option: ``job-name``."""
    value: Callable[[Any], object] | _Marker | None = OWN_VALUE
    """The line's value, read from the JobSpec: None or False writes no line, True ``--NAME`` alone,
    anything else ``--NAME=VALUE``. None here: the job option writes no such line."""
    place: int = PLACE_WITH_PARTITION
    """Where the line goes in the header: the lines are written by place, then in declaration order;
    the ``--sbatch`` passthrough follows them all."""
    instead: str | None = None
    """What the refusal of ``--sbatch NAME=...`` says to use; None: the option's flag."""
    owned: bool = True
    """False: ``--sbatch NAME`` stays allowed (the job writes the line only in some cases)."""


@record
class JobOption:
    """One job option, declared once (see the module docstring)."""

    key: str
    """Config-file key and Python API keyword (``gpus_per_node``); ``--gpus-per-node`` on the command line."""
    kind: str
    help: str
    default: object = None
    default_text: str | None = None
    """What ``[default: ...]`` says in ``--help``; None: derived from ``default`` (yes/no for a bool, none
    shown for None or empty)."""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    """The largest value that makes sense (``--timeout``: a week); larger is refused."""
    positive: bool = False
    """Above zero: an integer of at least 1, a number above 0."""
    pattern: str | None = None
    """A regular expression a text value must match from its start (``--entry``: module:function)."""
    refusal: str | None = None
    """What the error of a value that is not positive or does not match ``pattern`` says after the
    flag and the value ("must be a positive integer such as 4"); None: from the kind."""
    commands: tuple[str, ...] = RENDER_SUBMIT
    reaches: str = SBATCH_LINE
    training: bool = False
    """A TrainingSpec field (``spec_field``), given to the tasks as an ``hpc-hsdp run`` argument."""
    param: str | None = None
    """The click parameter name, where it is not the key (``training_<key>`` for a training option)."""
    part: str | None = None
    """The spec whose field it sets, a key of :data:`PARTS`; None: ``training`` for a training option,
    else the one of how it ``reaches`` the tasks (an #SBATCH line: the scheduler's)."""
    spec_field: str | None = None
    """The spec attribute it sets, where it is not the key."""
    spec_required: bool = False
    """The spec field has no default: every spec is given a value (``--shard``, ``--run-dir``)."""
    off_word: str | None = None
    """The word that turns the option off (``--signal none``): the spec field then holds None."""
    flag_value: str | None = None
    """The value of the flag given alone (``--stage-data`` is ``--stage-data auto``); None: it needs a value."""
    sbatch: tuple[SbatchKey, ...] | None = None
    """The sbatch options it owns (see :class:`SbatchKey`); None: ``#SBATCH --KEY=VALUE`` for an
    option that ``reaches`` an #SBATCH line, none for the others."""
    in_config: bool = True
    """False: it selects the config file itself (``--config``, ``--profile``) and is no key in one."""
    shown: Mapping[str, Shown] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"option {self.key}: kind {self.kind!r} is not one of {KINDS}")
        if self.reaches == RUN_ARGUMENT and "run" not in self.commands:
            raise ValueError(f"option {self.key} reaches the tasks as a run argument, so `run` must take it")
        unknown = set(self.shown) - set(self.commands)
        if unknown:
            raise ValueError(f"option {self.key} is shown on {sorted(unknown)}, which do not take it")
        if not self.in_config:
            part = None
        elif self.part is not None:
            part = self.part
        else:
            part = "training" if self.training else _PART_OF_REACH[self.reaches]
        if part is not None and part not in PARTS:
            raise ValueError(f"option {self.key}: part {part!r} is not one of {tuple(PARTS)}")
        object.__setattr__(self, "part", part)
        keys = self.sbatch
        if keys is None:
            keys = (SbatchKey(name=self.key.replace("_", "-")),) if self.reaches == SBATCH_LINE else ()
        if any(key.value is OWN_VALUE for key in keys):
            own = attrgetter(self.path)
            keys = tuple(replace(key, value=own) if key.value is OWN_VALUE else key for key in keys)
        object.__setattr__(self, "sbatch", keys)

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def click_param(self) -> str:
        return self.param or (f"training_{self.key}" if self.training else self.key)

    @property
    def attribute(self) -> str:
        return self.spec_field or self.key

    @property
    def path(self) -> str:
        """Where its value sits in a JobSpec: ``scheduler.partition``, ``run.training.steps``."""
        return ".".join(filter(None, (PARTS[self.part], self.attribute)))

    def shown_on(self, command: str) -> Shown:
        return self.shown.get(command, Shown())


def _training(key: str, **declaration) -> JobOption:
    declaration.setdefault("commands", ON_EVERY_TASK)
    return JobOption(key=key, reaches=RUN_ARGUMENT, training=True, **declaration)


_LOGS_IN_RUN_DIR = "--run-dir (logs go to <run-dir>/logs)"

OPTIONS: tuple[JobOption, ...] = (
    JobOption(
        key="config",
        kind="path",
        in_config=False,
        metavar="FILE",
        default_text=f"${CONFIG_ENV}",
        reaches=SUBMIT_SIDE,
        help="TOML file with job options and [profiles.NAME] tables.",
    ),
    JobOption(
        key="profile",
        kind="str",
        in_config=False,
        metavar="NAME",
        default_text=f"${PROFILE_ENV}",
        reaches=SUBMIT_SIDE,
        help="Profile of the config file to apply (below the file's top level).",
    ),
    # ---- sweeps (submit --sweep): one job array, each point a whole job; read where it is submitted
    JobOption(
        key="sweep",
        kind="list",
        default=(),
        part="job",
        reaches=SUBMIT_SIDE,
        metavar="OPTION=V1,V2",
        help="Sweep a job option over these values (repeatable): one SLURM job array, each point a whole job "
        "in <run-dir>/<OPTION=V,...> (e.g. --sweep lr=3e-4,1e-3 --sweep seed=0,1: 4 points); render prints "
        "the job arrays' scripts. Options of the #SBATCH header (--sweep nodes=1,2, --time, --partition) can be "
        "swept too: one job array per distinct header.",
    ),
    JobOption(
        key="sweep_mode",
        kind="str",
        part="job",
        reaches=SUBMIT_SIDE,
        choices=("grid", "zip"),
        default="grid",
        help="With --sweep: grid, every combination of the values; zip, the values paired in order.",
    ),
    JobOption(
        key="array_parallelism",
        kind="int",
        part="job",
        reaches=SUBMIT_SIDE,
        positive=True,
        metavar="K",
        help="With --sweep: at most K points of each job array run at once (#SBATCH --array=0-N%K); a sweep "
        "whose points differ in their #SBATCH header is one array per header, so up to K per header run at once.",
        default_text="all",
    ),
    JobOption(
        key="nodes",
        kind="nodes",
        default=1,
        positive=True,
        metavar="N|MIN-MAX",
        commands=(*RENDER_SUBMIT, "plan"),
        part="job",
        sbatch=(SbatchKey("nodes", attrgetter("requested_nodes"), place=20),),
        help="Nodes in the job; MIN-MAX (e.g. 1-2): a flexible allocation, the mesh follows the nodes "
        "SLURM grants and the global batch stays the same.",
        shown={
            "plan": Shown(
                help="Nodes in the job; MIN-MAX (e.g. 1-2): a flexible allocation, shown at both ends.",
                default_text="1, or as many as --nodelist names",
            )
        },
    ),
    JobOption(
        key="gpus_per_node",
        kind="int",
        default=8,
        positive=True,
        commands=(*RENDER_SUBMIT, "plan"),
        part="job",
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
    ),
    JobOption(
        key="shard",
        kind="int",
        positive=True,
        refusal="must be a positive integer such as 4",
        param="shard_size",
        spec_field="shard_size",
        spec_required=True,
        commands=(*ON_EVERY_TASK, "plan"),
        reaches=RUN_ARGUMENT,
        help="Shard-group size S (required here or in the config): divides a node or is a multiple of it.",
        shown={
            "run": Shown(help="Shard-group size S (inner mesh axis).", default=1),
            "plan": Shown(
                help="Shard-group size S: ranks that shard one model copy. Divides a node, or is a multiple "
                "of it. Required unless --recommend."
            ),
        },
    ),
    JobOption(
        key="tp",
        kind="int",
        default=1,
        positive=True,
        refusal="must be a positive integer such as 2",
        param="tp_size",
        spec_field="tp_size",
        commands=(*ON_EVERY_TASK, "plan"),
        reaches=RUN_ARGUMENT,
        metavar="T",
        help="Tensor-parallel size T: each layer split over T consecutive ranks of one node (the innermost "
        'mesh axis, "tp"); divides the GPUs per node and the model\'s heads, key/value heads, feed-forward '
        "width and vocabulary, and the built-in model's sequence length (checked before submitting; a "
        "--model MODULE:FUNCTION's own "
        "plan is checked on the tasks). A shard group is then S x T ranks.",
        shown={
            "run": Shown(default=1),
            "plan": Shown(default=DECLARED),
        },
    ),
    JobOption(
        key="ntasks",
        kind="int",
        positive=True,
        part="job",
        reaches=SCRIPT_LINE,
        sbatch=(SbatchKey("ntasks", None),),
        help="Total tasks for an uneven allocation (e.g. 12 on 2 nodes: 8,4); replaces --ntasks-per-node.",
    ),
    JobOption(
        key="job_name",
        kind="str",
        default="hpc-hsdp",
        sbatch=(SbatchKey("job-name", place=10),),
        help="#SBATCH --job-name.",
    ),
    JobOption(key="partition", kind="str", help="#SBATCH --partition."),
    JobOption(key="account", kind="str", help="#SBATCH --account."),
    JobOption(key="qos", kind="str", help="#SBATCH --qos."),
    JobOption(
        key="time",
        kind="str",
        param="time_limit",
        metavar="TIME",
        sbatch=(SbatchKey("time", place=70),),
        help="Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS.",
    ),
    JobOption(key="constraint", kind="str", help="#SBATCH --constraint (node features, e.g. 'h100&ib')."),
    # ------------------------------------------------------------------ the network's switches
    JobOption(
        key="switches",
        kind="str",
        metavar="N[@TIME]",
        help="#SBATCH --switches (topology/tree): the job's nodes under at most N leaf switches, SLURM waiting "
        "up to TIME for them (e.g. 1, or 1@30:00).",
    ),
    JobOption(
        key="segment",
        kind="int",
        positive=True,
        refusal="is not a node count; give the nodes per block segment, e.g. --segment 2",
        metavar="N",
        help="#SBATCH --segment (topology/block): the job's nodes in segments of N, each segment within one block.",
    ),
    JobOption(
        key="topology",
        kind="str",
        default="auto",
        choices=TOPOLOGY_MODES,
        commands=(*ON_EVERY_TASK, "plan"),
        reaches=RUN_ARGUMENT,
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
    ),
    JobOption(
        key="exclusive",
        kind="bool",
        default=True,
        sbatch=(SbatchKey("exclusive", place=90),),
        help="Whole nodes (#SBATCH --exclusive): every rank gets an equal share of its node's CPUs and memory.",
    ),
    JobOption(
        key="mem",
        kind="str",
        default_text="0 with --exclusive",
        sbatch=(SbatchKey("mem", attrgetter("scheduler.mem_per_node"), place=60),),
        help="Memory per node with its unit, e.g. 512G or 4000M (0: all of it); a bare number is refused.",
    ),
    JobOption(
        key="cpus_per_task",
        kind="int",
        positive=True,
        sbatch=(SbatchKey("cpus-per-task", place=50),),
        default_text="the node's CPUs / its tasks, at run time",
        help="CPUs per task (also passed to srun).",
    ),
    JobOption(
        key="signal",
        kind="str",
        default=DEFAULT_SIGNAL,
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
    ),
    JobOption(
        key="requeue",
        kind="bool",
        default=True,
        default_text="requeue",
        sbatch=(
            SbatchKey("requeue", place=130, instead="--requeue/--no-requeue"),
            SbatchKey("no-requeue", lambda job: not job.scheduler.requeue, place=130, instead="--requeue/--no-requeue"),
        ),
        help="Let SLURM requeue the job.",
    ),
    JobOption(
        key="run_dir",
        kind="path",
        metavar="DIR",
        commands=ON_EVERY_TASK,
        reaches=RUN_ARGUMENT,
        spec_required=True,
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
    ),
    JobOption(
        key="setup",
        kind="list",
        default=(),
        metavar="LINE",
        reaches=SCRIPT_LINE,
        help="A raw shell line run before launch (module load ...); repeatable; not quoted.",
    ),
    JobOption(
        key="env",
        kind="table",
        param="env_vars",
        default=(),
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
    ),
    JobOption(
        key="pass_env",
        kind="list",
        default=(),
        metavar="NAME",
        reaches=ENVIRONMENT,
        help="Pass a variable by name from the submitting environment (never written); repeatable.",
    ),
    JobOption(
        key="sbatch",
        kind="table",
        param="sbatch_options",
        default=(),
        metavar="KEY=VALUE",
        spec_field="extra",
        sbatch=(),  # its lines follow all the others (hpc_hsdp.job.render.sbatch_options)
        help="Extra '#SBATCH --KEY=VALUE' (KEY alone: a flag); repeatable.",
    ),
    JobOption(
        key="launcher",
        kind="str",
        default="srun",
        choices=LAUNCHERS,
        reaches=SCRIPT_LINE,
        part="launch",
        help="srun: one task per GPU; torchrun: one task per node, static rendezvous.",
    ),
    JobOption(
        key="distribution",
        kind="str",
        default="block",
        choices=DISTRIBUTIONS,
        reaches=SCRIPT_LINE,
        part="launch",
        sbatch=(SbatchKey("distribution", None),),
        help="srun --distribution; the layout is node-major either way.",
    ),
    JobOption(
        key="entry",
        kind="str",
        pattern=MODULE_FUNCTION,
        refusal="is not module:function; write e.g. 'mypkg.train:main'",
        metavar="MODULE:FUNCTION",
        default_text="the built-in payload",
        commands=ON_EVERY_TASK,
        reaches=RUN_ARGUMENT,
        help="Your training function, called on every rank.",
        shown={
            "run": Shown(
                help="module:function called with the run context on every rank instead of the built-in "
                "payload, e.g. mypkg.train:main.",
                default=DECLARED,
                metavar=None,
            )
        },
    ),
    JobOption(
        key="device",
        kind="str",
        default="auto",
        choices=DEVICES,
        commands=ON_EVERY_TASK,
        reaches=RUN_ARGUMENT,
        help="Device of each rank.",
        shown={"run": Shown(help="auto: this task's GPU when CUDA is usable, else CPU.", default=DECLARED)},
    ),
    JobOption(
        key="timeout",
        kind="int",
        default=300,
        positive=True,
        refusal="must be a positive number of seconds",
        maximum=7 * 24 * 3600,
        metavar="SECONDS",
        spec_field="timeout_s",
        commands=ON_EVERY_TASK,
        reaches=RUN_ARGUMENT,
        help="Process-group timeout.",
        shown={"run": Shown(help="Process-group timeout for collectives, in seconds.", default=DECLARED, metavar=None)},
    ),
    JobOption(
        key="comm_stats",
        kind="bool",
        default=False,
        commands=ON_EVERY_TASK,
        reaches=RUN_ARGUMENT,
        help="Record each step's collectives (bytes per mesh axis, intra-/inter-node) in metrics.jsonl.",
        shown={
            "run": Shown(
                help="Record each step's collectives (bytes per mesh axis, intra-/inter-node) in metrics.jsonl "
                "as 'comm'.",
                default=DECLARED,
            )
        },
    ),
    JobOption(
        key="container_image", kind="str", reaches=SCRIPT_LINE, part="launch", help="Pyxis container image for srun."
    ),
    JobOption(
        key="container_mounts",
        kind="str",
        reaches=SCRIPT_LINE,
        part="launch",
        help="Pyxis container mounts for srun (/src:/dst,...).",
    ),
    JobOption(
        key="check",
        kind="bool",
        default=False,
        reaches=SCRIPT_LINE,
        part="launch",
        help=(
            "Measure every node and link before training (the job's first step, a few seconds): each GPU's "
            "matmul, host-to-device copy and free memory, the all-reduce inside each node and between pairs "
            "of nodes; a node below its peers is left out (a spare node, --spare-nodes, takes its place; "
            "without one the job is requeued once without it). check.json in the run directory."
        ),
    ),
    JobOption(
        key="check_threshold",
        kind="float",
        default=0.7,
        positive=True,
        maximum=0.99,
        refusal="must be a share of the median between 0 and 1, e.g. 0.7",
        reaches=ENVIRONMENT,
        part="launch",
        metavar="SHARE",
        help="--check: a node or link below this share of its peers' median is named (and left out).",
    ),
    JobOption(
        key="debug",
        kind="bool",
        default=False,
        reaches=ENVIRONMENT,
        help="NCCL_DEBUG=INFO, TORCH_DISTRIBUTED_DEBUG=DETAIL, ...",
    ),
    JobOption(
        key="venv",
        kind="path",
        metavar="PATH",
        default_text="the running interpreter's venv",
        reaches=SCRIPT_LINE,
        help="Virtualenv to activate ('none': no activation).",
    ),
    JobOption(
        key="conda_env",
        kind="str",
        metavar="NAME",
        reaches=SCRIPT_LINE,
        help="Conda environment to activate instead of a venv.",
    ),
    JobOption(
        key="python", kind="str", default="python", reaches=SCRIPT_LINE, help="Interpreter name the script calls."
    ),
    JobOption(
        key="snapshot_code",
        kind="bool",
        default=False,
        reaches=SCRIPT_LINE,
        help=(
            "Copy the code the job runs (hpc-hsdp and the --entry or --model module's package) into RUN_DIR/code at "
            "submit; every attempt, requeues included, runs that copy, whatever changes on disk afterwards."
        ),
    ),
    JobOption(
        key="template",
        kind="path",
        metavar="PATH",
        reaches=SUBMIT_SIDE,
        help="Your own Jinja2 template (gets the same variables; may extend job.sbatch.j2).",
    ),
    JobOption(
        key="spare_nodes",
        kind="int",
        default=0,
        minimum=0,
        commands=(*RENDER_SUBMIT, "plan"),
        part="job",
        sbatch=(),  # counted in the nodes line
        help=(
            "Nodes allocated beyond --nodes that wait: with --fault-tolerance replica a lost replica group "
            "is started again on them and joins from a live peer; with --check one takes the place of a node "
            "the check finds below its peers."
        ),
        shown={"plan": Shown(default=DECLARED)},
    ),
    # ------------------------------------------------------------------ the training loop (TrainingSpec)
    _training(
        "model",
        kind="str",
        default="builtin",
        metavar="MODEL",
        commands=(*ON_EVERY_TASK, "plan"),
        shown={
            "plan": Shown(
                help="Estimates for this model: builtin, hf:PATH (parameter counts from its config.json; no "
                "torch for the Llama and GPT-2 families) or MODULE:FUNCTION (built on the meta device: imports "
                "torch).",
                default=None,
            )
        },
        help=(
            "builtin (the demo transformer), hf:PATH (a local Hugging Face causal LM directory or "
            "config.json) or MODULE:FUNCTION (your factory)."
        ),
    ),
    _training(
        "shard_unit",
        kind="str",
        default=None,
        default_text="none",
        metavar="CLASS",
        help=(
            "Class name of the blocks wrapped with fully_shard (comma-separated); default: the model's own "
            "(_no_split_modules, or the factory's)."
        ),
    ),
    _training(
        "layers",
        kind="int",
        default=2,
        minimum=1,
        help="Built-in model: transformer blocks (each wrapped with fully_shard).",
    ),
    _training(
        "width",
        kind="int",
        default=64,
        minimum=1,
        help="Built-in model: width (embedding dimension).",
    ),
    _training(
        "heads",
        kind="int",
        default=4,
        minimum=1,
        help="Built-in model: attention heads; must divide --width.",
    ),
    _training(
        "vocab_size",
        kind="int",
        default=256,
        minimum=1,
        help="Vocabulary of the synthetic tokens (without --data); with --data the model takes the dataset's.",
    ),
    _training(
        "data",
        kind="data",
        default=None,
        default_text="none",
        metavar="PATH|NAME=PATH:W,...",
        help=(
            "Token dataset from `hpc-hsdp prepare-data` (a directory, or one .bin file with its .json "
            "sidecar), or a weighted mixture of them, e.g. web=data/web:0.7,code=data/code:0.3 (every "
            "step's batch drawn from the sources by the weights); default: synthetic tokens."
        ),
    ),
    _training(
        "val_data",
        kind="path",
        default=None,
        default_text="none",
        metavar="PATH",
        help="Held-out token data for --eval-every; default: the dataset's val split.",
    ),
    _training(
        "stage_data",
        kind="str",
        default=None,
        default_text="none: read --data where it lies",
        off_word="none",
        flag_value=STAGE_AUTO,
        metavar="[DIR]",
        help=(
            "Copy the token files of --data (and --val-data) to node-local disk, once per node, verified by "
            "their SHA-256, and read them there (the same samples in the same order); a later job on the node "
            "reuses a copy that verifies. DIR (absolute; $VARS are the node's), or alone (auto) the job's "
            "node-local temporary directory: $SLURM_TMPDIR, $TMPDIR, else /tmp. A node with too little free "
            "space reads the shared copy and says so; the copy's time is in RUN_DIR/staging.json."
        ),
    ),
    _training(
        "seq_len",
        kind="int",
        default=32,
        minimum=1,
        help="Tokens per sample.",
        commands=(*ON_EVERY_TASK, "plan"),
        shown={
            "plan": Shown(
                help="Tokens per sample: adds the activations per GPU and, with --tp, the TP bytes per step; "
                "with --recommend, chooses --tp too.  [default: the built-in model's, else none]",
                default=None,
            )
        },
    ),
    _training(
        "batch_size",
        kind="int",
        default=4,
        minimum=1,
        help="Samples per rank per micro-batch (or give --global-batch-size).",
        commands=(*ON_EVERY_TASK, "plan"),
        shown={
            "plan": Shown(
                help="Samples per micro-batch of a TP group (its ranks read the same rows), for the activations.",
                default=DECLARED,
            )
        },
    ),
    _training(
        "global_batch_size",
        kind="int",
        default=None,
        default_text="none",
        minimum=1,
        help=(
            "Samples per optimizer step over all ranks; sets --batch-size to it / (ranks x --grad-accum), "
            "which must divide."
        ),
    ),
    _training(
        "grad_accum",
        kind="int",
        default=1,
        minimum=1,
        commands=(*ON_EVERY_TASK, "plan"),
        shown={
            "plan": Shown(
                help="Micro-batches per optimizer step for the traffic estimate: the shard group gathers and "
                "reduce-scatters on each, the replicas all-reduce once.",
                default=DECLARED,
            )
        },
        help="Micro-batches per optimizer step (replicas all-reduce once per step).",
    ),
    _training(
        "steps",
        kind="int",
        default=20,
        minimum=1,
        help="Optimizer steps in total, across restarts.",
    ),
    _training(
        "seed",
        kind="int",
        default=0,
        minimum=0,
        help="Seed of the initialisation and of the data order.",
    ),
    _training(
        "lr",
        kind="float",
        default=0.003,
        positive=True,
        help="Peak AdamW learning rate.",
    ),
    _training(
        "weight_decay",
        kind="float",
        default=0.0,
        minimum=0.0,
        help="AdamW weight decay.",
    ),
    _training(
        "lr_schedule",
        kind="str",
        default="constant",
        choices=LR_SCHEDULES,
        help="Learning-rate schedule after the warm-up.",
    ),
    _training(
        "warmup_steps",
        kind="int",
        default=0,
        minimum=0,
        help="Linear warm-up steps from 0 to --lr.",
    ),
    _training(
        "min_lr",
        kind="float",
        default=0.0,
        minimum=0.0,
        help="Learning rate at the last step for cosine and linear schedules.",
    ),
    _training(
        "clip_grad",
        kind="float",
        default=0.0,
        minimum=0.0,
        help="Clip the global gradient norm (over the whole mesh) to this; 0: no clipping.",
    ),
    _training(
        "precision",
        kind="str",
        default="auto",
        choices=PRECISIONS,
        help=(
            "bf16: bf16 parameters and compute, fp32 gradient reduction; fp32; fp8: bf16 with the large Linear "
            "layers in Float8 (torchao, hpc-hsdp[fp8]; GPUs of compute capability >= 8.9); auto: bf16 on GPU, "
            "fp32 on CPU."
        ),
        commands=(*ON_EVERY_TASK, "plan"),
        shown={
            "plan": Shown(
                help="What the estimates count as the trainer keeps it: fp32 sharded parameters, gradients and "
                "optimizer state in every precision; bf16 and fp8 gather parameters and keep activations in bf16 "
                "and reduce gradients in fp32; auto: bf16 (a GPU run).",
                default=DECLARED,
            )
        },
    ),
    _training(
        "activation_checkpointing",
        kind="bool",
        default=False,
        help="Recompute each sharded block's activations in backward.",
        commands=(*ON_EVERY_TASK, "plan"),
        shown={"plan": Shown(default=DECLARED)},
    ),
    _training(
        "compile",
        kind="bool",
        default=False,
        help=(
            "torch.compile each shard unit (its forward and backward; FSDP2's hooks stay outside the graphs), "
            "before sharding; the compile cache lives in the run directory, so a resumed attempt reuses it."
        ),
    ),
    _training(
        "reshard_after_forward",
        kind="str",
        default="auto",
        choices=RESHARD_CHOICES,
        help=(
            "always: free each block's gathered parameters after its forward and gather them again in "
            "backward (the least memory); never: keep them to backward (no re-gather, a faster step, the "
            "whole model unsharded in memory); auto: never when that fits beside the sharded state in the "
            "device's memory (plan --recommend's rule), else always."
        ),
    ),
    _training(
        "eval_every",
        kind="int",
        default=0,
        minimum=0,
        help="Mean loss on the held-out split every K steps (0: never).",
    ),
    _training(
        "eval_batches",
        kind="int",
        default=8,
        minimum=1,
        help="Global batches of held-out data per evaluation.",
    ),
    _training(
        "checkpoint_every",
        kind="int",
        default=0,
        minimum=0,
        help="Save a distributed checkpoint every K steps (0: only at the end).",
    ),
    _training(
        "eval_job",
        kind="str",
        default=None,
        metavar="COMMAND",
        help=(
            "A shell command run as a job of its own for every saved checkpoint (and after the final save), "
            "once per step across requeues, while training goes on: {checkpoint}, {step}, {run_dir} and {result} "
            "are replaced by the step's checkpoint directory, its step, the run directory and a file it may write "
            "its JSON result to (shell-quoted); else its last printed JSON object line is its result. On SLURM "
            "one node in the job's partition and account; results in RUN_DIR/evals/, shown by status and report."
        ),
    ),
    _training(
        "keep_checkpoints",
        kind="int",
        default=2,
        minimum=1,
        help="Complete checkpoints to keep.",
    ),
    _training(
        "straggler_every",
        kind="int",
        default=10,
        minimum=0,
        help=(
            "Every K steps the ranks share their own compute time of the step (one small all-gather) and "
            "metrics.jsonl names the slowest rank (0: never)."
        ),
    ),
    _training(
        "tracker",
        kind="str",
        default="tensorboard",
        metavar="NAMES",
        help=(
            "Where rank 0 sends every metrics row and the job's options besides metrics.jsonl, comma-separated: "
            "tensorboard (RUN_DIR/tb), wandb (offline under RUN_DIR unless WANDB_MODE says otherwise), mlflow "
            "(MLFLOW_TRACKING_URI, else a store in RUN_DIR/mlruns); none: metrics.jsonl only. One tracker run "
            "per run directory: a resumed or resubmitted job continues it."
        ),
    ),
    _training(
        "hang_timeout",
        kind="float",
        default=0.0,
        minimum=0.0,
        help=(
            "Seconds without a completed step after which every rank dumps its stacks and the job ends (and "
            "requeues within --max-restarts); 0: 20x the median step time, at least 120 s."
        ),
    ),
    _training(
        "fault_tolerance",
        kind="str",
        default="none",
        choices=FAULT_TOLERANCE,
        # a node that dies ends its replica group's step, not the job
        sbatch=(SbatchKey("no-kill", lambda job: job.replicas is not None, place=100, owned=False),),
        commands=(*ON_EVERY_TASK, "plan"),
        shown={"plan": Shown(default=DECLARED)},
        help=(
            "replica: each replica group (the whole nodes holding one copy of the model) runs as its own job "
            "step under torchft; a lost group costs the others one quorum, not a requeue (needs hpc-hsdp[ft])."
        ),
    ),
    _training(
        "min_replicas",
        kind="int",
        default=1,
        minimum=1,
        commands=(*ON_EVERY_TASK, "plan"),
        shown={"plan": Shown(default=DECLARED)},
        help=(
            "With --fault-tolerance replica: the fewest live replica groups that train on; below it every "
            "survivor saves and the job requeues (as without fault tolerance)."
        ),
    ),
    _training(
        "quorum_timeout",
        kind="float",
        default=60.0,
        positive=True,
        metavar="SECONDS",
        help=(
            "With --fault-tolerance replica: how long a step waits for the replica groups' quorum (and a "
            "group's collectives for a lost peer) before it goes on without the missing ones."
        ),
    ),
    _training(
        "max_restarts",
        kind="int",
        default=2,
        minimum=0,
        help=(
            "Requeues after failures (a hang, a node failure) before the job gives up; preemption and "
            "time-limit requeues do not count."
        ),
    ),
)

OPTION_BY_KEY: Mapping[str, JobOption] = MappingProxyType({o.key: o for o in OPTIONS})
TRAINING_OPTIONS: tuple[JobOption, ...] = tuple(o for o in OPTIONS if o.training)
"""The TrainingSpec fields' options, in the fields' order."""
RUN_ARGUMENTS: tuple[str, ...] = ("shard", "tp", "run_dir", "device", "entry", "timeout", "comm_stats", "topology")
"""RunSpec's own options in the order ``hpc-hsdp run`` lists them and the rendered script passes
them (not the order of ``render --help``); the training options follow."""


def options_in(part: str) -> tuple[JobOption, ...]:
    """The options whose fields ``part`` (a key of :data:`PARTS`) has, in declaration order."""
    return tuple(declared for declared in OPTIONS if declared.part == part)


def sbatch_lines() -> list[SbatchKey]:
    """The ``#SBATCH`` lines the options write, in the header's order (``SbatchKey.place``, then declaration)."""
    lines = [key for declared in OPTIONS for key in declared.sbatch if key.value is not None]
    return sorted(lines, key=attrgetter("place"))


def owned_sbatch_keys() -> dict[str, str]:
    """sbatch options that the job writes itself or that would contradict it -> what to use instead."""
    return {key.name: key.instead or declared.flag for declared in OPTIONS for key in declared.sbatch if key.owned}


def option(key: str) -> JobOption:
    return OPTION_BY_KEY[key]


def default(key: str) -> object:
    """The declared default of an option: what a spec field holds when nothing sets it."""
    return OPTION_BY_KEY[key].default


def options_of(command: str) -> tuple[JobOption, ...]:
    """The options a command takes, in the order of its ``--help``."""
    if command == "run":
        return tuple(OPTION_BY_KEY[key] for key in RUN_ARGUMENTS) + TRAINING_OPTIONS
    return tuple(declared for declared in OPTIONS if command in declared.commands)


CONFIG_KINDS: Mapping[str, str] = MappingProxyType({o.key: o.kind for o in OPTIONS if o.in_config})
"""Config-file key -> kind of value."""
