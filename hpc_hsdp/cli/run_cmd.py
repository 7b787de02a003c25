"""``hpc-hsdp run``: what srun (or torchrun) starts on every task."""

from __future__ import annotations

import os

import click

from hpc_hsdp.cli.click_options import command_options, run_spec_from_options


@click.command()
@command_options("run")
def run(**options) -> None:
    """On each task: process group, DeviceMesh ("replicate", "shard"), verified groups, train.

    Start it once per GPU: `srun hpc-hsdp run --shard 4 --run-dir runs/x`, or under
    torchrun (static rendezvous). Rank 0 writes layout.json, metrics.jsonl and the
    checkpoints in the run directory; a rerun resumes from the newest checkpoint.
    `kill -QUIT <pid>` prints a rank's stacks to its log.
    """
    spec = run_spec_from_options(options)
    claimed = []

    def claim_run_dir() -> None:  # one writer per run directory: rank 0 claims it, after what the device refuses
        from hpc_hsdp.submit_host.claims import claim_for_task  # noqa: PLC0415  (the claim asks the scheduler only when another job holds it)

        said, own_claim = claim_for_task(spec.run_dir, os.environ)
        if said:
            click.echo(f"hpc-hsdp: {said}", err=True)
        if own_claim:
            claimed.append(spec.run_dir)

    from hpc_hsdp.task.entry import end_task, exit_code, task_main  # noqa: PLC0415  (torch loads here, not on `hpc-hsdp --help`)

    code = 0
    try:
        task_main(spec, before_join=claim_run_dir if spec.run_dir and _rank(os.environ) == 0 else None)
    except SystemExit as stop:  # 0/75 after a signal stop (see hpc_hsdp.task.resilience.preemption), 2 on an HsdpError
        code = exit_code(stop)
    finally:
        if claimed:  # a run outside any job: nobody else sees it end
            from hpc_hsdp.submit_host.claims import release_task_claim  # noqa: PLC0415  (as the claim)

            release_task_claim(spec.run_dir)
    end_task(code)


def _rank(env) -> int:
    """This task's global rank before the process group: torchrun's RANK, else SLURM's task id."""
    for name in ("RANK", "SLURM_PROCID"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return 0
