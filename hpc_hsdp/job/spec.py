"""Job specifications: frozen, keyword-only dataclasses, checked on construction.

The same spec feeds ``render`` (the sbatch text), ``submit`` and, on each task,
``hpc-hsdp run``; nothing downstream re-validates or re-defaults a value.

Each spec class has a field for every option declared for it in :mod:`hpc_hsdp.job.options`
(``JobOption.part``; its ``attribute``, default and ``metadata["option"]``), checked against
its declaration (:func:`check_option_value`), then the fields and checks of its own that tie
options together (:func:`option_spec`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
import re
from dataclasses import field
from math import gcd as _gcd

from hpc_hsdp.errors import SpecError, TopologyError
from hpc_hsdp.job.options import (
    DEVICES,  # noqa: F401  (hpc_hsdp.runtime.dist imports it from here)
    MODULE_FUNCTION,
    NO_TRACKER,
    RUN_ARGUMENTS,
    TRACKERS,
    TRAINING_OPTIONS,
    JobOption,
    option,
    options_in,
    owned_sbatch_keys,
)
from hpc_hsdp.plan.mixture import Mixture, is_mixture, parse_mixture
from hpc_hsdp.plan.records import record
from hpc_hsdp.plan.replica_groups import replica_shape
from hpc_hsdp.plan.slurm_facts import (
    DEFAULT_SIGNAL,  # noqa: F401  (render.warning_signal_name imports it from here)
    check_segment,
    check_signal,
    check_switches,
    check_text,
    check_time,
    signal_lead_seconds,
    time_limit_seconds,
)
from hpc_hsdp.plan.stage_dir import check_stage_value
from hpc_hsdp.plan.topology import TopologyPlan, check_sizes, format_tasks_per_node, plan_for

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
    if re.match(MODULE_FUNCTION, model):
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


_ANNOTATIONS = {
    "int": "int",
    "nodes": "int",
    "float": "float",
    "bool": "bool",
    "str": "str",
    "path": "str",
    "data": "str",
    "list": "tuple[str, ...]",
    "table": "tuple[tuple[str, str | None], ...]",
}
"""A field's annotation by the kind of its option's value (``X | None`` where the default is None)."""


def option_spec(part: str):
    """Class decorator: ``cls`` as a :func:`~hpc_hsdp.plan.records.record` (a frozen, keyword-only
    dataclass) whose fields are, first, one per option declared for ``part`` in
    :mod:`hpc_hsdp.job.options` (named by its ``attribute``, its default the declared one, the
    declaration in ``metadata["option"]``), then the class's own. Every option field's value is
    checked against its declaration (:func:`check_option_value`) before the class's own
    ``__post_init__`` runs. The class's docstring gets a line naming the option fields."""

    def decorate(cls: type) -> type:
        declared = options_in(part)
        own = cls.__dict__.get("__annotations__", {})
        annotations = {}
        for each in declared:
            annotation = _ANNOTATIONS[each.kind]
            no_default = each.spec_required
            annotations[each.attribute] = (
                annotation if no_default or each.default is not None else f"{annotation} | None"
            )
            metadata = {"option": each}
            setattr(
                cls,
                each.attribute,
                field(metadata=metadata) if no_default else field(default=each.default, metadata=metadata),
            )
        cls.__annotations__ = {**annotations, **own}
        names = ", ".join(f"``{each.attribute}`` ({each.flag})" for each in declared)
        cls.__doc__ = f"{cls.__doc__.rstrip()}\n\n    Option fields: {names}.\n"
        own_post_init = cls.__dict__.get("__post_init__")

        def __post_init__(self) -> None:
            for each in declared:
                check_option_value(each, getattr(self, each.attribute))
            if own_post_init is not None:
                own_post_init(self)

        __post_init__.__qualname__ = f"{cls.__qualname__}.__post_init__"
        cls.__post_init__ = __post_init__
        return record(cls)

    return decorate


@option_spec("training")
class TrainingSpec:
    """The training loop's options (``hpc-hsdp run``, ``render``, ``submit``, config files).

    Each field is one option, declared once in :mod:`hpc_hsdp.job.options` (``_training``):
    ``--seq-len`` on the command line, ``seq_len`` (or ``seq-len``) in a config file, the same
    keyword in the Python API.
    """

    def __post_init__(self) -> None:
        check_model(self.model)
        if self.width % self.heads:
            raise SpecError(
                f"--width {self.width} is not divisible by --heads {self.heads}; pick a width that is a multiple of it"
            )
        if self.val_data is not None and self.data is None:
            raise SpecError("--val-data without --data: give the training data too (--data PATH)")
        if self.stage_data is not None and self.stage_data.lower() == option("stage_data").off_word:
            object.__setattr__(self, "stage_data", None)
        if self.stage_data is not None:
            check_stage_value(self.stage_data)
            if self.data is None:
                raise SpecError(
                    "--stage-data without --data: synthetic tokens have no files to copy; give --data PATH, "
                    "or leave --stage-data out"
                )
        object.__setattr__(self, "tracker", ",".join(tracker_names(self.tracker)) or NO_TRACKER)
        if self.eval_job is not None:
            from hpc_hsdp.rundir.evals import check_eval_command  # noqa: PLC0415 - only with --eval-job: not at render's start

            check_eval_command(self.eval_job)
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
    """Check one value against its option's kind, bound, choices and pattern: the one check of every
    option field of every spec (:func:`option_spec`)."""
    flag, kind = declared.flag, declared.kind
    if value is None and (declared.default is None or declared.off_word is not None) and not declared.spec_required:
        return
    if kind == "bool":
        _flag(flag, value)
        return
    if kind in ("int", "nodes"):
        if declared.positive and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise SpecError(f"{flag} {value!r} {declared.refusal or 'must be a positive integer'}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{flag} {value!r} must be an integer")
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)):
        raise SpecError(f"{flag} {value!r} must be a finite number, e.g. {declared.default!r}")
    if declared.pattern is not None and not (isinstance(value, str) and re.match(declared.pattern, value)):
        raise SpecError(f"{flag} {value!r} {declared.refusal}")
    if kind in ("str", "path", "data"):
        check_text(flag, value)
    if kind == "list":
        for item in value:
            check_text(flag, item)
    if kind == "data" and is_mixture(value):
        parse_mixture(value, flag=flag)
    if declared.choices and value not in declared.choices:
        raise SpecError(f"{flag} {value!r} is unknown; choose {', '.join(declared.choices)}")
    if declared.minimum is not None and value < declared.minimum:
        raise SpecError(f"{flag} {value} must be at least {declared.minimum}")
    if declared.maximum is not None and value > declared.maximum:
        raise SpecError(f"{flag} {value} must be at most {declared.maximum:g}")
    if kind == "int" and abs(value) >= 2**63:
        raise SpecError(f"{flag} {value} is out of range (at most {2**63 - 1})")
    if declared.positive and not value > 0:
        raise SpecError(
            f"{flag} {value!r} {declared.refusal or f'must be a positive number, e.g. {declared.default!r}'}"
        )


