"""``--stage-data`` on real ranks (gloo, 2 nodes x 2 tasks forked on this machine, the two
"nodes" sharing one staging directory, so four ranks contend for one lock): the staged run
trains to exactly the losses of the unstaged one; a second launch reuses the verified copies; a
copy damaged in place (size and mtime kept) is detected and replaced; a disk too small leaves
the nodes on the shared copy with a warning; a staging directory that cannot be made fails
every rank with one line (task/training/staging.py, data/staging_copies.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from dist_helpers import launch

from hpc_hsdp.data.staging_copies import stage_files, stage_root
from hpc_hsdp.data.tokens import READ_LATENCY, open_dataset, write_dataset_manifest, write_token_file
from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.files import read_jsonl

pytestmark = pytest.mark.dist

VOCAB = 300


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A prepare-data style directory: two train shards and a val shard, Zipf-ish tokens."""
    root = tmp_path_factory.mktemp("shared") / "corpus"
    rng = np.random.default_rng(7)
    splits = {"train": [], "val": []}
    for split, name, size in (("train", "00000", 30_000), ("train", "00001", 20_000), ("val", "00000", 8_000)):
        (root / split).mkdir(parents=True, exist_ok=True)
        tokens = np.minimum(rng.zipf(1.3, size), VOCAB) - 1
        write_token_file(root / split / f"{name}.bin", tokens, vocab_size=VOCAB)
        splits[split].append(f"{split}/{name}.bin")
    write_dataset_manifest(root, vocab_size=VOCAB, dtype="uint16", tokenizer={}, splits=splits)
    return root


def _training(dataset: Path, stage: str | None) -> TrainingSpec:
    return TrainingSpec.of(
        data=str(dataset),
        stage_data=stage,
        layers=1,
        width=32,
        heads=4,
        seq_len=32,
        batch_size=2,
        steps=4,
        seed=3,
        eval_every=2,
        eval_batches=1,
        tracker="none",
        straggler_every=0,
    )


def _run(dataset: Path, run_dir: Path, stage: str | None, extra_env: dict | None = None) -> dict:
    spec = RunSpec(shard_size=2, run_dir=str(run_dir), device="cpu", training=_training(dataset, stage), timeout_s=120)
    outcomes = launch(spec, tasks_per_node=[2, 2], extra_env=extra_env, timeout_s=300)
    records = read_jsonl(run_dir / "metrics.jsonl")
    staging = json.loads((run_dir / "staging.json").read_text()) if (run_dir / "staging.json").exists() else None
    return {
        "losses": [(r["step"], r["loss"], r.get("eval_loss")) for r in records],
        "staging": staging,
        "log": outcomes[0].log,
    }


def _actions(staging: dict) -> dict[str, list[str]]:
    return {node: [f["action"] for f in entry["files"]] for node, entry in staging["nodes"].items()}


@pytest.fixture(scope="module")
def unstaged(dataset, tmp_path_factory) -> dict:
    return _run(dataset, tmp_path_factory.mktemp("plain") / "run", None)


