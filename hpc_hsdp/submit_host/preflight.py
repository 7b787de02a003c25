"""Before a job waits in the queue: the files and modules its tasks will open, checked on the
machine that submits it (a login node sees the cluster's file systems, and submit already runs
the job's own interpreter). The tasks check the same again before step 1; here a typo in a
path costs a second instead of the queue wait. No torch and no transformers are imported.

``render`` checks none of this: a script may be rendered on a machine that sees none of the
job's files; of it, only :func:`check_tensor_parallel` (an ``hf:`` model's config.json where it
can be read)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from hpc_hsdp.errors import InputNotFound, SpecError
from hpc_hsdp.job.options import TRACKER_PACKAGES, default
from hpc_hsdp.job.training_sections import DataSection, ObservationSection
from hpc_hsdp.models.base import check_data_vocabulary, split_import_name
from hpc_hsdp.models.hf import DATA_VOCABULARY_FIX, config_values
from hpc_hsdp.models.hf_shapes import GPT2_STYLE, tp_dims_from_config
from hpc_hsdp.plan.mixture import check_batch, used_once_text
from hpc_hsdp.plan.shapes import builtin_tp_dims, tp_refusal
from hpc_hsdp.plan.staging_dir import DIR_HINT, STAGE_AUTO, stage_base
from hpc_hsdp.rundir.checkpointing.state import check_data_position, run_dir_state, saved_train_state

INSTALL_OR_RENAME = "install it in the job's environment or fix the name (module:function)"
AFTER = (
    "; nothing submitted (submit looks for the job's files on this machine; for files that only the compute "
    "nodes see, render the script and sbatch it)"
)


def check_job_inputs(spec, *, own_function: bool = False, state=None) -> str | None:
    """The model, ``--data`` and ``--val-data`` of the built-in loop, or ``--entry``; a
    :class:`SpecError` (exit 2) names the first that the tasks could not use. With an
    ``--entry`` or a Python function of the user's, that function decides what it opens.
    ``state``: the run directory's :func:`~hpc_hsdp.rundir.checkpointing.state.run_dir_state`, when read already.
    Returns a line to show for a ``--data`` mixture (after how many steps each source is used
    once), else None."""
    if spec.run.entry is not None:
        check_importable("--entry", spec.run.entry, fix=INSTALL_OR_RENAME)
    if spec.run.entry is not None or own_function:
        return None
    training = spec.run.training
    note = sources = None
    try:
        model_vocab_size = _model_vocab_size(training.model.name)
        num_samples = None
        if training.dataset.mixture is not None:
            num_samples, sources, note = _check_mixture(
                training, world_size=spec.world_size, model_vocab_size=model_vocab_size
            )
        elif training.dataset.data is not None:
            num_samples = _check_data(training, world_size=spec.world_size, model_vocab_size=model_vocab_size)
        if training.model.name == "builtin" and training.dataset.data is not None and spec.run.tp_size > 1:
            _check_data_vocabulary_splits(training, spec.run.tp_size)
        _check_resume(spec, num_samples, state, sources)
    except InputNotFound as exc:  # what is not here may be on the compute nodes; other findings are the job's own
        raise SpecError(f"{exc}{AFTER}") from None
    except SpecError as exc:  # the job's own finding: the hint about where submit looks does not concern it
        raise SpecError(f"{exc}; nothing submitted") from None
    return note


def tensor_parallel_refusal(
    training, tp_size: int, *, data_vocab_size: int | None = None, config_optional: bool = False
) -> str | None:
    """Why ``training``'s model cannot be split over ``tp_size`` ranks (None: it can, or only the
    tasks can tell): the built-in model from its options (its vocabulary is the data's when
    ``--data`` is given: ``data_vocab_size``, else not checked), an ``hf:`` model from its
    config.json (``config_optional``: a config.json that cannot be read here is left to the
    tasks), a ``MODULE:FUNCTION`` model never (its plan is the factory's; the tasks check it).
    The sizes are checked by :func:`hpc_hsdp.plan.shapes.tp_refusal`."""
    if tp_size == 1:
        return None
    model = training.model.name
    if model == "builtin":
        vocab = data_vocab_size if training.dataset.data is not None else training.model.vocab_size
        dims = builtin_tp_dims(
            heads=training.model.heads, width=training.model.width, vocab_size=vocab, seq_len=training.dataset.seq_len
        )
        return tp_refusal(dims, tp_size)
    if model.startswith("hf:"):
        try:
            values = config_values(model)
        except SpecError:
            if config_optional:
                return None
            raise
        if values.get("model_type") in GPT2_STYLE:  # transformers gives these no tensor-parallel plan
            return (
                f"--tp {tp_size}: --model {model} ({values['model_type']}) has no tensor-parallel plan in "
                f"transformers (no base_model_tp_plan); train it with --tp 1, or use a model of the Llama family"
            )
        config_dims = tp_dims_from_config(values, model=f"--model {model}")
        return tp_refusal(config_dims, tp_size) if config_dims is not None else None
    return None


def check_tensor_parallel(spec, *, own_function: bool = False, config_optional: bool = False) -> None:
    """``--tp``'s refusal (:func:`tensor_parallel_refusal`) as a :class:`SpecError`, before anything
    is written or submitted; none with ``--entry`` or a Python function of the user's (what they
    train is theirs)."""
    if spec.run.tp_size == 1 or spec.run.entry is not None or own_function:
        return
    refusal = tensor_parallel_refusal(spec.run.training, spec.run.tp_size, config_optional=config_optional)
    if refusal:
        raise SpecError(refusal)


def check_stage_dir(dataset: DataSection, env=None) -> None:
    """``--stage-data DIR``, where this machine can tell (``render`` and ``submit``): a directory
    this user can write, or one that can be made (its nearest existing parent is a directory). A
    DIR that does not exist here is the nodes' to make (node-local disks are mounted there);
    ``auto`` and a DIR naming a variable are resolved on the nodes, which say what is wrong.
    Raises :class:`SpecError` (one line, exit 2)."""
    value = dataset.stage_data
    if value is None or value == STAGE_AUTO or "$" in value:
        return
    path = stage_base(value, os.environ if env is None else env)
    if path.exists() and not path.is_dir():
        raise SpecError(f"--stage-data {value!r} is not a directory; {DIR_HINT}")
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK) or not _can_write_in(path):
            raise SpecError(f"--stage-data {value!r} is not writable by you; {DIR_HINT}")
        return
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise SpecError(f"--stage-data {value!r}: {parent} is not a directory; {DIR_HINT}")


def _can_write_in(directory: Path) -> bool:
    """A file can be made in ``directory`` (root passes every access check; a read-only mount does not)."""
    import tempfile  # noqa: PLC0415 - only with --stage-data DIR

    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def check_trackers(observation: ObservationSection) -> None:
    """Each tracker ``--tracker`` asks for has its package here (found, not imported: wandb and
    mlflow take a second each to import); a :class:`SpecError` names the first that has not.
    The default (TensorBoard alone) is not asked for: without its package the run says so once
    and goes on, as it always has."""
    if observation.tracker == default("tracker"):
        return
    for name in observation.trackers:
        module, extra = TRACKER_PACKAGES[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise SpecError(
                f"--tracker {name}: the {module} package is not installed for {sys.executable}; pip install "
                f"'hpc-hsdp[{extra}]' in the job's environment, or leave {name} out of --tracker; nothing submitted"
            )


def check_checkpoint_store(spec) -> str | None:
    """``--checkpoint-store``, on the machine that submits (which reads the same AWS variables and
    files as the tasks): the extra installed, the bucket there and writable with these credentials
    (one small object written and deleted). SpecError (one line, exit 2) before anything is written
    or queued; a job whose store already holds its last step is refused as its run directory
    would be. Returns what the store holds, for the lines submit prints (None: no store)."""
    url = spec.run.training.checkpoint.checkpoint_store
    if url is None:
        return None
    from hpc_hsdp.rundir.checkpointing.checkpoint_store import CheckpointStore, StoreError  # noqa: PLC0415 - only with a store

    try:
        store = CheckpointStore.open(url, quick=True)
        store.check_writable()
        committed, _ = store.listing()
    except SpecError as exc:
        raise SpecError(f"{exc}; nothing submitted") from None
    except (StoreError, OSError) as exc:
        raise SpecError(f"--checkpoint-store {url} could not be listed ({exc}); nothing submitted") from None
    steps = spec.run.training.optimizer.steps
    if committed and committed[-1] >= steps:
        raise SpecError(
            f"--checkpoint-store {url} already holds step {committed[-1]} committed (--steps {steps}): nothing to "
            f"train, nothing submitted; extend the run with --steps N (N > {committed[-1]}) or give another prefix"
        )
    if committed:
        return f"{url} has step {committed[-1]} committed: the job resumes from it unless the run directory has a newer one"
    return None


def check_stores_apart(specs) -> None:
    """The points of a sweep never share a ``--checkpoint-store`` prefix (each would take the others'
    checkpoints for its own)."""
    urls = [
        spec.run.training.checkpoint.checkpoint_store for spec in specs if spec.run.training.checkpoint.checkpoint_store
    ]
    if len(set(urls)) < len(urls):
        raise SpecError(
            "--checkpoint-store with --sweep: the points would share one prefix and resume from each other's "
            "checkpoints; sweep the prefix too (checkpoint_store = [...] in the sweep) or leave it out"
        )


def check_importable(option: str, value: str, *, fix: str) -> None:
    """``MODULE:FUNCTION``'s module can be found by this interpreter (found, not imported)."""
    module = split_import_name(option, value)[0]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise InputNotFound(f"{option} {value!r}: module {module!r} cannot be imported here; {fix}")


