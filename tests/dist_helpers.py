"""Launch real multi-process torch.distributed jobs for tests (fork, gloo, CPU).

Each child gets the SLURM environment ``task_environments`` gives its task (block or
cyclic SLURM_PROCIDs) plus MASTER_ADDR/MASTER_PORT, and runs the real entry
``run_task``. The parent must not have created a process group or threads before
forking (importing torch is fine), and the children run on the CPU: a process that asked
CUDA anything (``torch.cuda.is_available()`` included) cannot hand CUDA to a forked child,
so GPU tests start the CLI in a subprocess instead. A child's stdout/stderr go to
``<log_dir>/task-<procid>.log``; a failure or a timeout raises with the tracebacks and
log tails.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from hpc_hsdp.job.spec import RunSpec
from hpc_hsdp.plan.slurm_env import task_environments

_CTX = multiprocessing.get_context("fork")


def wait_until(what: str, check, timeout_s: float):
    """``check()``'s first truthy value, polled every 0.5 s; fails the test after ``timeout_s``."""
    import pytest

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    pytest.fail(f"{what} not reached in {timeout_s} s")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_names_for(nodes: int) -> list[str]:
    return [f"n{i + 1}" for i in range(nodes)]


def job_envs(*, tasks_per_node, distribution="block", job_id="4242", extra_env=None) -> list[dict[str, str]]:
    envs = task_environments(
        tasks_per_node=list(tasks_per_node),
        node_names=node_names_for(len(tasks_per_node)),
        job_id=job_id,
        distribution=distribution,
    )
    port = str(free_port())
    for env in envs:
        env.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
        env.update(extra_env or {})
    return envs


@dataclass
class TaskOutcome:
    procid: int
    ok: bool
    value: object
    """fn's return value, or the formatted traceback when not ok."""
    log: str


