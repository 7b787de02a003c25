"""The training loop's options: one typed section per component, and :class:`TrainingSpec`, the
sections together (``RunSpec.training``).

Each section is a :func:`~hpc_hsdp.job.option_fields.section` whose fields are job options
written out with their type, default and docstring (``--lr`` is ``OptimizerSection.lr``, read as
``spec.training.optimizer.lr``); each component of the loop takes its own section (the schedule
the optimizer's, the watchdog the resilience one, the trackers the observation one). Config
keys, flags and ``hpc_hsdp.submit`` keywords stay flat (``lr``, ``--lr``):
:meth:`TrainingSpec.of` and :meth:`TrainingSpec.options` map them to the sections and back.
"""

from __future__ import annotations

import os
import re
from typing import Any

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.option_fields import (
    DECLARED,
    FAULT_TOLERANCE,
    LR_SCHEDULES,
    MODULE_FUNCTION,
    NO_TRACKER,
    ON_EVERY_TASK,
    PRECISIONS,
    RESHARD_CHOICES,
    RUN_ARGUMENT,
    TRACKERS,
    JobOption,
    SbatchKey,
    Shown,
    option_field,
    run_arguments,
    section,
    section_options,
)
from hpc_hsdp.plan.mixture import Mixture, is_mixture, parse_mixture
from hpc_hsdp.plan.records import record
from hpc_hsdp.plan.slurm_facts import check_text
from hpc_hsdp.plan.staging_dir import STAGE_AUTO, check_stage_value

NO_STAGE = "none"
"""``--stage-data none``: read ``--data`` where it lies (the field holds None)."""
MODEL_FORMS = "builtin, hf:PATH (a local transformers directory or config.json) or MODULE:FUNCTION (your factory)"


def check_model(model: str) -> str:
    """``--model``: ``builtin``, ``hf:PATH`` or ``MODULE:FUNCTION``; returns it unchanged.
    Only the form is checked here (no file is read: a script may be rendered where the
    model's files are not); ``submit`` looks for them (:mod:`hpc_hsdp.submit_host.preflight`)."""
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