def _model_vocab_size(model: str) -> int | None:
    """The embedding's rows where config.json says them (``hf:PATH``); None where only the
    built model knows (the built-in model takes the data's vocabulary; a factory's module)."""
    if model.startswith("hf:"):
        vocab_size = config_values(model).get("vocab_size")
        return vocab_size if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) else None
    if model != "builtin":
        check_importable("--model", model, fix=INSTALL_OR_RENAME)
    return None


def _check_data_vocabulary_splits(training, tp_size: int) -> None:
    """The built-in model takes the data's vocabulary: ``--tp`` must divide it."""
    from hpc_hsdp.data.tokens import open_dataset  # noqa: PLC0415 - numpy loads only for a job with token data

    path = training.dataset.mixture.sources[0].path if training.dataset.mixture is not None else training.dataset.data
    vocab = open_dataset(path, split="train").vocab_size or training.model.vocab_size
    refusal = tensor_parallel_refusal(training, tp_size, data_vocab_size=vocab)
    if refusal:
        raise SpecError(refusal)


def _check_data(training, *, world_size: int, model_vocab_size: int | None) -> int:
    """The checks of the loop's ``check_data``; returns the training split's number of samples."""
    from hpc_hsdp.data.sampler import num_samples  # noqa: PLC0415 - numpy loads only for a job with token data
    from hpc_hsdp.data.tokens import check_token_data, open_dataset, open_eval_dataset  # noqa: PLC0415 - numpy loads only for a job with token data

    train = open_dataset(training.dataset.data, split="train")
    if training.model.name == "builtin":
        model_vocab_size = train.vocab_size or training.model.vocab_size  # what the built-in model is built with
    elif model_vocab_size is not None:
        check_data_vocabulary(
            training.model.name,
            model_vocab_size=model_vocab_size,
            data_vocab_size=train.vocab_size,
            fix=DATA_VOCABULARY_FIX,
        )
    check_token_data(
        train,
        val=open_eval_dataset(training.dataset.data, training.dataset.val_data)
        if training.evaluation.eval_every
        else None,
        model_vocab_size=model_vocab_size,
        seq_len=training.dataset.seq_len,
        global_batch=training.dataset.global_batch(world_size),
    )
    return num_samples(train.num_tokens, training.dataset.seq_len)


