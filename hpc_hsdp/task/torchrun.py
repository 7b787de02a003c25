"""The one-task-per-node launcher: start torchrun's workers on this node, in node order.

torchrun runs with a static rendezvous (``--node-rank`` from this node's index in the
job's node list, ``--master-addr`` the first node), never c10d's arbitrary node order,
so the workers' ranks are node-major and match the plan. Imports no torch itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from hpc_hsdp.job.spec import TORCHRUN_SIGNALS, TORCHRUN_SIGNALS_VAR, RunSpec
from hpc_hsdp.plan.topology import RankLayout
from hpc_hsdp.task.resilience.preemption import warning_signal_from


def torchrun_command(spec: RunSpec, *, nproc_per_node: int, env=None) -> list[str]:
    layout = RankLayout.from_env(
        os.environ if env is None else env,
        shard_size=spec.shard_size,
        nproc_per_node=nproc_per_node,
        topology=spec.topology,
        tp_size=spec.tp_size,
    )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={layout.plan.nodes}",
        f"--nproc-per-node={nproc_per_node}",
        f"--node-rank={layout.node_rank}",
        f"--master-addr={layout.master_addr}",
        f"--master-port={layout.master_port}",
        "-m",
        "hpc_hsdp",
        "run",
        *spec.to_args(),
    ]


def launch_torchrun(spec: RunSpec, nproc_per_node: int) -> int:
    """Run torchrun for this node with this task's interpreter (submitit started it from the
    job's environment) and wait; raises when a worker failed.

    SLURM signals every process of the step: the workers handle the warning signal and
    SIGTERM themselves (every rank saves). torchrun's agent starts with the warning signal
    ignored, so that it does not die of it; this process only notes the signals (replacing
    submitit's handlers) and, after a stop, exits without a result, as an srun task does,
    so that the requeued job's result is the one submitit reports."""
    warning = warning_signal_from(os.environ)
    stopped: list[int] = []

    def note_stop(signum, frame) -> None:
        # said at once: after the workers save, SLURM may SIGKILL this process before torchrun returns
        if not stopped:
            print(
                f"torchrun on this node: {signal.Signals(signum).name} received; the workers stop and save, "
                "the agent waits for them",
                flush=True,
            )
        stopped.append(signum)

    for sig in (warning, signal.SIGTERM):
        signal.signal(sig, note_stop)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)  # scancel --signal=QUIT: the workers print their stacks

    def agent_signals() -> None:
        # torchrun's agent: ignores the warning; QUIT neither kills it nor ends the job
        signal.signal(warning, signal.SIG_IGN)
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)

    command = torchrun_command(spec, nproc_per_node=nproc_per_node)
    print("launching:", " ".join(command), flush=True)
    code = subprocess.call(
        command, preexec_fn=agent_signals, env={**os.environ, TORCHRUN_SIGNALS_VAR: TORCHRUN_SIGNALS}
    )
    if stopped:
        # the workers saved; SLURM ends (and maybe requeues) the step, and torchrun's agent
        # reports the SIGTERM it then gets as a failure: not one of the run
        print(f"torchrun on this node ended ({code}) after {signal.Signals(stopped[0]).name}", flush=True)
        raise SystemExit(0)
    if code != 0:
        raise RuntimeError(f"torchrun on this node exited with code {code}; see the workers' lines above")
    return code