@option_spec("run")
class RunSpec:
    """What ``hpc-hsdp run`` needs on each task besides its SLURM environment: the options that
    reach the tasks as its arguments (``shard_size`` is S, the inner "shard" mesh axis; ``run_dir``
    holds layout.json, metrics.jsonl, checkpoints/ and the logs) and the training options."""

    training: TrainingSpec = TrainingSpec()
    """Options of the built-in payload."""

    def __post_init__(self) -> None:
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
    owned = owned_sbatch_keys()
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


def _pairs(value: object) -> tuple[tuple[str, object], ...]:
    items = value.items() if isinstance(value, dict) else value
    merged = dict(items)  # a later pair wins
    return tuple(sorted(merged.items()))


@option_spec("scheduler")
class SchedulerSpec:
    """The #SBATCH header besides the topology: what SLURM allocates and how it treats the job.

    Its fields are the options that write #SBATCH lines (``JobOption.reaches``); None leaves a
    line out (the partition's default time limit, the user's default account, ...), ``signal``
    None sends no warning signal. ``extra`` is the ``--sbatch KEY=VALUE`` passthrough, sorted by
    key; a None value writes ``--KEY`` alone.
    """

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


@option_spec("environment")
class EnvironmentSpec:
    """The setup section of the script: what runs before the rendezvous and launch. ``setup``
    lines run first, in order (the one unquoted input); ``env`` is sorted by name and exported
    after the NCCL/torch defaults, so it wins; ``pass_env`` is sorted, its values are never
    written; ``venv`` is an absolute path (None: no activation)."""

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


@option_spec("launch")
class LaunchSpec:
    """How the job step starts the ranks: srun or torchrun, srun's distribution (``cyclic``
    scrambles SLURM_PROCID, which the node-major layout ignores), pyxis's container (None: none)."""

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


@option_spec("job")
class JobSpec:
    """A whole job: topology, what runs on each task, the #SBATCH header, setup and launcher.

    ``render_sbatch(spec)`` is a pure function of it; ``submit`` sends that very text. Of its
    option fields, ``nodes`` is the most SLURM may grant (see ``min_nodes``), ``ntasks`` None
    means nodes x GPUs, ``template`` is an absolute path (None: the packaged ``job.sbatch.j2``).
    """

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
        if training.global_batch_size is None or self.flexible or training.fault_tolerance == "replica":
            return
        ranks = self.world_size // self.run.tp_size
        per_step = ranks * training.grad_accum
        if training.global_batch_size % per_step:
            tp = f" (the {self.world_size} ranks over --tp {self.run.tp_size})" if self.run.tp_size > 1 else ""
            raise SpecError(
                f"--global-batch-size {training.global_batch_size} is not divisible by {ranks} data-parallel "
                f"ranks{tp} x --grad-accum {training.grad_accum} = {per_step}; give a multiple of {per_step}, "
                f"e.g. {max(1, round(training.global_batch_size / per_step)) * per_step}"
            )

    def _check_fault_tolerance(self) -> None:
        training = self.run.training
        if self.launch.check:
            for given, why in (
                (training.fault_tolerance == "replica", "--fault-tolerance replica"),
                (self.flexible, f"--nodes {self.nodes_text} (a flexible allocation)"),
                (self.spare_nodes and self.ntasks is not None, f"--spare-nodes with --ntasks {self.ntasks}"),
            ):
                if given:
                    raise SpecError(f"--check does not work with {why} yet; leave one of them out")
        if training.fault_tolerance != "replica":
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
        if self.run.training.fault_tolerance != "replica":
            return None
        return replica_shape(
            plan_for(
                nodes=self.nodes,
                gpus_per_node=self.gpus_per_node,
                shard_size=self.run.shard_size,
                tp_size=self.run.tp_size,
            ),
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
        data_gpus = gpus // self.run.tp_size  # a tp group reads the same rows
        for count in (self.min_nodes, self.nodes):
            per_step = count * data_gpus * training.grad_accum
            if training.global_batch_size % per_step:
                low, high = (
                    self.min_nodes * data_gpus * training.grad_accum,
                    self.nodes * data_gpus * training.grad_accum,
                )
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
                    f"{count * data_gpus} data-parallel ranks x --grad-accum {training.grad_accum} at {count} node(s); give "
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
