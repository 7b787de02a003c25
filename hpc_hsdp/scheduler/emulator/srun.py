"""The emulator's ``srun``: one process per task of the step, each with the task-level variables a
real step gives it, its output in the ``--output``/``--error`` patterns, and the step ended when one
task fails (``--kill-on-bad-exit``)."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hpc_hsdp.files import open_for_writing
from hpc_hsdp.plan.address import hostfile_lines
from hpc_hsdp.plan.slurm_env import DISTRIBUTIONS, task_environments
from hpc_hsdp.plan.topology import expand_nodelist, parse_tasks_per_node
from hpc_hsdp.scheduler.emulator.slurm_patterns import expand_pattern

KILL_WAIT_S = 5


def _srun_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="srun (hpc-hsdp local emulator)", allow_abbrev=False)
    parser.add_argument("--kill-on-bad-exit", "-K", nargs="?", const="1", default="0")
    parser.add_argument("--unbuffered", "-u", action="store_true")
    parser.add_argument("--output", "-o", default=None)
    parser.add_argument("--error", "-e", default=None)
    parser.add_argument("--distribution", "-m", default="block")
    parser.add_argument("--ntasks-per-node", type=int, default=None)
    parser.add_argument("--ntasks", "-n", type=int, default=None)
    parser.add_argument("--nodes", "-N", type=int, default=None)
    parser.add_argument("--relative", "-r", type=int, default=None)  # a step on nodes N.. of the allocation
    parser.add_argument("--nodelist", "-w", default=None)  # a step on these nodes of the allocation
    parser.add_argument("--label", "-l", action="store_true")
    parser.add_argument("--export", default=None)
    parser.add_argument("--cpu-bind", default=None)
    parser.add_argument("--cpus-per-task", "-c", type=int, default=None)  # every task runs on this machine's CPUs
    parser.add_argument("--container-image", default=None)
    parser.add_argument("--container-name", default=None)
    parser.add_argument("--container-mounts", default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    return parser


def _hostfile_layout(path: str, node_names: Sequence[str]) -> tuple[tuple[int, ...], str]:
    """Tasks per node and their order (block or cyclic) from ``SLURM_HOSTFILE``."""
    if not path or not Path(path).is_file():
        raise ValueError(f"SLURM_HOSTFILE={path!r} is not a file")
    lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    counts = tuple(lines.count(name) for name in node_names)
    env = {"SLURM_JOB_NODELIST": ",".join(node_names)}
    for distribution in DISTRIBUTIONS:
        if hostfile_lines(env, counts, distribution) == lines:
            return counts, distribution
    raise ValueError("the emulator places tasks node by node (block) or round-robin (cyclic) only")


def srun(argv: Sequence[str]) -> int:
    args = _srun_parser().parse_args(argv)
    if not args.command:
        print("srun (emulator): no command given", file=sys.stderr)
        return 2
    if args.container_image:
        print(
            "srun (emulator): --container-image needs the pyxis plugin of a real cluster; "
            "the local emulator runs commands directly. Submit with --cluster slurm.",
            file=sys.stderr,
        )
        return 2
    env = os.environ
    job_id = env["SLURM_JOB_ID"]
    node_names = expand_nodelist(env["SLURM_JOB_NODELIST"])
    counts = parse_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
    if args.nodelist is not None:  # a step on these nodes of the job (a replica group under one switch)
        wanted = set(expand_nodelist(args.nodelist))
        if not wanted <= set(node_names) or (args.nodes is not None and args.nodes != len(wanted)):
            print(
                f"srun (emulator): --nodelist={args.nodelist} --nodes={args.nodes}: the job's nodes are "
                f"{env['SLURM_JOB_NODELIST']}",
                file=sys.stderr,
            )
            return 2
        kept = [i for i, name in enumerate(node_names) if name in wanted]  # SLURM's order, as a real step's
        node_names, counts = tuple(node_names[i] for i in kept), tuple(counts[i] for i in kept)
    elif args.relative is not None or args.nodes is not None:  # a step on some of the job's nodes (a replica group)
        first = args.relative or 0
        last = first + (args.nodes or len(node_names) - first)
        if last > len(node_names):
            print(
                f"srun (emulator): --relative={first} --nodes={args.nodes}: the job has {len(node_names)} nodes",
                file=sys.stderr,
            )
            return 2
        node_names, counts = node_names[first:last], counts[first:last]
    if args.ntasks_per_node is not None:
        counts = (args.ntasks_per_node,) * len(counts)
    distribution = args.distribution.split(":")[0].split(",")[0]
    if distribution == "arbitrary":
        try:
            counts, distribution = _hostfile_layout(env.get("SLURM_HOSTFILE", ""), node_names)
        except ValueError as exc:
            print(f"srun (emulator): --distribution=arbitrary: {exc}", file=sys.stderr)
            return 2
    if distribution not in DISTRIBUTIONS:
        print(
            f"srun (emulator): --distribution={args.distribution} is not emulated; use block or cyclic", file=sys.stderr
        )
        return 2
    task_envs = task_environments(
        tasks_per_node=counts,
        node_names=node_names,
        job_id=job_id,
        distribution=distribution,
        job_name=env.get("SLURM_JOB_NAME", "job"),
    )
    procs: list[subprocess.Popen] = []
    files = []
    for task in task_envs:
        procid, node_id = int(task["SLURM_PROCID"]), int(task["SLURM_NODEID"])
        expand = functools.partial(
            expand_pattern,
            job_id=job_id,
            procid=procid,
            node_id=node_id,
            node=task["SLURMD_NODENAME"],
            array_job=env.get("SLURM_ARRAY_JOB_ID"),
            array_task=env.get("SLURM_ARRAY_TASK_ID"),
        )
        out = open_for_writing(expand(args.output), append=True) if args.output else None
        err = open_for_writing(expand(args.error), append=True) if args.error else out
        files += [f for f in (out, err) if f is not None]
        job_level = {k: env[k] for k in ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES") if k in env}
        task_env = {**env, **task, **job_level, "SLURM_STEP_ID": "0", "SLURM_STEPID": "0"}
        procs.append(subprocess.Popen(args.command, env=task_env, stdout=out, stderr=err, stdin=subprocess.DEVNULL))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(sig, forward)
    kill_on_bad_exit = args.kill_on_bad_exit not in ("0", None)
    first_failure: int | None = None
    reported: set[int] = set()
    kill_at = None

    def report_failures() -> None:
        # like srun, one line per failed task, in the order seen (tasks ending within one
        # poll: by task id); the first one is the job's cause
        nonlocal first_failure, kill_at
        for procid, p in enumerate(procs):
            code = p.poll()
            if code in (None, 0) or procid in reported:
                continue
            reported.add(procid)
            first = first_failure is None
            first_failure = code if first else first_failure
            print(
                f"srun (emulator): task {procid} exited with code {code}"
                + ("; terminating the other tasks (--kill-on-bad-exit)" if first and kill_on_bad_exit else ""),
                file=sys.stderr,
            )
            if first and kill_on_bad_exit and any(q.poll() is None for q in procs):
                forward(signal.SIGTERM, None)
                kill_at = time.monotonic() + KILL_WAIT_S

    while any(p.poll() is None for p in procs):
        report_failures()
        if kill_at is not None and time.monotonic() > kill_at:
            forward(signal.SIGKILL, None)
        time.sleep(0.1)
    report_failures()  # tasks that ended since the last look
    for f in files:
        f.close()
    if first_failure is None:
        return 0
    return first_failure if first_failure > 0 else 128 - first_failure
