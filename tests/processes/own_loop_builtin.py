"""An own loop (``hpc_hsdp.TrainingRun``) of the built-in model, for the tests that run it as a job's
``--entry own_loop_builtin:main`` (with this directory on PYTHONPATH)."""

from __future__ import annotations

import hpc_hsdp


def main(ctx):
    run = hpc_hsdp.TrainingRun(ctx)
    for step in run.steps():
        for batch in step.batches:
            loss = run.loss(batch.inputs, batch.targets)
            (loss / len(step.batches)).backward()
        run.clip_grad_norm(1.0)
        run.optimizer.step()
        run.optimizer.zero_grad()
        run.log(step, loss=loss)
    return run.finish()
