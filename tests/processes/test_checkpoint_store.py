"""Checkpoints in object storage (``--checkpoint-store``, issue 42) on real gloo processes against a
real S3 server (``rclone serve s3``, the ``s3_server`` fixture): every rank uploads its files after
the local save, the step is committed only when all are in, retention applies to the store, and a
run in a new run directory (another cluster) resumes from the store on another world size; the
faults: a store unreachable for a while, a rank killed mid-upload, a damaged object."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import hpc
from dist_helpers import launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.checkpointing.checkpoint_store import CheckpointStore, marker_name
from hpc_hsdp.rundir.checkpointing.state import complete_checkpoints
from hpc_hsdp.rundir.checkpointing.store_record import read_store_record
from hpc_hsdp.rundir.files import read_jsonl

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

URL = "s3://ckpt/runs/a"


def tiny(**changes) -> TrainingSpec:
    fields = dict(
        layers=1,
        width=32,
        heads=4,
        seq_len=8,
        global_batch_size=8,
        vocab_size=64,
        steps=6,
        seed=3,
        checkpoint_every=2,
        keep_checkpoints=2,
        checkpoint_store=URL,
        tracker="none",
    )
    fields.update(changes)
    return TrainingSpec.of(**fields)


def spec_for(run_dir: Path, training: TrainingSpec) -> RunSpec:
    return RunSpec(shard_size=2, run_dir=str(run_dir), device="cpu", training=training, timeout_s=60)


def rank0_log(outcomes) -> str:
    return next(o.log for o in outcomes if o.procid == 0)


def store_steps() -> tuple[list[int], list[int]]:
    return CheckpointStore.open(URL).listing()


def test_each_step_is_committed_once_every_rank_uploaded_and_a_new_run_dir_resumes_from_it(s3_server, tmp_path):
    run = tmp_path / "run"
    outcomes = launch(spec_for(run, tiny()), tasks_per_node=[2, 2], timeout_s=240)
    store = CheckpointStore.open(URL)
    committed, uncommitted = store.listing()
    assert (committed, uncommitted) == ([4, 6], [])  # --keep-checkpoints 2 in the store too
    for step in committed:
        manifest = store.manifest(step)
        assert manifest is not None and len(manifest["files"]) == 5  # 4 ranks' shards + .metadata
        assert sorted(store.markers(step)) == [0, 1, 2, 3]
        assert store.sizes(step)[".metadata"] == manifest["files"][".metadata"]["bytes"]
    assert (s3_server.root / "ckpt" / "runs" / "a" / "step-000006" / "uploaded" / marker_name(3)).is_file()
    record = read_store_record(run)
    assert record["committed_step"] == 6 and record["url"] == URL and record["uploading"] is None
    assert "committed in s3://ckpt/runs/a" in rank0_log(outcomes)
    for path in run.rglob("*"):  # no key reaches the run directory
        if path.is_file():
            data = path.read_bytes()
            assert s3_server.secret_key.encode() not in data and s3_server.access_key.encode() not in data, path

    # another cluster: an empty run directory, 2 ranks instead of 4 (resharded on load), 8 steps
    moved = tmp_path / "moved"
    again = launch(spec_for(moved, tiny(steps=8)), tasks_per_node=[1, 1], timeout_s=240)
    log = rank0_log(again)
    assert "fetched step 6 from s3://ckpt/runs/a" in log and "resumed from step 6" in log
    assert [r["step"] for r in read_jsonl(moved / "metrics.jsonl")] == [7, 8]
    assert store_steps() == ([6, 8], [])


def test_a_damaged_object_is_caught_by_the_manifest_and_never_loaded(s3_server, tmp_path):
    launch(spec_for(tmp_path / "run", tiny()), tasks_per_node=[2, 2], timeout_s=240)
    shard = s3_server.root / "ckpt" / "runs" / "a" / "step-000006" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    shard.write_bytes(bytes(data))
    moved = tmp_path / "moved"
    again = launch(spec_for(moved, tiny(steps=7)), tasks_per_node=[2, 2], timeout_s=240)
    log = rank0_log(again)
    assert "__1_0.distcp has the manifest's size but not its bytes (CRC-32 differs)" in log
    assert "resumed from step 4" in log
    assert [r["step"] for r in read_jsonl(moved / "metrics.jsonl")] == [5, 6, 7]
    assert [s for s, _ in complete_checkpoints(moved)][-1] == 7


def test_a_rank_killed_mid_upload_leaves_its_step_uncommitted_and_the_next_job_resumes_from_the_last_committed(
    s3_server, tmp_path
):
    run = tmp_path / "run"
    outcomes = launch(
        spec_for(run, tiny(steps=8)),
        tasks_per_node=[2, 2],
        timeout_s=240,
        extra_env={"HPC_HSDP_FAULT_KILL_IN_UPLOAD": "1:4", "HPC_HSDP_FAULT_STEP_DELAY_S": "0.5"},
        expect_failure=True,
    )
    assert not all(o.ok for o in outcomes)
    committed, uncommitted = store_steps()
    assert committed == [2] and 4 in uncommitted  # rank 1's files of step 4 never all arrived
    step4 = s3_server.root / "ckpt" / "runs" / "a" / "step-000004"
    assert not (step4 / "COMPLETE").exists() and not (step4 / "manifest.json").exists()
    moved = tmp_path / "moved"  # the requeued job on a node that does not see the old run directory
    again = launch(spec_for(moved, tiny(steps=8)), tasks_per_node=[2, 2], timeout_s=240)
    assert "resumed from step 2" in rank0_log(again)
    assert store_steps() == ([6, 8], [])  # the abandoned step 4 went with the retention


def test_an_unreachable_store_delays_the_commits_and_training_goes_on(s3_server, tmp_path):
    run = tmp_path / "run"
    outage: dict[str, float] = {}

    def take_the_store_away() -> None:
        deadline = time.monotonic() + 120
        while not (run / "checkpoints" / "step-000002").is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)
        s3_server.stop()
        outage["from"] = time.time()
        time.sleep(8)
        s3_server.start()
        outage["to"] = time.time()

    watcher = threading.Thread(target=take_the_store_away, daemon=True)
    watcher.start()
    launch(
        spec_for(run, tiny(steps=8)),
        tasks_per_node=[2, 2],
        timeout_s=240,
        extra_env={"HPC_HSDP_FAULT_STEP_DELAY_S": "0.3"},
    )
    watcher.join(timeout=60)
    assert outage.get("to"), "the store was never taken away"
    steps = {r["step"]: r["wall_time"] for r in read_jsonl(run / "metrics.jsonl")}
    assert sorted(steps) == list(range(1, 9))
    assert any(outage["from"] < t < outage["to"] for t in steps.values())  # training went on meanwhile
    committed, uncommitted = store_steps()
    assert committed[-1] == 8 and uncommitted == []
    base = s3_server.root / "ckpt" / "runs" / "a"
    for folder in base.iterdir():  # nothing half-written is committed
        if (folder / "COMPLETE").exists():
            manifest = CheckpointStore.open(URL).manifest(int(folder.name.split("-")[1]))
            assert all((folder / name).stat().st_size == rec["bytes"] for name, rec in manifest["files"].items())


@pytest.mark.parametrize(
    ("url", "env", "said"),
    [
        ("s3://nobucket/runs/a", {}, "bucket 'nobucket' does not exist"),
        ("s3://ckpt/runs/a", {"AWS_SECRET_ACCESS_KEY": "not-the-secret-key"}, "the store refused the write"),
        ("s3:///runs/a", {}, "names no bucket"),
        ("s3://ckpt/runs/a", {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "the store could not be written"),
    ],
)
def test_a_store_that_cannot_take_the_checkpoints_is_refused_before_the_queue(
    s3_server, tmp_path, local_submit, url, env, said
):
    run = tmp_path / "run"
    done = hpc(*local_submit(run, "--steps", "2", "--checkpoint-store", url), env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], lines
    assert "Traceback" not in done.stderr and s3_server.secret_key not in done.stderr
    assert not run.exists()  # nothing written


def test_a_submitted_job_uploads_and_status_shows_the_store(s3_server, tmp_path, local_submit):
    run = tmp_path / "run"
    done = hpc(
        *local_submit(run, "--steps", "4", "--checkpoint-every", "2", "--tracker", "none", "--checkpoint-store", URL),
        "--wait",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    shown = hpc("status", str(run), timeout=60)
    assert "store: s3://ckpt/runs/a: step 4 committed" in shown.stdout, shown.stdout
    as_json = json.loads(hpc("status", str(run), "--json", timeout=60).stdout)
    assert as_json["checkpoint_store"]["committed_step"] == 4 and as_json["checkpoint_store"]["uploading"] is None
    for path in [*run.rglob("*"), *tmp_path.glob("**/*.sbatch")]:  # neither key in the run directory, script or logs
        if path.is_file():
            assert s3_server.secret_key.encode() not in path.read_bytes(), path
    again = hpc(*local_submit(run, "--steps", "4", "--checkpoint-store", URL), timeout=120)
    assert again.returncode == 2 and "already" in again.stderr  # the run directory (and the store) hold step 4
