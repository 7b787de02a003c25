"""Your own training loop for a transformers model, with the built-in loop's guarantees:
sharded model, token-file sampler, preemption agreement, atomic checkpoints with your own
state, resume, metrics.jsonl. Run it on every task:

    hpc-hsdp prepare-data my_texts/ -o data/mine --train-tokenizer 8192 --val-fraction 0.01
    PYTHONPATH=examples srun hpc-hsdp run --shard 4 --run-dir runs/own --entry own_loop:main \\
        --model hf:/models/my-llama --data data/mine --steps 1000 --checkpoint-every 100

(``hpc-hsdp submit ... --entry own_loop:main`` renders and submits the same.)
"""

from __future__ import annotations

import math

import torch

import hpc_hsdp


def main(ctx):
    run = hpc_hsdp.TrainingRun(ctx)  # builds and shards --model, opens --data, resumes --run-dir
    model, optimizer = run.model, run.optimizer
    best = run.state.get("best_loss", math.inf)  # our own state comes back on resume

    for step in run.steps():  # ends at --steps, or after the step where the ranks agree to stop
        total = torch.zeros((), device=ctx.device)
        for batch in step.batches:  # --grad-accum micro-batches of this rank
            logits = model(input_ids=batch.inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch.targets.flatten())
            (loss / len(step.batches)).backward()
            total += loss.detach() / len(step.batches)
        norm = run.clip_grad_norm(1.0)  # over the whole mesh (replicate, shard and --tp)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        record = run.log(step, loss=total, grad_norm=norm)  # global mean, one line in metrics.jsonl
        best = min(best, record["loss"])
        run.state["best_loss"] = best  # saved with model, optimizer and data position

    summary = run.finish()  # the final checkpoint (every rank)
    if ctx.is_rank0:
        print(
            f"own loop: steps {summary['start_step']}..{summary['steps']}, best loss {best:.4f}, "
            f"stopped: {summary['stop_reason']}",
            flush=True,
        )
    return summary