def _redirect(log_path: Path) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # pytest replaces sys.stdout/err with its own capture objects: write to the fds again.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def _child(procid, env, spec, fn, results, log_path) -> None:
    _redirect(log_path)
    import torch

    torch.set_num_threads(1)
    try:
        from hpc_hsdp.task.entry import run_task

        value = run_task(spec, fn=fn, env=env)
        results.put((procid, True, value))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((procid, False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        results.close()
        results.join_thread()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def launch(
    spec: RunSpec,
    *,
    tasks_per_node,
    distribution: str = "block",
    fn=None,
    extra_env: dict | None = None,
    timeout_s: float = 120,
    log_dir: str | os.PathLike | None = None,
    expect_failure: bool = False,
) -> list[TaskOutcome]:
    """Run ``run_task(spec, fn=fn)`` on every task of a ``tasks_per_node`` job; outcomes by PROCID.

    Unless ``expect_failure``, any failed task fails the caller with its traceback.
    """
    if spec.device != "cpu":
        raise ValueError(f"launch forks CPU-only tasks; got device {spec.device!r} (start a GPU job in a subprocess)")
    if os.environ.get("PYTEST_CURRENT_TEST", "").startswith("tests/fast/"):
        raise RuntimeError("tests/fast starts no process group: a test that launches a job belongs in tests/processes")
    envs = job_envs(tasks_per_node=tasks_per_node, distribution=distribution, extra_env=extra_env)
    log_dir = Path(log_dir or Path(spec.run_dir) / "logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    results = _CTX.Queue()
    procs = []
    for procid, env in enumerate(envs):
        log_path = log_dir / f"task-{procid}.log"
        proc = _CTX.Process(target=_child, args=(procid, env, spec, fn, results, log_path), daemon=True)
        proc.start()
        procs.append(proc)
    outcomes: dict[int, tuple[bool, object]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outcomes) < len(procs):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"{len(procs) - len(outcomes)} of {len(procs)} tasks did not finish in {timeout_s} s"
                )
            try:
                procid, ok, value = results.get(timeout=min(1.0, remaining))
                outcomes[procid] = (ok, value)
            except queue_module.Empty:
                dead = [i for i, p in enumerate(procs) if i not in outcomes and p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.5)  # a result may still be in the pipe
                    while True:
                        try:
                            procid, ok, value = results.get_nowait()
                            outcomes[procid] = (ok, value)
                        except queue_module.Empty:
                            break
                    for i in dead:
                        outcomes.setdefault(i, (False, f"task {i} died with exit code {procs[i].exitcode}"))
    except TimeoutError as exc:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        tails = "\n".join(f"--- task {i} ---\n{_tail(log_dir / f'task-{i}.log')}" for i in range(len(procs)))
        raise AssertionError(f"{exc}; killed the rest.\n{tails}") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    found = [
        TaskOutcome(
            procid=i,
            ok=outcomes[i][0],
            value=outcomes[i][1],
            log=(log_dir / f"task-{i}.log").read_text(errors="replace"),
        )
        for i in range(len(procs))
    ]
    failed = [o for o in found if not o.ok]
    if failed and not expect_failure:
        details = "\n".join(
            f"--- task {o.procid} ---\n{o.value}\nlog tail:\n{_tail(log_dir / f'task-{o.procid}.log')}" for o in failed
        )
        raise AssertionError(f"{len(failed)} of {len(found)} tasks failed:\n{details}")
    return found


def _in_child_target(fn, args, results) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        results.put((True, fn(*args)))
    except BaseException as exc:  # noqa: BLE001
        results.put((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        results.close()
        results.join_thread()


def in_child(fn, *args, timeout_s: float = 120):
    """Run ``fn(*args)`` in a forked process (keeps torch work and threads out of the parent,
    which must stay fork-safe for the next launch)."""
    results = _CTX.Queue()
    proc = _CTX.Process(target=_in_child_target, args=(fn, args, results), daemon=True)
    proc.start()
    try:
        ok, value = results.get(timeout=timeout_s)
    except queue_module.Empty:
        proc.kill()
        raise AssertionError(f"{fn.__name__} did not finish in {timeout_s} s") from None
    finally:
        proc.join(timeout=10)
    if not ok:
        raise AssertionError(value)
    return value


# ----------------------------------------------------------------------------- payloads for tests
# Module-level (picklable) functions that tests pass as ``fn`` or ``--entry``.


def entry_train_until_stop(ctx):
    """``--entry dist_helpers:entry_train_until_stop``: train, ask to stop after 2 steps, record."""
    import json

    from hpc_hsdp.task.training.loop import train

    done = []
    result = train(ctx, stop_requested=lambda: len(done) >= 2, on_step=lambda step, record: done.append(step))
    summary = dict(result.summary(ctx), on_step_calls=list(done))
    (ctx.run_dir / f"entry-rank{ctx.rank}.json").write_text(json.dumps(summary))
    return summary


def entry_gpu_report(ctx):
    """``--entry dist_helpers:entry_gpu_report`` (GPU test): train, counting the host syncs
    torch reports (``set_sync_debug_mode``) in steps 3 and 4, and write what the test checks."""
    import json
    import warnings

    import torch

    from hpc_hsdp.task.training.loop import train

    state, syncs = {}, []

    def on_step(step, record):
        if step == 2:
            state["catch"] = warnings.catch_warnings(record=True)
            state["log"] = state["catch"].__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        if step == 4:
            torch.cuda.set_sync_debug_mode("default")
            state["catch"].__exit__(None, None, None)
            # torch's own notice that the debug mode is a prototype is not a sync
            syncs.extend(str(w.message) for w in state["log"] if "called a synchronizing" in str(w.message))

    result = train(ctx, on_step=on_step)
    from hpc_hsdp.task.resilience.watchdog import Watchdog

    Watchdog(ctx)._dump_nccl_trace(ctx.rank)  # what a hang writes: the NCCL flight recorder's trace
    report = dict(
        result.summary(ctx),
        syncs_in_steps_3_and_4=syncs,
        tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        tf32_cudnn=torch.backends.cudnn.allow_tf32,
    )
    (ctx.run_dir / f"gpu-report-rank{ctx.rank}.json").write_text(json.dumps(report))
    return report
