"""``--stage-data`` on the real dev cluster: a job submitted with it trains to exactly the losses
of the same job without it; every node copies the token files into its own directory
(``$SLURMD_NODENAME`` in DIR, expanded on each node: the dev cluster's nodes share one disk),
and a second job on the same nodes reuses the copies (task/training/staging.py, data/staging_copies.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from cluster_helpers import hpc

from hpc_hsdp.data.tokens import write_dataset_manifest, write_token_file
from hpc_hsdp.rundir.files import read_jsonl
from tests.job_helpers import tiny_job

pytestmark = pytest.mark.slurm

TRAIN = tiny_job(
    heads=4, seq_len=16, vocab_size=None, device="cpu", steps=3, eval_every=3, eval_batches=1, tracker="none"
)


def _dataset(root: Path) -> Path:
    rng = np.random.default_rng(11)
    splits = {"train": [], "val": []}
    for split, name, size in (("train", "00000", 20_000), ("train", "00001", 9_000), ("val", "00000", 4_000)):
        (root / split).mkdir(parents=True, exist_ok=True)
        write_token_file(root / split / f"{name}.bin", rng.integers(0, 200, size), vocab_size=200)
        splits[split].append(f"{split}/{name}.bin")
    write_dataset_manifest(root, vocab_size=200, dtype="uint16", tokenizer={}, splits=splits)
    return root


def _submit(run: Path, *extra: str):
    out = hpc(
        "submit", "--cluster", "slurm", "--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--wait",
        "--run-dir", str(run), *TRAIN, *extra, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return [(r["step"], r["loss"], r.get("eval_loss")) for r in read_jsonl(run / "metrics.jsonl")]


def test_a_staged_job_trains_to_the_losses_of_an_unstaged_one_and_a_second_reuses_the_copies(slurm_cluster, tmp_path):
    data = _dataset(tmp_path / "shared" / "corpus")
    plain = _submit(tmp_path / "plain", "--data", str(data))
    stage = tmp_path / "local"
    staged = _submit(tmp_path / "staged", "--data", str(data), "--stage-data", f"{stage}/$SLURMD_NODENAME")
    assert staged == plain and len(plain) == 3
    record = json.loads((tmp_path / "staged" / "staging.json").read_text())
    nodes = sorted(record["nodes"])
    assert len(nodes) == 2
    for node in nodes:  # each node its own copies, in its own directory
        entry = record["nodes"][node]
        assert entry["root"] == str(stage / node / f"hpc-hsdp-staged-{os.geteuid()}")
        assert [f["action"] for f in entry["files"]] == ["copied"] * 3 and entry["fallback"] is None
        assert all(Path(f["local"]).read_bytes() == Path(f["source"]).read_bytes() for f in entry["files"])
    assert record["copied_bytes"] == 2 * sum(p.stat().st_size for p in data.glob("*/*.bin"))
    log = "\n".join(p.read_text() for p in (tmp_path / "staged" / "logs").glob("*_0_log.out"))
    assert "--stage-data: token files on node-local disk of 2/2 node(s)" in log

    again = _submit(tmp_path / "again", "--data", str(data), "--stage-data", f"{stage}/$SLURMD_NODENAME")
    assert again == plain
    record = json.loads((tmp_path / "again" / "staging.json").read_text())
    assert {f["action"] for e in record["nodes"].values() for f in e["files"]} == {"reused"}
    assert record["copied_bytes"] == 0
