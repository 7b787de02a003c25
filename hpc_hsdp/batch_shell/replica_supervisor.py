"""The replica supervisor of a fault-tolerant job (``--fault-tolerance replica``): no torch.

The rendered script runs it in the batch shell (the job's first node) instead of one ``srun``.
It starts torchft's lighthouse bound to the job's address and keeps it (restarted on the same
address when it ends; given up after ``LIGHTHOUSE_RESTARTS`` quick ends: fall back), then one
``srun`` job step per replica group on the group's own nodes (``--relative``, or ``--nodelist``
where the nodes' switches put a group's nodes apart: each group under one leaf switch), each with its
``HPC_HSDP_REPLICA_ID``, rendezvous address and port and the lighthouse's address. The group's
rendezvous address is its first node's, by the rule of an ordinary job's batch shell
(:mod:`hpc_hsdp.plan.address`): this shell's own for the job's first node, else asked on that
node in a one-task step before the group's (the interface it names, ``NCCL_SOCKET_IFNAME``, is
that node's; its SLURM name need not resolve). A group step that ends
before the training did is started again on spare nodes when there are any (it joins at the
next quorum from a live peer); the others train on without it meanwhile. The job ends when a
group finished the training (the others finish the same step); when fewer than
``--min-replicas`` groups are left, or the lighthouse cannot be kept, it falls back to the
path without fault tolerance: the job is requeued (``scontrol requeue``) and resumes from its
newest checkpoint. Every change is logged with its time and cause, on stderr and in
``<run-dir>/replicas.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hpc_hsdp.errors import SchedulerError, SlurmEnvError
from hpc_hsdp.plan.address import FALLBACK_PORT_BASE, pick_port, reachable_address
from hpc_hsdp.plan.replica_layout import (
    ATTEMPT_ENV,
    LIGHTHOUSE_ENV,
    REPLICA_GROUPS_ENV,
    REPLICA_ID_ENV,
    REPLICA_TAG,
    groups_on_switches,
)
from hpc_hsdp.plan.slurm_env import compress_nodelist
from hpc_hsdp.plan.switches import NODE_SWITCHES_ENV, parse_node_switches
from hpc_hsdp.plan.topology import RENDEZVOUS_PORT_BASE, RENDEZVOUS_PORT_SPAN, expand_nodelist
from hpc_hsdp.rundir.files import append_jsonl
from hpc_hsdp.rundir.observation.replica_membership import membership_path
from hpc_hsdp.rundir.training.metrics import last_step_written
from hpc_hsdp.scheduler.backends import task_backend
from hpc_hsdp.scheduler.backends.slurm_command import run_slurm, slurmd_address

LIGHTHOUSE_RESTARTS = 5
"""Lighthouse ends within ``LIGHTHOUSE_WINDOW_S`` of its start before the supervisor gives up on it."""
LIGHTHOUSE_WINDOW_S = 30.0
FINISH_GRACE_S = 120.0
"""After one group finished the training, how long the others may take to finish theirs."""
FALLBACK_EXIT = 75
"""The supervisor's status when it fell back to a requeue (as a task stopped and not requeued)."""
ADDRESS_FLAG = "--address-here"
"""``python -m hpc_hsdp.batch_shell.replica_supervisor --address-here``: print this node's rendezvous address (the
one-task step on a group's first node)."""
ADDRESS_TIMEOUT_S = 30.0
"""How long that step may take (a node that does not answer: the group is lost)."""


def log(run_dir: str | None, event: str, **fields) -> None:
    record = {"time": time.time(), "event": event, **fields}
    stamp = time.strftime("%H:%M:%S")
    print(f"hpc-hsdp: replicas {stamp}: {event} {json.dumps(fields, sort_keys=True)}", file=sys.stderr, flush=True)
    if run_dir:
        try:
            append_jsonl(membership_path(run_dir), record)
        except OSError:
            pass


@dataclass
class Group:
    replica_id: int
    nodes: list[int]
    attempt: int = 0
    proc: subprocess.Popen | None = None
    started: float = 0.0
    done: bool = False
    lost: bool = False
    port: int = 0
    """The group's rendezvous port (:meth:`Supervisor.group_port`)."""


PORTS_PER_JOB = 61
"""The fallback ports one job's replica groups and lighthouse are spread from: jobs with adjacent
ids (submitted one after the other, sharing a node) get blocks this far apart, so that neither
takes the other's ports (up to 60 groups and the lighthouse)."""


