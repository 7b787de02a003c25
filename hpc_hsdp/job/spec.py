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
import os
import posixpath
import re
from math import gcd as _gcd
from operator import attrgetter

from hpc_hsdp.errors import SpecError, TopologyError
from hpc_hsdp.job.option_fields import (
    CLUSTERS,
    DECLARED,
    DEVICES,  # noqa: F401  (hpc_hsdp.runtime.dist imports it from here)
    ENVIRONMENT,
    FAULT_TOLERANCE,
    LAUNCHERS,
    LR_SCHEDULES,
    MODULE_FUNCTION,
    NO_TRACKER,
    ON_EVERY_TASK,
    PRECISIONS,
    RENDER_SUBMIT,
    RESHARD_CHOICES,
    RUN_ARGUMENT,
    SBATCH_LINE,
    SCRIPT_LINE,
    SUBMIT_SIDE,
    TRACKERS,
    SbatchKey,
    Shown,
    option_field,
    owned_sbatch_keys,
    run_arguments,
    section,
    section_options,
)
from hpc_hsdp.plan.mixture import Mixture, is_mixture, parse_mixture
from hpc_hsdp.plan.replica_groups import replica_shape
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
from hpc_hsdp.plan.stage_dir import STAGE_AUTO, check_stage_value
from hpc_hsdp.plan.switches import TOPOLOGY_MODES
from hpc_hsdp.plan.topology import TopologyPlan, check_sizes, format_tasks_per_node, plan_for

NO_STAGE = "none"
"""``--stage-data none``: read ``--data`` where it lies (the field holds None)."""
_LOGS_IN_RUN_DIR = "--run-dir (logs go to <run-dir>/logs)"

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


@section("run.training", reaches=RUN_ARGUMENT, commands=ON_EVERY_TASK)
class TrainingSpec:
    """The training loop's options (``hpc-hsdp run``, ``render``, ``submit``, config files).

    Each field is one option, declared once in :mod:`hpc_hsdp.job.options` (``_training``):
    ``--seq-len`` on the command line, ``seq_len`` (or ``seq-len``) in a config file, the same
    keyword in the Python API.
    """

    model: str = option_field(
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
        check_model(self.model)
        if self.width % self.heads:
            raise SpecError(
                f"--width {self.width} is not divisible by --heads {self.heads}; pick a width that is a multiple of it"
            )
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
        object.__setattr__(self, "tracker", ",".join(tracker_names(self.tracker)) or NO_TRACKER)
        if self.checkpoint_store is not None:
            from hpc_hsdp.rundir.checkpoint_store import parse_store_url  # noqa: PLC0415 - only with a store

            object.__setattr__(self, "checkpoint_store", str(parse_store_url(self.checkpoint_store)))
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
        return [
            arg
            for declared in section_options(TrainingSpec)
            for arg in run_arguments(declared, getattr(self, declared.attribute))
        ]

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
        if self.device == "cpu" and self.training.precision == "fp8":
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


def _pairs(value: object) -> tuple[tuple[str, object], ...]:
    items = value.items() if isinstance(value, dict) else value
    merged = dict(items)  # a later pair wins
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


SECTIONS: tuple[type, ...] = (JobSpec, RunSpec, TrainingSpec, SchedulerSpec, EnvironmentSpec, LaunchSpec)
"""Every section with option fields, in the order of ``render --help`` (a JobSpec's own, what runs
on each task, the training loop's, the #SBATCH header, the script's environment, the launch):
:mod:`hpc_hsdp.job.options` lists the options from them."""
