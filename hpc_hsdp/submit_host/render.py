"""The sbatch script of a job: a pure function of its :class:`~hpc_hsdp.job.spec.JobSpec`.

``render_sbatch(spec)`` fills ``templates/job.sbatch.j2`` (or the user's ``spec.template``)
through a Jinja2 environment with ``StrictUndefined`` (a missing variable is an error,
never an empty string), ``keep_trailing_newline`` and two quoting filters:

``q``
    ``shlex.quote``: every value that reaches the shell goes through it (the raw
    ``--setup`` lines are the one exception, by design).
``sbatch_q``
    quoting for ``#SBATCH`` lines, which the shell never parses but sbatch does: values
    outside ``[A-Za-z0-9_@%+=:,./-]`` are written in double quotes with ``\\`` and ``"``
    escaped, which sbatch 22.05 reads back unchanged (spaces, quotes, ``#``, ``$()``).

Variables every template gets (a ``--template`` of your own gets the same; it may also
``{% extends "job.sbatch.j2" %}`` and override the blocks ``header``, ``setup``,
``signals``, ``rendezvous``, ``launch``, ``footer``):

===================  =====================================================================
``spec``             the JobSpec
``plan``             its TopologyPlan (``plan.mesh_shape``, ``plan.shard_groups``, ...)
``plan_command``     ``hpc-hsdp plan ...`` that shows the same layout (a comment line)
``sbatch_options``   ``[(key, value or None), ...]``: the #SBATCH lines, in a fixed order
``settings``         ``[(name, value), ...]``: NCCL/torch defaults (``--debug`` adds more)
``python``           interpreter name the script calls (``spec.environment.python``)
``log_dir``          ``<run_dir>/logs``
``srun_options``     ``["--kill-on-bad-exit=1", ...]``: srun's options, unquoted (use ``q``)
``warning_signal``   name of the ``--signal`` warning (``USR2``): exported to the tasks as
                     ``HPC_HSDP_WARNING_SIGNAL`` and trapped by the batch shell
``switches_command`` the batch shell's ``python -m hpc_hsdp layout --field node_switches ...``
                     (every node's switches; with ``--topology strict`` the check), or None
                     where the job orders no nodes by switch (one node, ``--topology off``)
``snapshot_dir``     ``<run_dir>/code`` with ``--snapshot-code`` (checked, then its private copy first on ``PYTHONPATH``), else None
``snapshot_sha256``  the SHA-256 of that copy submit recorded ("" where render made no copy)
``launch_command``   the shell text srun runs, ready (already quoted): the default
                     ``python -m hpc_hsdp run ...`` / ``bash -c 'exec torchrun ...'``, or
                     the override given to :func:`render_sbatch`
===================  =====================================================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import shlex
from pathlib import Path

import jinja2
import jinja2.sandbox

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.options import sbatch_lines
from hpc_hsdp.job.spec import DEFAULT_SIGNAL, TORCHRUN_SIGNALS, TORCHRUN_SIGNALS_VAR, JobSpec
from hpc_hsdp.plan.replica_layout import REPLICA_TAG
from hpc_hsdp.plan.switches import NODE_SWITCHES_ENV
from hpc_hsdp.plan.topology import format_tasks_per_node

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
DEFAULT_TEMPLATE = "job.sbatch.j2"

_SBATCH_PLAIN = r"^[A-Za-z0-9_@%+=:,./-]+$"


def shell_quote(value: object) -> str:
    """``shlex.quote`` for the template; refuses None (a missing value must not become 'None')."""
    if value is None:
        raise SpecError("a template quoted a value that is None; guard it with {% if ... is not none %}")
    return shlex.quote(str(value))  # str() of a StrictUndefined raises its "is undefined" error


def sbatch_quote(value: object) -> str:
    """Quote one ``#SBATCH --key=VALUE`` value so that sbatch reads it back unchanged."""
    if value is None:
        raise SpecError("a template quoted an #SBATCH value that is None; guard it with {% if ... is not none %}")
    text = str(value)
    if "\n" in text or "\r" in text or "\0" in text:
        raise SpecError(f"#SBATCH value {text!r} contains a line break or NUL; sbatch would misread it")
    if re.match(_SBATCH_PLAIN, text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    """Compiled templates cached in jinja2's per-user temp directory (mode 0700, owner
    checked; keyed by the template's path, validated by its source checksum and the
    jinja2/Python versions). Compiling the template is most of ``render``'s own start-up
    time (~11 ms); the output is the same with or without the cache."""
    try:
        return _SafeBytecodeCache(pattern="__hpc_hsdp_jinja2_%s.cache")
    except (OSError, RuntimeError):  # no usable temp directory: compile every time
        return None


class _SafeBytecodeCache(jinja2.FileSystemBytecodeCache):
    """A cache that never fails a render: unreadable or unwritable entries are skipped."""

    def load_bytecode(self, bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # a corrupt or foreign entry: recompile
            bucket.reset()

    def dump_bytecode(self, bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


def template_environment(template_dir: str | Path | None = None) -> jinja2.Environment:
    """The Jinja2 environment: the user's template directory first (when given), then the
    packaged templates, so a user's template can extend ``job.sbatch.j2``.

    A template is text, not code: every one (shipped or the user's) renders in Jinja2's
    immutable sandbox, where attributes such as ``__globals__`` or ``__init__`` and calls that
    change the context are refused (``jinja2.sandbox.SecurityError``)."""
    loaders: list[jinja2.BaseLoader] = []
    if template_dir is not None:
        loaders.append(jinja2.FileSystemLoader(str(template_dir)))
    loaders.append(jinja2.FileSystemLoader(str(TEMPLATE_DIR)))
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        loader=jinja2.ChoiceLoader(loaders),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
        bytecode_cache=_bytecode_cache(),
    )
    env.filters["q"] = shell_quote
    env.filters["sbatch_q"] = sbatch_quote
    return env


def sbatch_options(spec: JobSpec) -> list[tuple[str, str | None]]:
    """The #SBATCH options: the lines the job options declare (:func:`~hpc_hsdp.job.options.sbatch_lines`),
    in their order, then the ``--sbatch`` passthrough, by key."""
    options: list[tuple[str, str | None]] = []
    for line in sbatch_lines():
        assert callable(line.value)  # a declared option's key: JobOption made OWN_VALUE its field's getter
        value = line.value(spec)
        if value is None or value is False:
            continue
        options.append((line.name, None if value is True else str(value)))
    return options + list(spec.scheduler.extra)


def workers_per_task(spec: JobSpec) -> int:
    """Ranks one srun task runs: 1 (srun launcher) or the node's GPUs (torchrun)."""
    return spec.gpus_per_node if spec.launch.launcher == "torchrun" else 1


def cpu_share(spec: JobSpec) -> dict | None:
    """Without ``--cpus-per-task``: the script gives each task ``SLURM_CPUS_ON_NODE / tasks``
    CPUs (``tasks``: the most tasks on one node). None when ``--cpus-per-task`` is given."""
    if spec.scheduler.cpus_per_task is not None:
        return None
    tasks = 1 if spec.launch.launcher == "torchrun" else max(spec.tasks_per_node)
    return {"tasks": tasks, "workers": workers_per_task(spec)}


CHECK_ENTRY = "hpc_hsdp.task.fabric_check:run_check"
"""The fabric check's ``--entry`` (``hpc-hsdp check``, the check step of ``submit --check``)."""


def check_nccl_settings(spec: JobSpec) -> list[tuple[str, str]]:
    """What the check's tasks set on GPUs so that NCCL says which network it chose, in files of the
    job's log directory that the check's rank 0 reads (:func:`hpc_hsdp.plan.fabric_check_rounds.nccl_transport`)."""
    if spec.run.device == "cpu":
        return []
    return [
        ("NCCL_DEBUG", "INFO"),
        ("NCCL_DEBUG_SUBSYS", "INIT,NET"),
        ("NCCL_DEBUG_FILE", f"{spec.log_dir}/nccl-check.%h.%p"),
    ]


def torch_settings(spec: JobSpec) -> list[tuple[str, str]]:
    """NCCL and torch variables the script exports before the user's ``--env`` (which wins).
    torch's own default of ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` (tear down on a failed or
    timed-out collective) is left alone."""
    cpus = spec.scheduler.cpus_per_task
    # the share of CPUs is room for each rank's Python, data loading and NCCL threads; OpenMP
    # stays at one thread per rank (torchrun's default) unless --cpus-per-task says more
    threads = max(1, cpus // workers_per_task(spec)) if cpus is not None else 1
    settings = [("OMP_NUM_THREADS", str(threads))]
    settings += [
        ("PYTHONUNBUFFERED", "1"),
        ("NCCL_DEBUG", "INFO" if spec.environment.debug else "WARN"),
        # submitit's INFO lines (started, pickle loaded, completed, exiting) fill every task's log alike:
        # 64 of the demo's 130 lines of `logs --tail 5`; its warnings and errors still show
        ("SUBMITIT_LOG_LEVEL", "INFO" if spec.environment.debug else "WARNING"),
    ]
    if spec.launch.check or spec.run.entry == CHECK_ENTRY:
        from hpc_hsdp.plan.fabric_check_rounds import THRESHOLD_ENV  # noqa: PLC0415  (--check only: render's start-up stays lean)

        settings.append((THRESHOLD_ENV, f"{spec.launch.check_threshold:g}"))
    if spec.run.entry == CHECK_ENTRY:  # hpc-hsdp check: the job is the check
        settings += check_nccl_settings(spec)
    if spec.run.device == "cpu":
        # FSDP's per-step buffers of a large model on CPU are fresh mappings every step, whose
        # pages the kernel faults in and zeroes again; transparent huge pages for malloc's
        # mappings cut that (benchmarks/RESULTS.md 8: 2.8 M faults -> 0.13 M, step 0.86x).
        # Read by glibc when the process starts; it ignores what it does not know.
        settings.append(("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1"))
    if spec.environment.debug:
        settings += [
            ("NCCL_DEBUG_SUBSYS", "INIT,NET,ENV"),
            ("TORCH_DISTRIBUTED_DEBUG", "DETAIL"),
            ("TORCH_CPP_LOG_LEVEL", "INFO"),
            ("TORCH_SHOW_CPP_STACKTRACES", "1"),
            ("PYTHONFAULTHANDLER", "1"),
        ]
    return settings


def warning_signal_name(spec: JobSpec) -> str:
    """The name (``USR2``) of the job's warning signal, from ``--signal [R:|B:]SIG@SECONDS``;
    the default's when the job has none (the tasks still save on it, e.g. ``scancel --signal``)."""
    value = spec.scheduler.signal or DEFAULT_SIGNAL
    name = value.rsplit(":", 1)[-1].split("@", 1)[0].upper()
    name = name[3:] if name.startswith("SIG") else name
    if name.isdigit():
        import signal  # noqa: PLC0415 - only for a numeric --signal: its enum costs every render a millisecond

        try:
            name = signal.Signals(int(name)).name[3:]
        except ValueError:
            pass
    return name


def srun_options(spec: JobSpec, *, log_job: str = "%j") -> list[str]:
    """srun's options, unquoted, one per item (``--output=...``: one word each). ``log_job``: the
    job in the logs' names (``%A_%a`` for a sweep's point: its array task, as its job record names it)."""
    opts = ["--kill-on-bad-exit=1", "--unbuffered"]
    if spec.ntasks is not None:
        opts += [f"--ntasks={spec.ntasks}", "--distribution=arbitrary"]  # the hostfile says where each task goes
    else:
        opts.append(f"--distribution={spec.launch.distribution}")
    if spec.scheduler.cpus_per_task is not None:
        opts.append(f"--cpus-per-task={spec.scheduler.cpus_per_task}")  # not inherited by srun in Slurm 22.05
    # a replica group's step: its own log files (the supervisor fills in the group and its start)
    tag = f"{REPLICA_TAG}_" if spec.replicas is not None else ""
    opts += [f"--output={spec.log_dir}/{log_job}_{tag}%t_log.out", f"--error={spec.log_dir}/{log_job}_{tag}%t_log.err"]
    return opts + container_options(spec)


def check_step(spec: JobSpec) -> dict | None:
    """``--check``: the check step's srun options (unquoted) and command (ready shell text), and the
    batch shell's verdict command; None without ``--check``. The check runs one task per GPU on every
    node of the allocation (spares too) with ``--shard 1``, whatever the training's launcher."""
    if not spec.launch.check:
        return None
    q = shlex.quote
    opts = [o for o in srun_options(spec) if not o.startswith(("--output=", "--error="))]
    if spec.launch.launcher == "torchrun" and spec.ntasks is None:
        opts.append(f"--ntasks-per-node={spec.gpus_per_node}")
    opts += [f"--output={spec.log_dir}/%j_check_%t_log.out", f"--error={spec.log_dir}/%j_check_%t_log.err"]
    run = dataclasses.replace(spec.run, shard_size=1, tp_size=1, entry=CHECK_ENTRY, topology="off")
    argv = [spec.environment.python, "-m", "hpc_hsdp", "run", *run.to_args()]
    verdict = [
        spec.environment.python,
        "-m",
        "hpc_hsdp.batch_shell.fabric_check_verdict",
        spec.run.run_dir,
        str(spec.nodes),
    ]
    return {
        "srun_options": opts,
        "command": " ".join(q(a) for a in argv),
        "verdict": " ".join(q(a) for a in verdict),
        "threshold": spec.launch.check_threshold,
        "env": check_nccl_settings(spec),
        "nodes": spec.nodes,
        # the allocation's SLURM_NTASKS counts the spares' tasks: the training step says its own
        "ntasks": spec.nodes if spec.launch.launcher == "torchrun" else spec.world_size,
    }


def replica_command(spec: JobSpec) -> str | None:
    """``python -m hpc_hsdp.batch_shell.replica_supervisor ...`` (without the srun options and launch command that
    follow it), the batch shell's supervisor of a fault-tolerant job; None without one."""
    shape = spec.replicas
    if shape is None:
        return None
    training = spec.run.training
    argv = [
        spec.environment.python,
        "-m",
        "hpc_hsdp.batch_shell.replica_supervisor",
        f"--groups={shape.num_groups}",
        f"--nodes-per-group={shape.nodes_per_group}",
        f"--tasks-per-node={spec.gpus_per_node}",
        f"--spare-nodes={spec.spare_nodes}",
        f"--min-replicas={training.resilience.min_replicas}",
        f"--quorum-timeout={training.resilience.quorum_timeout:g}",
        f"--run-dir={spec.run.run_dir}",
        f"--steps={training.optimizer.steps}",
        "--",
    ]
    return " ".join(shlex.quote(a) for a in argv)


CONTAINER_NAME = "hpc-hsdp"
"""Pyxis ``--container-name``: the batch shell's layout step and the launch step share one
container per node (imported once); pyxis removes it when the job ends."""


def container_options(spec: JobSpec) -> list[str]:
    """Pyxis options of every srun step that runs inside the image; [] without one."""
    if spec.launch.container_image is None:
        return []
    opts = [f"--container-image={spec.launch.container_image}", f"--container-name={CONTAINER_NAME}"]
    if spec.launch.container_mounts is not None:
        opts.append(f"--container-mounts={spec.launch.container_mounts}")
    return opts


def layout_command(spec: JobSpec, *layout_args: str) -> str:
    """``python -m hpc_hsdp layout ARGS`` as the batch shell runs it: directly, or in a
    one-task step inside the container (where hpc-hsdp is installed, not on the host)."""
    q = shlex.quote
    argv = [spec.environment.python, "-m", "hpc_hsdp", "layout", *layout_args]
    if spec.launch.container_image is not None:
        argv = [
            "srun",
            "--nodes=1",
            "--ntasks=1",
            "--cpus-per-task=1",
            "--kill-on-bad-exit=1",
            *container_options(spec),
            *argv,
        ]
    return " ".join(q(a) for a in argv)


def switches_command(spec: JobSpec) -> str | None:
    """``python -m hpc_hsdp layout --field node_switches``, which the batch shell exports to every
    task as ``HPC_HSDP_NODE_SWITCHES``; with ``--topology strict`` it also refuses (exit 2, one
    line) shard groups that must cross leaf switches. None for one node or ``--topology off``."""
    topology = spec.run.topology
    if topology == "off" or spec.nodes + spec.spare_nodes < 2:
        return None
    args = ["--field", "node_switches"]
    if topology == "strict":
        counts = ",".join(map(str, spec.tasks_per_node)) if spec.ntasks is not None else str(spec.gpus_per_node)
        args += ["--topology", topology, "--shard", str(spec.run.shard_size), "--tasks-per-node", counts]
        if spec.run.tp_size > 1:  # one copy of the model is then S x T consecutive ranks
            args += ["--tp", str(spec.run.tp_size)]
    command = layout_command(spec, *args)
    if spec.launch.container_image is not None:  # the image has no scontrol: the host's answer goes in
        command += ' --scontrol-topology "$(scontrol show topology 2>/dev/null)"'
    return command


def default_launch_command(spec: JobSpec) -> str:
    """What srun runs on each task, as ready shell text.

    srun: ``python -m hpc_hsdp run <RunSpec args>`` (one task per GPU; the task derives its
    node-major rank itself). torchrun: ``bash -c 'trap "" SIG; exec torchrun ... -m hpc_hsdp run ...'``
    (one task per node), with a static rendezvous whose ``--node-rank`` comes from the
    layout, so ranks follow node order; never c10d.
    """
    q = shlex.quote
    python = spec.environment.python
    run_argv = ["-m", "hpc_hsdp", "run", *spec.run.to_args()]
    if spec.launch.launcher == "srun":
        return " ".join(q(a) for a in [python, *run_argv])
    layout_argv = [
        python,
        "-m",
        "hpc_hsdp",
        "layout",
        "--shard",
        str(spec.run.shard_size),
        "--nproc-per-node",
        str(spec.gpus_per_node),
        *(["--topology", spec.run.topology] if spec.run.topology != "auto" else []),
        "--field",
        "node_rank",
    ]
    inner = [
        # torchrun's agent would die of the warning signal (Python's default action) and end
        # the job on QUIT (its own handler); the workers get both from SLURM directly and
        # handle them (save; print stacks)
        'trap "" "$HPC_HSDP_WARNING_SIGNAL" QUIT;',
        f"{TORCHRUN_SIGNALS_VAR}={TORCHRUN_SIGNALS}",
        "exec",
        "torchrun",
        '--nnodes="$SLURM_JOB_NUM_NODES"' if spec.flexible else f"--nnodes={spec.nodes}",
        f"--nproc-per-node={spec.gpus_per_node}",
        f'--node-rank="$({" ".join(q(a) for a in layout_argv)})"',
        '--master-addr="$MASTER_ADDR"',
        '--master-port="$MASTER_PORT"',
        "--rdzv-backend=static",
        *(q(a) for a in run_argv),
    ]
    return "bash -c " + q(" ".join(inner))


def plan_command(spec: JobSpec) -> str:
    """The ``hpc-hsdp plan`` command that shows this job's layout."""
    if spec.ntasks is not None:
        args = ["--tasks-per-node", format_tasks_per_node(spec.tasks_per_node)]
    else:
        args = ["--nodes", spec.nodes_text, "--gpus-per-node", str(spec.gpus_per_node)]
    args += ["--shard", str(spec.run.shard_size)]
    if spec.run.tp_size > 1:
        args += ["--tp", str(spec.run.tp_size)]
    return " ".join(shlex.quote(a) for a in ["hpc-hsdp", "plan", *args])


def snapshot_dir(spec: JobSpec) -> str | None:
    """``<run_dir>/code``, the copy of the code ``--snapshot-code`` takes at submit; None without it."""
    if not spec.environment.snapshot_code:
        return None
    from hpc_hsdp.rundir.lifecycle.provenance_record import snapshot_path  # noqa: PLC0415  (--snapshot-code only)

    return str(snapshot_path(spec.run.run_dir.rstrip("/")))


RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")
UNSET_ON_ENTRY = (*RENDEZVOUS_VARIABLES, NODE_SWITCHES_ENV)
"""Unset when the script starts (a submitting shell's stale values travel with
``--export=ALL``); ``--env``, ``--pass-env`` and ``--setup`` lines may set them on purpose."""


def template_context(
    spec: JobSpec, *, launch_command: str | None = None, log_job: str = "%j", snapshot_sha256: str | None = None
) -> dict:
    """The variables a template gets (see the module docstring)."""
    if launch_command is not None:
        if not isinstance(launch_command, str) or not launch_command.strip():
            raise SpecError(f"launch_command {launch_command!r} must be non-empty shell text")
        if "\n" in launch_command or "\r" in launch_command or "\0" in launch_command:
            raise SpecError(f"launch_command {launch_command!r} must be one line (no line break or NUL)")
    return {
        "spec": spec,
        "plan": spec.plan,
        "plan_command": plan_command(spec),
        "sbatch_options": sbatch_options(spec),
        "settings": torch_settings(spec),
        "python": spec.environment.python,
        "log_dir": spec.log_dir,
        "srun_options": srun_options(spec, log_job=log_job),
        "cpu_share": cpu_share(spec),
        "unset_on_entry": [name for name in UNSET_ON_ENTRY if name not in spec.environment.pass_env],
        "rendezvous_command": layout_command(spec, "--field", "rendezvous"),
        "hostfile_command": (
            layout_command(
                spec, "--hostfile", ",".join(map(str, spec.tasks_per_node)), "--distribution", spec.launch.distribution
            )
            if spec.ntasks is not None
            else None
        ),
        "warning_signal": warning_signal_name(spec),
        "switches_command": switches_command(spec),
        "replicas": spec.replicas,
        "replica_command": replica_command(spec),
        "snapshot_dir": snapshot_dir(spec),
        "snapshot_sha256": snapshot_sha256 or "",
        "check": check_step(spec),
        "launch_command": launch_command if launch_command is not None else default_launch_command(spec),
    }


def render_sbatch(
    spec: JobSpec, *, launch_command: str | None = None, log_job: str = "%j", snapshot_sha256: str | None = None
) -> str:
    """The sbatch script of ``spec``. ``snapshot_sha256``: of the ``--snapshot-code`` copy submit
    made, which the job checks before it imports it (without it, as ``render`` has none, the job
    refuses to import ``code/``).

    ``launch_command``: ready shell text (already quoted) that replaces what srun runs on
    each task: the default ``python -m hpc_hsdp run ...`` (srun launcher) or the whole
    ``bash -c '...'`` word (torchrun launcher). Everything else is identical, which lets
    ``submit`` send this text through submitit with ``python -u -m hpc_hsdp.task.submitit_job DIR``
    (submitit's job runner: :mod:`hpc_hsdp.task.submitit_job`).
    """
    if not isinstance(spec, JobSpec):
        raise TypeError(f"render_sbatch takes a JobSpec, got {type(spec).__name__}")
    context = template_context(spec, launch_command=launch_command, log_job=log_job, snapshot_sha256=snapshot_sha256)
    if spec.template is not None:
        path = Path(spec.template)
        if not path.is_file():
            raise SpecError(
                f"--template {spec.template!r} does not exist or is not a file; give the path of a Jinja2 template"
            )
        env, name = template_environment(path.parent), path.name
    else:
        env, name = template_environment(), DEFAULT_TEMPLATE
    try:
        text = env.get_template(name).render(context)
    except jinja2.sandbox.SecurityError as exc:
        raise SpecError(
            f"template {name} did something a template may not ({' '.join(str(exc).split())[:200]}); "
            f"a template may only use the variables and filters listed in hpc_hsdp.submit_host.render"
        ) from None
    except jinja2.TemplateSyntaxError as exc:
        raise SpecError(
            f"template {exc.filename or name} line {exc.lineno}: {str(exc.message).rstrip('.')}; fix the template"
        ) from None
    except jinja2.UndefinedError as exc:
        raise SpecError(
            f"template {name}: {exc.message}; use only the variables listed in hpc_hsdp.submit_host.render"
        ) from None
    except jinja2.TemplateNotFound as exc:
        raise SpecError(
            f"template {name} includes or extends {exc.name!r}, which is neither next to it nor packaged "
            f"({DEFAULT_TEMPLATE}); fix the name"
        ) from None
    except UnicodeDecodeError as exc:
        raise SpecError(
            f"template {name} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from None
    return text if text.endswith("\n") else text + "\n"


SWEEP_TEMPLATE = "sweep.sbatch.j2"
POINT_SCRIPT = "point.sbatch"
"""A sweep point's own script, in its run directory: what ``hpc-hsdp render`` writes for its options."""
POINT_LOG_JOB = "%A_%a"
"""A point's logs are named by its array task (``<array job id>_<index>``), as its job record is."""


MAX_POINT_SCRIPT_BYTES = 4 << 20
"""The most of a point's script a sweep's task reads (SLURM's own default cap of a batch script)."""


def script_sha256(text: str) -> str:
    """The SHA-256 (hex) of a script as written (UTF-8): what a job checks before it runs it."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def render_point(spec: JobSpec, snapshot_sha256: str | None = None) -> str:
    """The script of one sweep point: its job's, logs named by its array task."""
    return render_sbatch(spec, log_job=POINT_LOG_JOB, snapshot_sha256=snapshot_sha256)


def render_sweep(
    specs,
    points,
    *,
    sweep_dir: str,
    mode: str,
    sweep,
    parallelism: int | None,
    indices=None,
    tasks=None,
    array: dict | None = None,
    point_scripts=None,
) -> str:
    """One job array's script: its points' shared ``#SBATCH`` header with ``--array``, its own batch
    logs in ``<sweep-dir>/logs``, and a map from ``SLURM_ARRAY_TASK_ID`` to the point whose
    script (:data:`POINT_SCRIPT`) the task runs. ``tasks``: each point's task id in the array (None:
    its index in the sweep); ``indices``: the tasks of the array (None: every point; a resubmitted
    sweep leaves out the points that completed). ``array``: where the sweep has one array per
    distinct header, which one this is (``number``, ``count``, ``total`` points, what ``differs``).
    ``point_scripts``: each point's script as submit writes it (None: :func:`render_point`'s); the
    array's script carries each one's SHA-256 and runs a point's only when its file still has it."""
    from hpc_hsdp.job.sweep import array_range, shared_header  # noqa: PLC0415  (sweeps only)

    tasks = [point.index for point in points] if tasks is None else list(tasks)
    point_scripts = [render_point(spec) for spec in specs] if point_scripts is None else list(point_scripts)
    header = list(shared_header(sbatch_options(specs[0])))
    logs = f"{sweep_dir}/logs"
    header += [("array", array_range(len(points) if indices is None else indices, parallelism))]
    header += [("output", f"{logs}/%A_%a_batch.out"), ("error", f"{logs}/%A_%a_batch.err")]
    context = {
        "points": list(points),
        "entries": [
            {"task": task, "point": point, "dir": spec.run.run_dir, "sha256": script_sha256(text)}
            for task, point, spec, text in zip(tasks, points, specs, point_scripts)
        ],
        "sbatch_options": header,
        "mode": mode,
        "sweep": list(sweep),
        "parallelism": parallelism,
        "point_script": POINT_SCRIPT,
        "max_point_script_bytes": MAX_POINT_SCRIPT_BYTES,
        "array": array,
    }
    text = template_environment().get_template(SWEEP_TEMPLATE).render(context)
    return text if text.endswith("\n") else text + "\n"