def _check_mixture(training, *, world_size: int, model_vocab_size: int | None) -> tuple[int, dict, str]:
    """A mixture's sources, each checked as ``--data`` is; returns (all samples, the sources
    for the resume check, the line of steps until each is used once)."""
    from hpc_hsdp.data.sampler import num_samples  # noqa: PLC0415 - numpy loads only for a job with token data
    from hpc_hsdp.data.tokens import check_token_data, open_dataset, open_eval_dataset  # noqa: PLC0415 - numpy loads only for a job with token data

    mixture = training.dataset.mixture
    global_batch = training.dataset.global_batch(world_size)
    check_batch(mixture, global_batch)
    sizes, vocabularies = [], set()
    for source in mixture.sources:
        train = open_dataset(source.path, split="train")
        vocabularies.add(train.vocab_size)
        vocab = model_vocab_size
        if training.model.name == "builtin":
            vocab = train.vocab_size or training.model.vocab_size
        elif model_vocab_size is not None:
            check_data_vocabulary(
                training.model.name,
                model_vocab_size=model_vocab_size,
                data_vocab_size=train.vocab_size,
                fix=DATA_VOCABULARY_FIX,
            )
        check_token_data(
            train,
            val=open_eval_dataset(source.path) if training.evaluation.eval_every else None,
            model_vocab_size=vocab,
            seq_len=training.dataset.seq_len,
            global_batch=1,
        )
        sizes.append(num_samples(train.num_tokens, training.dataset.seq_len))
    if len(vocabularies) > 1:
        raise SpecError(
            f"--data mixture: the sources were tokenized with different vocabularies ({sorted(vocabularies)}); "
            f"prepare every source with the same --tokenizer"
        )
    sources = {s.name: (s.weight_text or str(s.weight), n) for s, n in zip(mixture.sources, sizes)}
    return sum(sizes), sources, used_once_text(mixture, tuple(sizes), global_batch, training.optimizer.steps)