@section("run.training.model", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class ModelSection:
    """The model the job trains: which one, and the built-in model's shape."""

    name: str = option_field(
        key="model",
        default="builtin",
        kind="str",
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
        help="builtin (the demo transformer), hf:PATH (a local Hugging Face causal LM directory or "
        "config.json) or MODULE:FUNCTION (your factory).",
    )
    """``builtin``, ``hf:PATH`` or ``MODULE:FUNCTION``: the model the job trains."""
    shard_unit: str | None = option_field(
        default=None,
        kind="str",
        default_text="none",
        metavar="CLASS",
        help="Class name of the blocks wrapped with fully_shard (comma-separated); default: the model's own "
        "(_no_split_modules, or the factory's).",
    )
    """Class names of the blocks wrapped with fully_shard, comma-separated (None: the model's own)."""
    layers: int = option_field(
        default=2,
        kind="int",
        minimum=1,
        help="Built-in model: transformer blocks (each wrapped with fully_shard).",
    )
    """Transformer blocks of the built-in model."""
    width: int = option_field(
        default=64,
        kind="int",
        minimum=1,
        help="Built-in model: width (embedding dimension).",
    )
    """Embedding dimension of the built-in model."""
    heads: int = option_field(
        default=4,
        kind="int",
        minimum=1,
        help="Built-in model: attention heads; must divide --width.",
    )
    """Attention heads of the built-in model; they divide ``width``."""
    vocab_size: int = option_field(
        default=256,
        kind="int",
        minimum=1,
        help="Vocabulary of the synthetic tokens (without --data); with --data the model takes the dataset's.",
    )
    """Vocabulary of the synthetic tokens (with ``data``, the dataset's is used)."""

    def __post_init__(self) -> None:
        check_model(self.name)
        if self.width % self.heads:
            raise SpecError(
                f"--width {self.width} is not divisible by --heads {self.heads}; pick a width that is a multiple of it"
            )


@section("run.training.dataset", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class DataSection:
    """The tokens each step reads: the dataset, its node-local copy, samples and batches."""

    data: str | None = option_field(
        default=None,
        kind="data",
        default_text="none",
        metavar="PATH|NAME=PATH:W,...",
        help="Token dataset from `hpc-hsdp prepare-data` (a directory, or one .bin file with its .json "
        "sidecar), or a weighted mixture of them, e.g. web=data/web:0.7,code=data/code:0.3 (every "
        "step's batch drawn from the sources by the weights); default: synthetic tokens.",
    )
    """Token dataset (a directory or .bin file) or a mixture ``NAME=PATH:WEIGHT,...`` (None: synthetic)."""
    val_data: str | None = option_field(
        default=None,
        kind="path",
        default_text="none",
        metavar="PATH",
        help="Held-out token data for --eval-every; default: the dataset's val split.",
    )
    """Held-out token data for evaluation (None: the dataset's val split)."""
    stage_data: str | None = option_field(
        default=None,
        kind="str",
        default_text="none: read --data where it lies",
        off_word=NO_STAGE,
        flag_value=STAGE_AUTO,
        metavar="[DIR]",
        help="Copy the token files of --data (and --val-data) to node-local disk, once per node, verified by "
        "their SHA-256, and read them there (the same samples in the same order); a later job on the node "
        "reuses a copy that verifies. DIR (absolute; $VARS are the node's), or alone (auto) the job's "
        "node-local temporary directory: $SLURM_TMPDIR, $TMPDIR, else /tmp. A node with too little free "
        "space reads the shared copy and says so; the copy's time is in RUN_DIR/staging.json.",
    )
    """Node-local directory the token files are copied to, or ``auto`` (None: read in place)."""
    seq_len: int = option_field(
        default=32,
        kind="int",
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
    )
    """Tokens per sample."""
    batch_size: int = option_field(
        default=4,
        kind="int",
        minimum=1,
        help="Samples per rank per micro-batch (or give --global-batch-size).",
        commands=(*ON_EVERY_TASK, "plan"),
        shown={
            "plan": Shown(
                help="Samples per micro-batch of a TP group (its ranks read the same rows), for the activations.",
                default=DECLARED,
            )
        },
    )
    """Samples per rank per micro-batch (unless ``global_batch_size`` is given)."""
    global_batch_size: int | None = option_field(
        default=None,
        kind="int",
        default_text="none",
        minimum=1,
        help="Samples per optimizer step over all ranks; sets --batch-size to it / (ranks x --grad-accum), "
        "which must divide.",
    )
    """Samples per optimizer step over all ranks (None: from ``batch_size``)."""
    grad_accum: int = option_field(
        default=1,
        kind="int",
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
    )
    """Micro-batches per optimizer step."""

    def __post_init__(self) -> None:
        if self.val_data is not None and self.data is None:
            raise SpecError("--val-data without --data: give the training data too (--data PATH)")
        if self.stage_data is not None and self.stage_data.lower() == NO_STAGE:
            object.__setattr__(self, "stage_data", None)
        if self.stage_data is not None:
            check_stage_value(self.stage_data)
            if self.data is None:
                raise SpecError(
                    "--stage-data without --data: synthetic tokens have no files to copy; give --data PATH, "
                    "or leave --stage-data out"
                )
        if self.val_data is not None and is_mixture(self.data):
            raise SpecError(
                "--val-data with a --data mixture: each source is evaluated on its own val split "
                "(eval_loss/NAME); leave --val-data out"
            )

    @property
    def mixture(self) -> Mixture | None:
        """``--data``'s mixture, parsed (None: one dataset, or synthetic tokens)."""
        return parse_mixture(self.data) if self.data is not None and is_mixture(self.data) else None

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


@section("run.training.optimizer", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class OptimizerSection:
    """The optimizer and its schedule: steps, seed, AdamW, the learning-rate schedule, clipping."""

    steps: int = option_field(
        default=20,
        kind="int",
        minimum=1,
        help="Optimizer steps in total, across restarts.",
    )
    """Optimizer steps in total, across restarts."""
    seed: int = option_field(
        default=0,
        kind="int",
        minimum=0,
        help="Seed of the initialisation and of the data order.",
    )
    """Seed of the initialisation and of the data order."""
    lr: float = option_field(
        default=0.003,
        kind="float",
        positive=True,
        help="Peak AdamW learning rate.",
    )
    """Peak AdamW learning rate."""
    weight_decay: float = option_field(
        default=0.0,
        kind="float",
        minimum=0.0,
        help="AdamW weight decay.",
    )
    """AdamW weight decay."""
    lr_schedule: str = option_field(
        default="constant",
        kind="str",
        choices=LR_SCHEDULES,
        help="Learning-rate schedule after the warm-up.",
    )
    """The learning-rate schedule after the warm-up: ``constant``, ``cosine`` or ``linear``."""
    warmup_steps: int = option_field(
        default=0,
        kind="int",
        minimum=0,
        help="Linear warm-up steps from 0 to --lr.",
    )
    """Steps of the linear warm-up from 0 to ``lr``."""
    min_lr: float = option_field(
        default=0.0,
        kind="float",
        minimum=0.0,
        help="Learning rate at the last step for cosine and linear schedules.",
    )
    """Learning rate at the last step of a cosine or linear schedule."""
    clip_grad: float = option_field(
        default=0.0,
        kind="float",
        minimum=0.0,
        help="Clip the global gradient norm (over the whole mesh) to this; 0: no clipping.",
    )
    """The global gradient norm is clipped to this (0: no clipping)."""


@section("run.training.compute", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class ComputeSection:
    """How each shard unit computes: precision, activation checkpointing, compile, resharding."""

    precision: str = option_field(
        default="auto",
        kind="str",
        choices=PRECISIONS,
        help="bf16: bf16 parameters and compute, fp32 gradient reduction; fp32; fp8: bf16 with the large Linear "
        "layers in Float8 (torchao, hpc-hsdp[fp8]; GPUs of compute capability >= 8.9); auto: bf16 on GPU, "
        "fp32 on CPU.",
        commands=(*ON_EVERY_TASK, "plan"),
        shown={
            "plan": Shown(
                help="What the estimates count as the trainer keeps it: fp32 sharded parameters, gradients and "
                "optimizer state in every precision; bf16 and fp8 gather parameters and keep activations in bf16 "
                "and reduce gradients in fp32; auto: bf16 (a GPU run).",
                default=DECLARED,
            )
        },
    )
    """``auto``, ``bf16``, ``fp32`` or ``fp8`` (bf16 with Float8 Linear layers)."""
    activation_checkpointing: bool = option_field(
        default=False,
        kind="bool",
        help="Recompute each sharded block's activations in backward.",
        commands=(*ON_EVERY_TASK, "plan"),
        shown={"plan": Shown(default=DECLARED)},
    )
    """Recompute each sharded block's activations in backward."""
    compile: bool = option_field(
        default=False,
        kind="bool",
        help="torch.compile each shard unit (its forward and backward; FSDP2's hooks stay outside the graphs), "
        "before sharding; the compile cache lives in the run directory, so a resumed attempt reuses it.",
    )
    """torch.compile each shard unit before sharding."""
    reshard_after_forward: str = option_field(
        default="auto",
        kind="str",
        choices=RESHARD_CHOICES,
        help="always: free each block's gathered parameters after its forward and gather them again in "
        "backward (the least memory); never: keep them to backward (no re-gather, a faster step, the "
        "whole model unsharded in memory); auto: never when that fits beside the sharded state in the "
        "device's memory (plan --recommend's rule), else always.",
    )
    """Free a block's gathered parameters after its forward: ``always``, ``never`` or ``auto``."""


@section("run.training.evaluation", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class EvaluationSection:
    """The held-out loss during training."""

    eval_every: int = option_field(
        default=0,
        kind="int",
        minimum=0,
        help="Mean loss on the held-out split every K steps (0: never).",
    )
    """Evaluate the held-out loss every this many steps (0: never)."""
    eval_batches: int = option_field(
        default=8,
        kind="int",
        minimum=1,
        help="Global batches of held-out data per evaluation.",
    )
    """Global batches of held-out data per evaluation."""


@section("run.training.checkpoint", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class CheckpointSection:
    """Distributed checkpoints: how often, how many kept, the object store that keeps them too, the eval
    job run on each."""

    checkpoint_every: int = option_field(
        default=0,
        kind="int",
        minimum=0,
        help="Save a distributed checkpoint every K steps (0: only at the end).",
    )
    """Save a distributed checkpoint every this many steps (0: only at the end)."""
    eval_job: str | None = option_field(
        default=None,
        kind="str",
        metavar="COMMAND",
        help="A shell command run as a job of its own for every saved checkpoint (and after the final save), "
        "once per step across requeues, while training goes on: {checkpoint}, {step}, {run_dir} and {result} "
        "are replaced by the step's checkpoint directory, its step, the run directory and a file it may write "
        "its JSON result to (shell-quoted); else its last printed JSON object line is its result. On SLURM "
        "one node in the job's partition and account; results in RUN_DIR/evals/, shown by status and report.",
    )
    """A shell command run as a job of its own for every saved checkpoint (None: none)."""
    keep_checkpoints: int = option_field(
        default=2,
        kind="int",
        minimum=1,
        help="Complete checkpoints to keep.",
    )
    """Complete checkpoints kept."""
    checkpoint_store: str | None = option_field(
        default=None,
        kind="str",
        default_text="none: checkpoints stay in RUN_DIR/checkpoints",
        metavar="URL",
        help="Also keep the checkpoints in object storage, s3://BUCKET/PREFIX (hpc-hsdp[s3]; the endpoint, keys and "
        "region from the AWS variables and files, never written anywhere): each save goes to RUN_DIR/checkpoints "
        "as without it, then every rank uploads its files in the background, retried, and the step is committed "
        "there once all are in; --keep-checkpoints applies there too; a resume takes the newest committed step of "
        "the run directory or the store.",
    )
    """Object storage that holds the checkpoints too, ``s3://BUCKET/PREFIX`` (None: the run directory only)."""

    def __post_init__(self) -> None:
        if self.checkpoint_store is not None:
            from hpc_hsdp.rundir.checkpointing.checkpoint_store import parse_store_url  # noqa: PLC0415 - only with a store

            object.__setattr__(self, "checkpoint_store", str(parse_store_url(self.checkpoint_store)))
        if self.eval_job is not None:
            from hpc_hsdp.rundir.training.evals import check_eval_command  # noqa: PLC0415 - only with --eval-job: not at render's start

            check_eval_command(self.eval_job)


@section("run.training.observation", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class ObservationSection:
    """What the job reports besides its metrics: the slowest rank, the trackers."""

    straggler_every: int = option_field(
        default=10,
        kind="int",
        minimum=0,
        help="Every K steps the ranks share their own compute time of the step (one small all-gather) and "
        "metrics.jsonl names the slowest rank (0: never).",
    )
    """Name the slowest rank in metrics.jsonl every this many steps (0: never)."""
    tracker: str = option_field(
        default="tensorboard",
        kind="str",
        metavar="NAMES",
        help="Where rank 0 sends every metrics row and the job's options besides metrics.jsonl, comma-separated: "
        "tensorboard (RUN_DIR/tb), wandb (offline under RUN_DIR unless WANDB_MODE says otherwise), mlflow "
        "(MLFLOW_TRACKING_URI, else a store in RUN_DIR/mlruns); none: metrics.jsonl only. One tracker run "
        "per run directory: a resumed or resubmitted job continues it.",
    )
    """Trackers that get every metrics row, comma-separated, or ``none``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tracker", ",".join(tracker_names(self.tracker)) or NO_TRACKER)

    @property
    def trackers(self) -> tuple[str, ...]:
        """``--tracker`` as names, in the order given (empty for ``none``)."""
        return tracker_names(self.tracker)


@section("run.training.resilience", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class ResilienceSection:
    """Fault tolerance: the hang watchdog, replica groups, the restart budget."""

    hang_timeout: float = option_field(
        default=0.0,
        kind="float",
        minimum=0.0,
        help="Seconds without a completed step after which every rank dumps its stacks and the job ends (and "
        "requeues within --max-restarts); 0: 20x the median step time, at least 120 s.",
    )
    """Seconds without a completed step before the ranks dump stacks and end (0: from the step time)."""
    fault_tolerance: str = option_field(
        default="none",
        kind="str",
        choices=FAULT_TOLERANCE,
        sbatch=(SbatchKey("no-kill", lambda job: job.replicas is not None, place=100, owned=False),),
        commands=(*ON_EVERY_TASK, "plan"),
        shown={"plan": Shown(default=DECLARED)},
        help="replica: each replica group (the whole nodes holding one copy of the model) runs as its own job "
        "step under torchft; a lost group costs the others one quorum, not a requeue (needs hpc-hsdp[ft]).",
    )
    """``none`` (a lost node requeues the job) or ``replica`` (torchft replica groups)."""
    min_replicas: int = option_field(
        default=1,
        kind="int",
        minimum=1,
        commands=(*ON_EVERY_TASK, "plan"),
        shown={"plan": Shown(default=DECLARED)},
        help="With --fault-tolerance replica: the fewest live replica groups that train on; below it every "
        "survivor saves and the job requeues (as without fault tolerance).",
    )
    """The fewest live replica groups that train on (``fault_tolerance`` replica)."""
    quorum_timeout: float = option_field(
        default=60.0,
        kind="float",
        positive=True,
        metavar="SECONDS",
        help="With --fault-tolerance replica: how long a step waits for the replica groups' quorum (and a "
        "group's collectives for a lost peer) before it goes on without the missing ones.",
    )
    """Seconds a step waits for the replica groups' quorum (``fault_tolerance`` replica)."""
    max_restarts: int = option_field(
        default=2,
        kind="int",
        minimum=0,
        help="Requeues after failures (a hang, a node failure) before the job gives up; preemption and "
        "time-limit requeues do not count.",
    )
    """Requeues after failures before the job gives up (preemption and time limits do not count)."""

    def __post_init__(self) -> None:
        if self.fault_tolerance == "replica":
            require_torchft()


TRAINING_SECTIONS: tuple[type, ...] = (
    ModelSection,
    DataSection,
    OptimizerSection,
    ComputeSection,
    EvaluationSection,
    CheckpointSection,
    ObservationSection,
    ResilienceSection,
)
"""The training loop's sections in the order of ``TrainingSpec``'s fields (and of ``hpc-hsdp run``'s arguments)."""

SECTION_FIELDS = ("model", "dataset", "optimizer", "compute", "evaluation", "checkpoint", "observation", "resilience")
"""TrainingSpec's fields, one per section of :data:`TRAINING_SECTIONS`."""


@record
class TrainingSpec:
    """The training loop's options (``hpc-hsdp run``, ``render``, ``submit``, config files), by
    component. ``TrainingSpec.of(lr=1e-3, steps=50)`` makes one from config keys."""

    model: ModelSection = ModelSection()
    """The model and the built-in model's shape."""
    dataset: DataSection = DataSection()
    """The dataset, its staging, samples and batches."""
    optimizer: OptimizerSection = OptimizerSection()
    """Steps, seed, AdamW and the learning-rate schedule."""
    compute: ComputeSection = ComputeSection()
    """Precision, activation checkpointing, compile, resharding."""
    evaluation: EvaluationSection = EvaluationSection()
    """The held-out loss during training."""
    checkpoint: CheckpointSection = CheckpointSection()
    """Checkpoints, their object store and the eval job."""
    observation: ObservationSection = ObservationSection()
    """The straggler report and the trackers."""
    resilience: ResilienceSection = ResilienceSection()
    """The hang watchdog, replica groups and the restart budget."""

    def __post_init__(self) -> None:
        for name, kind in zip(SECTION_FIELDS, TRAINING_SECTIONS, strict=True):
            if not isinstance(getattr(self, name), kind):
                raise SpecError(
                    f"TrainingSpec.{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}"
                )
        if self.resilience.fault_tolerance == "replica" and is_mixture(self.dataset.data):
            raise SpecError(
                "--fault-tolerance replica with a --data mixture: the replica groups' share of a step "
                "follows one dataset's order only; give one dataset, or leave --fault-tolerance out"
            )

    @classmethod
    def of(cls, **options: Any) -> TrainingSpec:
        """A TrainingSpec from options by their config key (``lr=1e-3, model="hf:/m"``); the rest
        take their defaults. An unknown key is a TypeError, as for any constructor."""
        given = dict(options)
        sections = {}
        for name, kind in zip(SECTION_FIELDS, TRAINING_SECTIONS, strict=True):
            values = {o.attribute: given.pop(o.key) for o in section_options(kind) if o.key in given}
            sections[name] = kind(**values)
        if given:
            raise TypeError(f"TrainingSpec.of() got unexpected keyword arguments {', '.join(map(repr, given))}")
        return cls(**sections)

    def replace(self, **options: Any) -> TrainingSpec:
        """This spec with some options, by config key, changed (``training.replace(steps=8)``)."""
        return TrainingSpec.of(**{**self.options(), **options})

    def options(self) -> dict[str, Any]:
        """Every option by its config key, in the sections' order (as model.json and the trackers record them)."""
        return {declared.key: value for declared, value in self.option_values()}

    def option_values(self) -> list[tuple[JobOption, Any]]:
        """(declaration, value) of every option, in the sections' order."""
        return [
            (declared, getattr(getattr(self, name), declared.attribute))
            for name, kind in zip(SECTION_FIELDS, TRAINING_SECTIONS, strict=True)
            for declared in section_options(kind)
        ]

    def to_args(self) -> list[str]:
        """The options that reproduce this spec on ``hpc-hsdp run``; defaults are left out."""
        return [arg for declared, value in self.option_values() for arg in run_arguments(declared, value)]