def test_staged_runs_train_to_the_same_losses_reuse_and_replace_a_damaged_copy(
    dataset, unstaged, tmp_path, monkeypatch
):
    stage = tmp_path / "node-local"
    first = _run(dataset, tmp_path / "first", str(stage))
    assert first["losses"] == unstaged["losses"] and len(first["losses"]) == 4
    assert unstaged["staging"] is None
    staging = first["staging"]
    assert set(staging["nodes"]) == {"n1", "n2"} and staging["dir"] == str(stage)
    # the two emulated nodes share one disk: one rank copied the three files, the others found them
    assert sorted(a for actions in _actions(staging).values() for a in actions) == ["copied"] * 3 + ["reused"] * 3
    assert staging["copied_bytes"] == sum(p.stat().st_size for p in dataset.glob("*/*.bin"))
    assert staging["seconds"] > 0
    root = stage / f"hpc-hsdp-staged-{os.geteuid()}"
    copies = sorted(root.glob("*.bin"))
    assert len(copies) == 3 and all(
        f["local"].startswith(str(root)) for e in staging["nodes"].values() for f in e["files"]
    )
    line = next(x for x in first["log"].splitlines() if "--stage-data:" in x)
    assert "token files on node-local disk of 2/2 node(s) in" in line and "copied 3, reused 3" in line, line

    # a second launch (another job on the node): the copies are verified once and reused, and
    # the loader reads them: every read of the shared copy now waits 0.5 s (the tasks inherit it)
    monkeypatch.setenv(READ_LATENCY, f"0.5@{dataset}")
    second = _run(dataset, tmp_path / "second", str(stage))
    monkeypatch.delenv(READ_LATENCY)
    waits = [r["data_wait_s"] for r in read_jsonl(tmp_path / "second" / "metrics.jsonl")]
    assert sum(waits) < 0.5, waits  # the shared copy would cost 1 s per micro-batch of 2 rows
    assert second["losses"] == unstaged["losses"]
    assert sorted(a for actions in _actions(second["staging"]).values() for a in actions) == ["reused"] * 6
    assert second["staging"]["copied_bytes"] == 0
    assert max(e["verify_s"] for e in second["staging"]["nodes"].values()) > 0

    # a copy damaged in place, its size and mtime kept (bit rot): detected and replaced
    damaged = copies[0]
    info = damaged.stat()
    with open(damaged, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff\xff\xff")
    os.utime(damaged, ns=(info.st_atime_ns, info.st_mtime_ns))
    third = _run(dataset, tmp_path / "third", str(stage))
    assert third["losses"] == unstaged["losses"]
    replaced = [f for e in third["staging"]["nodes"].values() for f in e["files"] if f["action"] == "replaced"]
    assert [f["local"] for f in replaced] == [str(damaged)]
    assert damaged.read_bytes() == Path(replaced[0]["source"]).read_bytes()


def test_a_disk_too_small_reads_the_shared_copy_with_a_warning(dataset, unstaged, tmp_path):
    run = _run(dataset, tmp_path / "run", str(tmp_path / "small"), {"HPC_HSDP_FAULT_STAGE_FREE_BYTES": "1000"})
    assert run["losses"] == unstaged["losses"]
    assert {n: set(a) for n, a in _actions(run["staging"]).items()} == {"n1": {"shared"}, "n2": {"shared"}}
    warnings = [x for x in run["log"].splitlines() if "warning: --stage-data" in x]
    assert len(warnings) == 2 and all("reading the shared copy" in w for w in warnings), warnings
    assert not list((tmp_path / "small").rglob("*.bin"))


def test_a_staging_dir_that_cannot_be_made_fails_every_rank_in_one_line(dataset, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    spec = RunSpec(
        shard_size=2,
        run_dir=str(tmp_path / "run"),
        device="cpu",
        training=_training(dataset, str(tmp_path / "file")),
        timeout_s=60,
    )
    outcomes = launch(spec, tasks_per_node=[2, 2], expect_failure=True, timeout_s=120)
    assert all(not o.ok and o.value.startswith("DataError: --stage-data: cannot use ") for o in outcomes)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def train_with_the_node_name(ctx):
    """The built-in loop, with ``$SLURMD_NODENAME`` in this forked task's own environment (a real
    task has it from srun), so that ``--stage-data DIR/$SLURMD_NODENAME`` is a directory per node."""
    from hpc_hsdp.task.training.loop import train

    os.environ["SLURMD_NODENAME"] = ctx.layout.node
    train(ctx, ctx.spec.training)


def test_a_copy_longer_than_the_process_group_timeout_does_not_time_the_job_out(
    dataset, unstaged, tmp_path, monkeypatch
):
    # node n2 has its copies already; n1 copies, reading each shared file 5 s late (three files:
    # 15 s), while n2's ranks wait for it with a process-group timeout of 10 s: one collective
    # that long would time out
    stage = tmp_path / "stage"
    ready = stage_files(
        open_dataset(dataset).files + open_dataset(dataset, "val").files, stage_root(stage / "n2"), launch="earlier"
    )
    assert {f.action for f in ready.files} == {"copied"}
    monkeypatch.setenv(READ_LATENCY, f"5@{dataset}")
    training = _training(dataset, f"{stage}/$SLURMD_NODENAME")
    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", training=training, timeout_s=10)
    launch(spec, tasks_per_node=[2, 2], fn=train_with_the_node_name, timeout_s=300)
    record = json.loads((tmp_path / "run" / "staging.json").read_text())
    assert [f["action"] for f in record["nodes"]["n1"]["files"]] == ["copied"] * 3
    assert [f["action"] for f in record["nodes"]["n2"]["files"]] == ["reused"] * 3
    assert record["nodes"]["n1"]["seconds"] > 15 and record["nodes"]["n2"]["waited_s"] > 10
    losses = [(r["step"], r["loss"], r.get("eval_loss")) for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert losses == unstaged["losses"]
