"""``--compile``: each shard unit compiled before ``fully_shard``, on CPU with inductor.

One real gloo job of 2 ranks across three launches: an eager reference and an eager run
checkpointed at step 2; that checkpoint resumed compiled (the loss within 2 % of eager, the
compile time in the step's record apart from the step time, the cache written in the run
directory, no ``_orig_mod`` in the checkpoint's keys); a second attempt that loads the
compiled graphs from that cache, then goes back to eager from its compiled checkpoint.
``status`` shows the compile.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from cli_helpers import hpc
from dist_helpers import launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.files import read_jsonl
from hpc_hsdp.task.checkpointing.checkpoint import complete_checkpoints
from hpc_hsdp.task.parallelism.compile import CACHE_DIR

TINY = TrainingSpec.of(
    layers=2, width=32, heads=4, seq_len=16, batch_size=2, vocab_size=64, steps=6, seed=5, lr=1e-2, precision="fp32"
)


def _reference_then_eager_to_step_2(ctx):
    from hpc_hsdp.task.parallelism.dist import RunContext
    from hpc_hsdp.task.training.loop import train

    scratch = RunContext(layout=ctx.layout, mesh=ctx.mesh, device=ctx.device, realized=ctx.realized, _active=False)
    reference = train(scratch, TINY, verbose=False).losses
    train(ctx, TINY.replace(steps=2), verbose=False)
    return reference


def _compiled_to_step_5_then_eager_to_6(ctx):
    from hpc_hsdp.task.training.loop import train

    compiled = train(ctx, TINY.replace(compile=True, steps=5), verbose=False).losses
    eager = train(ctx, TINY.replace(steps=6), verbose=False).losses
    return {"compiled": compiled, "eager": eager}


def _checkpoint_keys(path) -> list[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


@pytest.mark.dist
def test_compile_resumes_an_eager_checkpoint_reuses_its_cache_and_goes_back(tmp_path):
    run = tmp_path / "run"
    spec = RunSpec(shard_size=2, run_dir=str(run), device="cpu", training=TINY)
    first = launch(spec, tasks_per_node=[2], fn=_reference_then_eager_to_step_2, log_dir=tmp_path / "l1")
    reference = first[0].value
    assert [s for s, _ in complete_checkpoints(run)] == [2]

    # attempt 2: the eager checkpoint resumed compiled, the cache built in the run directory
    compiled = TINY.replace(compile=True, steps=4)
    launch(dataclasses.replace(spec, training=compiled), tasks_per_node=[2], log_dir=tmp_path / "l2", timeout_s=300)
    records = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    for step in (3, 4):
        assert records[step]["loss"] == pytest.approx(reference[step], rel=0.02)
    first_compiled = records[3]
    assert first_compiled["compile_s"] > 0 and first_compiled["step_time_s"] >= first_compiled["compile_s"]
    assert first_compiled["compile_cache"]["fx_graph_misses"] > 0  # a fresh cache: compiled from scratch
    assert "compile_s" not in records[4]  # the steady steps: no compile
    for rank in (0, 1):
        assert any((run / CACHE_DIR / f"rank{rank}").rglob("*")), f"rank {rank} wrote no compile cache"
    keys = _checkpoint_keys(dict(complete_checkpoints(run))[4])
    assert keys and not any("_orig_mod" in k for k in keys), keys
    assert keys == _checkpoint_keys(dict(complete_checkpoints(run))[2])  # the eager checkpoint's keys, the same

    # attempt 3 (a new process, as a requeue): the graphs come from the run's cache; then eager again
    third = launch(spec, tasks_per_node=[2], fn=_compiled_to_step_5_then_eager_to_6, log_dir=tmp_path / "l3")
    losses = third[0].value
    records = {r["step"]: r for r in read_jsonl(run / "metrics.jsonl")}
    cache = records[5]["compile_cache"]
    assert cache["fx_graph_hits"] > 0 and cache["fx_graph_misses"] == 0, cache
    assert losses["compiled"][5] == pytest.approx(reference[5], rel=0.02)
    assert losses["eager"][6] == pytest.approx(reference[6], rel=0.02)  # the compiled checkpoint resumed eagerly
    assert "compile_s" not in records[6]

    # status shows the compile apart from the step times
    (run / "job.json").write_text(
        json.dumps(
            {
                "job_id": "7",
                "cluster": "local",
                "run_dir": str(run),
                "logs_dir": str(run / "logs"),  # a submission's logs are always in its run directory
                "job_name": "x",
                "ntasks": 2,
                "launcher": "srun",
                "submitted_at": 0.0,
            }
        )
    )
    out = hpc("status", str(run))
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("compile: "))
    assert "at step 5" in line and "graphs loaded" in line, out.stdout