def job_port(base_port: int, index: int) -> int:
    """The ``index``-th port of a replica group's job whose own rendezvous port is ``base_port``:
    outside the range jobs derive their ports from (the next job's is this one's + 1), in a block
    of :data:`PORTS_PER_JOB` of the fallback range that the jobs around it do not share."""
    offset = (base_port - RENDEZVOUS_PORT_BASE) % RENDEZVOUS_PORT_SPAN
    return FALLBACK_PORT_BASE + (offset * PORTS_PER_JOB + index) % RENDEZVOUS_PORT_SPAN


@dataclass
class Supervisor:
    command: list[str]
    groups: list[Group]
    spares: list[list[int]]
    tasks_per_node: int
    min_replicas: int
    address: str
    lighthouse_port: int
    base_port: int
    node_names: list[str]
    run_dir: str | None = None
    join_timeout_ms: int = 5000
    heartbeat_timeout_ms: int = 2000
    quorum_timeout: float = 60.0
    steps: int | None = None
    """The run's last step: a group step that ends with 0 before it did not finish the training."""
    probe_nodes: bool = False
    """SLURM (not the emulator): each group's nodes are their own machines; ask their slurmd
    whether they live (srun itself may take a minute) and their first node its address."""
    slurmd_addresses: dict = field(default_factory=dict)
    lighthouse: subprocess.Popen | None = None
    lighthouse_starts: list[float] = field(default_factory=list)
    stopping: bool = False

    # ------------------------------------------------------------------ the lighthouse

    def start_lighthouse(self) -> bool:
        now = time.time()
        self.lighthouse_starts = [t for t in self.lighthouse_starts if now - t < LIGHTHOUSE_WINDOW_S]
        if len(self.lighthouse_starts) >= LIGHTHOUSE_RESTARTS:
            return False
        binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
        self.lighthouse = subprocess.Popen(
            [
                binary,
                "--min_replicas",
                str(self.min_replicas),
                "--bind",
                f"{self.address}:{self.lighthouse_port}",
                "--join_timeout_ms",
                str(self.join_timeout_ms),
                "--heartbeat_timeout_ms",
                str(self.heartbeat_timeout_ms),
                "--quorum_tick_ms",
                "50",
            ],
            stdin=subprocess.DEVNULL,
        )
        self.lighthouse_starts.append(now)
        log(
            self.run_dir,
            "lighthouse started",
            address=f"{self.address}:{self.lighthouse_port}",
            pid=self.lighthouse.pid,
            starts=len(self.lighthouse_starts),
        )
        return True

    # ------------------------------------------------------------------ the groups

    def group_port(self, group: Group) -> int:
        """The group's rendezvous port: after the job's, outside the derived range; where the group
        starts on this machine (the job's first node, the emulator) the first of those that is free
        here and no other group's or the lighthouse's."""
        wanted = job_port(self.base_port, 1 + group.replica_id)
        if group.nodes[0] != 0 and self.probe_nodes:
            return wanted
        taken = {self.lighthouse_port} | {g.port for g in self.groups if g is not group and g.port}
        return pick_port(wanted, taken=taken, where="this node")

    def rendezvous_address(self, group: Group) -> str:
        """The address the group's first node serves its rendezvous on, by the batch shell's rule
        (:func:`~hpc_hsdp.plan.address.node_address`): this shell's own for the job's first node
        and on the emulator (every node is this machine), else asked on that node. Raises
        SlurmEnvError (why) where that node cannot say one."""
        if group.nodes[0] == 0 or not self.probe_nodes:
            return self.address
        name = self.node_names[group.nodes[0]]
        argv = [
            "srun",
            "--nodes=1",
            "--ntasks=1",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            f"--relative={group.nodes[0]}",
            "--kill-on-bad-exit=1",
            "--quiet",
            sys.executable,
            "-m",
            "hpc_hsdp.batch_shell.replica_supervisor",
            ADDRESS_FLAG,
        ]
        try:
            done = run_slurm(argv, timeout_s=ADDRESS_TIMEOUT_S)
        except SchedulerError as exc:
            raise SlurmEnvError(f"node {name} did not say its address: {exc}") from None
        said = done.stdout.strip().splitlines()
        if done.returncode != 0 or not said:
            why = [
                line for line in done.stderr.splitlines() if line.startswith("hpc-hsdp:")
            ] or done.stderr.splitlines()
            raise SlurmEnvError(f"node {name} did not say its address: {(why or ['no output'])[-1].strip()}")
        return said[-1].strip()

    def where(self, group: Group) -> str:
        """srun's option placing the group's step: ``--relative`` for consecutive nodes of the
        allocation, else (the nodes' switches ordered them otherwise) ``--nodelist``."""
        first = group.nodes[0]
        if group.nodes == list(range(first, first + len(group.nodes))):
            return f"--relative={first}"
        return f"--nodelist={compress_nodelist([self.node_names[n] for n in group.nodes])}"

    def group_env(self, group: Group, address: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                REPLICA_ID_ENV: str(group.replica_id),
                REPLICA_GROUPS_ENV: str(len(self.groups)),
                ATTEMPT_ENV: str(group.attempt),
                LIGHTHOUSE_ENV: f"http://{self.address}:{self.lighthouse_port}",
                "MASTER_ADDR": address,
                "MASTER_PORT": str(group.port),
            }
        )
        return env

    def start_group(self, group: Group, cause: str) -> None:
        """The group's step on its nodes; a first node that cannot say its address loses the group."""
        try:
            address = self.rendezvous_address(group)
        except SlurmEnvError as exc:
            self.replace(group, str(exc), nodes_alive=False)  # not tried again: it would say the same
            return
        group.port = self.group_port(group)
        nodes = len(group.nodes)
        argv = [
            "srun",
            f"--nodes={nodes}",
            f"--ntasks={nodes * self.tasks_per_node}",
            f"--ntasks-per-node={self.tasks_per_node}",
            self.where(group),
            "--kill-on-bad-exit=1",
            *(a.replace(REPLICA_TAG, f"r{group.replica_id}a{group.attempt}") for a in self.command),
        ]
        group.proc = subprocess.Popen(argv, env=self.group_env(group, address), stdin=subprocess.DEVNULL)
        group.started = time.time()
        log(
            self.run_dir,
            "replica group started",
            replica_id=group.replica_id,
            attempt=group.attempt,
            nodes=[self.node_names[n] for n in group.nodes],
            address=address,
            cause=cause,
        )

    def last_step(self) -> int:
        """The newest step in ``metrics.jsonl`` (0 without one), as ``status`` reads it: past a
        torn last line, and from a record longer than 4 KiB (many ranks' straggler times)."""
        return (last_step_written(self.run_dir) or 0) if self.run_dir else 0

    def dead_nodes(self, group: Group) -> list[str]:
        """The group's nodes whose slurmd does not answer (SLURM only; none elsewhere)."""
        if not self.probe_nodes:
            return []
        dead = []
        for index in group.nodes:
            name = self.node_names[index]
            if name not in self.slurmd_addresses:  # asked of scontrol once per node, not every second
                self.slurmd_addresses[name] = slurmd_address(name)
            address = self.slurmd_addresses[name]
            if address is None:
                continue
            try:
                with socket.create_connection(address, timeout=2.0):
                    pass
            except OSError:
                dead.append(name)
        return dead

    def end_step(self, group: Group) -> None:
        """End a group's srun (its step on a dead node would only end after SLURM's timeouts)."""
        proc = group.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)  # twice within a second: srun cancels the step
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()

    def replace(self, group: Group, cause: str, *, nodes_alive: bool) -> None:
        """A lost group: started again on spare nodes, or given up when there are none."""
        log(self.run_dir, "replica group lost", replica_id=group.replica_id, attempt=group.attempt, cause=cause)
        if not self.spares:
            group.lost = True
            return
        old = group.nodes
        group.nodes = self.spares.pop(0)
        if nodes_alive:
            self.spares.append(old)  # its nodes wait as a spare now
        group.attempt += 1
        self.start_group(group, f"restarted on a spare: {cause}")

    def live(self) -> list[Group]:
        return [g for g in self.groups if not g.lost]

    def run(self) -> int:
        if not self.start_lighthouse():
            return FALLBACK_EXIT
        for group in self.groups:
            self.start_group(group, "job start")
        finished_at = None
        last_probe = 0.0
        while True:
            time.sleep(0.2)
            if self.lighthouse is not None and self.lighthouse.poll() is not None and finished_at is None:
                log(self.run_dir, "lighthouse ended", code=self.lighthouse.returncode, cause="its process ended")
                if not self.start_lighthouse():
                    return self.fall_back("the lighthouse could not be kept")
            probe = self.probe_nodes and time.time() - last_probe > 1.0
            last_probe = time.time() if probe else last_probe
            for group in self.groups:
                if group.proc is None or group.done or group.lost:
                    continue
                dead = self.dead_nodes(group) if probe and finished_at is None else []
                if dead:
                    self.end_step(group)
                    self.replace(group, f"node {','.join(dead)} died (slurmd unreachable)", nodes_alive=False)
                    continue
                if group.proc.poll() is None:
                    continue
                code = group.proc.returncode
                if code == 0 and (self.steps is None or self.last_step() >= self.steps):
                    group.done = True
                    finished_at = finished_at or time.time()
                    log(self.run_dir, "replica group finished", replica_id=group.replica_id)
                    continue
                if finished_at is not None:
                    group.lost = True
                    continue
                dead = self.dead_nodes(group)
                cause = f"its job step ended with exit code {code}" + (f" (node {','.join(dead)} died)" if dead else "")
                self.replace(group, cause, nodes_alive=not dead)
            if finished_at is not None:
                running = [g for g in self.groups if not g.done and not g.lost]
                if not running or time.time() - finished_at > FINISH_GRACE_S:
                    self.stop(running)
                    return 0
            elif len(self.live()) < self.min_replicas:
                return self.fall_back(f"{len(self.live())} live replica groups, fewer than --min-replicas")

    def stop(self, groups: Sequence[Group]) -> None:
        for group in groups:
            if group.proc is not None and group.proc.poll() is None:
                group.proc.send_signal(signal.SIGTERM)
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            self.lighthouse.terminate()
            try:
                self.lighthouse.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.lighthouse.kill()

    def fall_back(self, cause: str) -> int:
        """Below ``--min-replicas`` (or without a lighthouse): the path without fault tolerance:
        the groups left are stopped (a stop signal: they save at their step boundary) and the
        job is requeued; it resumes from the newest checkpoint."""
        log(self.run_dir, "fall back to requeue", cause=cause)
        running = [g.proc for g in self.groups if g.proc is not None and g.proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.time() + self.quorum_timeout + 60  # their quorum times out, one of them saves
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
        self.stop([])
        job = os.environ.get("SLURM_JOB_ID")
        asked = task_backend(os.environ).requeue(job) if job and shutil.which("scontrol") else None
        if asked is not None:  # None: the scheduler has no requeue (the emulator)
            requeued, said = asked
            log(self.run_dir, "requeue asked" if requeued else "requeue failed", cause=said)
        return FALLBACK_EXIT


def address_here() -> int:
    """``--address-here``: this node's rendezvous address on stdout, or why not on stderr (exit 2)."""
    try:
        print(reachable_address(os.environ), flush=True)
    except SlurmEnvError as exc:
        print(f"hpc-hsdp: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv == [ADDRESS_FLAG]:
        return address_here()
    parser = argparse.ArgumentParser(prog="python -m hpc_hsdp.batch_shell.replica_supervisor")
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--nodes-per-group", type=int, required=True)
    parser.add_argument("--tasks-per-node", type=int, required=True)
    parser.add_argument("--spare-nodes", type=int, default=0)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--quorum-timeout", type=float, default=60.0)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    command = command[1:] if command[:1] == ["srun"] else command  # "-- srun OPTIONS PROGRAM": one srun per group
    env = os.environ
    names = list(expand_nodelist(env["SLURM_JOB_NODELIST"]))
    # the batch script exported every node's switches (none with --topology off): each group under one leaf
    places = parse_node_switches(env.get(NODE_SWITCHES_ENV, ""))
    placed, spare_groups = groups_on_switches(
        names, places, groups=args.groups, nodes_per_group=args.nodes_per_group, spare_nodes=args.spare_nodes
    )
    groups = [Group(replica_id=g, nodes=list(nodes)) for g, nodes in enumerate(placed)]
    spares = [list(nodes) for nodes in spare_groups]
    address, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    join_ms = int(min(args.quorum_timeout * 1000 / 4, 5000))
    supervisor = Supervisor(
        command=command,
        groups=groups,
        spares=spares,
        tasks_per_node=args.tasks_per_node,
        min_replicas=args.min_replicas,
        address=address,
        lighthouse_port=pick_port(job_port(port, 0), where="this node"),
        base_port=port,
        node_names=names,
        run_dir=args.run_dir,
        join_timeout_ms=join_ms,
        heartbeat_timeout_ms=int(min(args.quorum_timeout * 1000 / 4, 2000)),
        steps=args.steps,
        quorum_timeout=args.quorum_timeout,
        probe_nodes=bool(env.get("SLURM_JOB_ID")) and task_backend(env).separate_machines,
    )

    def on_signal(signum, frame):
        for group in supervisor.groups:
            if group.proc is not None and group.proc.poll() is None:
                group.proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, on_signal)
    try:
        return supervisor.run()
    finally:
        supervisor.stop([g for g in supervisor.groups if g.proc is not None])


if __name__ == "__main__":
    sys.exit(main())