def _check_resume(spec, num_samples: int | None, state, sources: dict | None = None) -> None:
    """Into a run directory with a checkpoint the job resumes: the checkpoint's data position
    must continue with this job's global batch, seed and data, as the tasks check on resuming.
    ``num_samples``: the training data's (None: synthetic tokens)."""
    state = state or run_dir_state(spec.run.run_dir)
    if state.checkpoint is None:
        return
    try:
        saved = saved_train_state(state.checkpoint).get("data")
    except (OSError, ValueError, AttributeError):
        return  # the tasks say what is wrong with it
    if not isinstance(saved, dict) or not {"global_batch", "seed", "num_samples"} <= saved.keys():
        return  # no data position saved (a function of the user's wrote it): nothing to continue
    if num_samples is None:
        from hpc_hsdp.data.synthetic import NUM_SAMPLES  # noqa: PLC0415 - numpy loads only for a job with token data

        num_samples = NUM_SAMPLES
    training = spec.run.training
    check_data_position(
        saved,
        global_batch=training.dataset.global_batch(spec.world_size),
        num_samples=num_samples,
        seed=training.optimizer.seed,
        where=f"checkpoint {Path(state.checkpoint).name} (step {state.resume_step})",
        sources=sources,
    )


def check_partition(spec, scheduler) -> None:
    """A ``--partition`` that ``scheduler`` (the :class:`~hpc_hsdp.scheduler.backends.base.Backend` the job
    goes to) does not have: refused before anything is written, naming the ones it has."""
    scheduler.check_partition(spec)


def check_fp8_gpus(spec, scheduler) -> None:
    """``--precision fp8`` refused (:class:`SpecError`, one line) when the GPUs the job's tasks
    will get from ``scheduler`` (its :class:`~hpc_hsdp.scheduler.backends.base.Backend`) are known to
    lack Float8: the local emulator's are this machine's; a SLURM job's are those of its
    partition's nodes. Known-new or unknown GPU types go on: each task checks its own GPU at its
    start (:func:`~hpc_hsdp.task.parallelism.device.check_training_device`)."""
    if (
        spec.run.training.compute.precision != "fp8" or spec.run.device == "cpu"
    ):  # with --device cpu the spec refused it
        return
    refusal = scheduler.fp8_refusal(spec)
    if refusal is not None:
        raise SpecError(refusal)
