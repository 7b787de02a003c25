"""What every task runs: ``hpc-hsdp run`` on srun/torchrun, and ``submit`` through submitit.

``run_task`` installs the task's signal handlers (preemption), joins the job
(:func:`hpc_hsdp.task.parallelism.dist.init`), runs ``fn(ctx)``, the ``--entry`` function or the
built-in payload, requeues when a warning signal stopped the run, and always tears the
process group down. ``task_main`` turns a signal stop into the task's exit status.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import NoReturn

from hpc_hsdp.errors import HsdpError, SpecError
from hpc_hsdp.job.spec import RunSpec
from hpc_hsdp.models.base import split_import_name
from hpc_hsdp.plan.topology import RankLayout
from hpc_hsdp.task.observation import log
from hpc_hsdp.task.observation.log import note
from hpc_hsdp.task.resilience import injected_faults
from hpc_hsdp.task.resilience.node_failure import handle_lost_peers
from hpc_hsdp.task.resilience.preemption import NodeRangeKeeper, Preemption


def resolve_entry(entry: str) -> Callable:
    """``module:function`` -> the function (imported now, so a typo fails before training)."""
    module_name, attribute = split_import_name("--entry", entry)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(
            f"--entry {entry!r}: cannot import module {module_name!r} ({exc}); check PYTHONPATH on the nodes"
        ) from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise SpecError(f"--entry {entry!r}: module {module_name!r} has no function {attribute!r}")
    return fn


def run_task(
    spec: RunSpec,
    *,
    fn: Callable | None = None,
    env: Mapping[str, str] | None = None,
    preemption: Preemption | None = None,
    before_join: Callable[[], None] | None = None,
):
    """Run one task of the job; returns ``fn``'s / the entry's result or the payload's summary
    (``{"rank", "world_size", "shard_size", "start_step", "steps", "final_loss", "stopped",
    "stop_reason"}``).

    First of all it installs the task's signal handlers (:mod:`hpc_hsdp.task.resilience.preemption`,
    replacing submitit's) and the test hooks (:mod:`hpc_hsdp.task.resilience.injected_faults`) from ``env``.
    When the ranks stopped on a signal, ``preemption.finish`` runs (rank 0 requeues on the
    warning signal) before the process group is torn down; ``preemption.exit_code()`` then
    says how the task should exit (see :func:`task_main`).
    """
    log.configure()
    env = os.environ if env is None else env
    preemption = preemption if preemption is not None else Preemption(env)
    preemption.install()  # before torch loads: a signal during start-up is recorded, not fatal
    range_keeper = NodeRangeKeeper(env).install()  # a flexible job requeued by SLURM: its node range put back
    injected_faults.install(env)
    try:
        # a job whose mesh cannot be formed (a shard size larger than a node) fails on every task
        # now, before each loads torch; init derives the same layout again
        layout = RankLayout.for_task(
            env, shard_size=spec.shard_size, device=spec.device, topology=spec.topology, tp_size=spec.tp_size
        )
        from hpc_hsdp.task.parallelism.device import check_training_device, pick_device  # noqa: PLC0415 - as init
        from hpc_hsdp.task.parallelism.dist import init  # noqa: PLC0415 - torch loads after the signal handlers

        # what this device cannot train (--compile without a C++ compiler, --precision fp8 without
        # a GPU that has it) is refused before the task joins the job or writes anything
        check_training_device(spec.training.compute, pick_device(spec.device, layout, env)[0], env)
        if before_join is not None:  # `hpc-hsdp run`: rank 0's claim of the run directory, the first thing written
            before_join()

        if fn is None and spec.entry is not None:
            fn = resolve_entry(spec.entry)
        ctx = init(
            spec.shard_size,
            spec.device,
            spec.run_dir,
            spec.timeout_s,
            env=env,
            comm_stats=spec.comm_stats,
            topology=spec.topology,
            tp_size=spec.tp_size,
            spec=spec,
            preemption=preemption,
        )
        with ctx:  # its teardown: the loop's error record and saves in flight, then the process group
            try:
                if fn is None:
                    from hpc_hsdp.task.training.loop import payload  # noqa: PLC0415 - as init

                    result = payload(ctx)
                else:
                    result = fn(ctx)
            except Exception as exc:
                from hpc_hsdp.task.resilience.watchdog import wait_if_ending  # noqa: PLC0415 - torch is loaded by now

                wait_if_ending()  # a hang being reported: the watchdog ends the task
                _requeue_if_a_node_died(ctx, spec, env, exc)
                raise
            preemption.finish(rank=ctx.rank, run_dir=ctx.run_dir)  # collective; nothing to do when no stop was agreed
            return result
    finally:
        injected_faults.clear()
        range_keeper.uninstall()
        preemption.uninstall()


def end_task(code: int) -> NoReturn:
    """End a task process whose work is done, without the interpreter's teardown.

    After ``destroy_process_group`` the gloo groups keep their worker threads while anything
    still references them, and something does: FSDP leaves references to the groups past the
    model's deletion. So C++ threads run into the interpreter's teardown, which is where a
    finished torchrun worker of the test suite aborted once ("terminate called without an
    active exception", SIGABRT, after its final checkpoint): a completed job reported FAILED.
    Every file is closed by then (checkpoints, metrics, TensorBoard); the exit handlers run
    (logging flushes), stdout and stderr are flushed, and the process ends with ``code``
    before any module is torn down."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def exit_code(stop: SystemExit) -> int:
    """The status ``sys.exit`` would give for ``stop`` (None: 0, a number, else 1 and the text on stderr)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


def _requeue_if_a_node_died(ctx, spec: RunSpec, env: Mapping[str, str], exc: BaseException) -> None:
    """A step that failed because peers vanished with their node: requeue without it
    (:mod:`hpc_hsdp.task.resilience.node_failure`); any other failure is the payload's own. A replica
    group's step (``--fault-tolerance replica``) just ends: the job's supervisor starts the
    group again on spare nodes, the other groups train on."""
    if spec.training.resilience.fault_tolerance == "replica":
        return
    try:
        handle_lost_peers(
            ctx,
            max_restarts=spec.training.resilience.max_restarts,
            env=env,
            reason=f"the step failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}",
        )
    except Exception as probe:  # noqa: BLE001 - the payload's error is the one to raise
        note(f"could not check the job's nodes after the failure ({probe})")


def task_main(spec: RunSpec, *, fn: Callable | None = None, before_join: Callable[[], None] | None = None):
    """What every task of a job runs (``hpc-hsdp run``; submitit's wrapper under ``submit``):
    :func:`run_task`, then, when the ranks stopped on a signal, exit without a result
    (SystemExit: submitit writes no result file, the job is not done) with status 0
    (requeued, or SLURM is ending the job) or 75 (stopped, not requeued: resubmit to resume).
    Without ``fn``, an :class:`~hpc_hsdp.errors.HsdpError` is one line on stderr and status 2."""
    preemption = Preemption(os.environ)
    try:
        result = run_task(spec, fn=fn, preemption=preemption, before_join=before_join)
    except HsdpError as exc:
        if fn is not None:
            raise  # the caller's function: its exception is its result (submitit pickles it)
        # what the job was given cannot work (data that does not match the checkpoint, a mesh
        # that does not fit the allocation): one line and exit 2, as on the command line; a
        # message of several lines (a group mismatch's table) is printed whole before it
        text = str(exc)
        if "\n" in text:
            print(f"hpc-hsdp: {text}", file=sys.stderr)
        print(f"hpc-hsdp: error: {' '.join(text.split())}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    # the work is done: a warning now (SLURM's time-limit check) must not kill the task on its way out (FAILED)
    signal.signal(preemption.warning_signal, signal.SIG_IGN)
    code = preemption.exit_code()
    if code is not None:
        raise SystemExit(code)
    return result
