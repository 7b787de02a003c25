"""--tracker tensorboard,wandb,mlflow: one tracker run per run directory, every step once.

A real 1 x 2 gloo run is crashed (rank 1 raises after the last checkpoint), resumed, stopped
by the warning signal and resumed again, all into one run directory: MLflow's own client finds
one run whose metric history has every step (the redone ones twice, marked with their attempt),
the W&B offline files (read with wandb's own record schema) hold one run whose history, rewound
at the crash, has every step once, and TensorBoard's reader the same. A tracker whose store
cannot be written is a warning; the job submitted through the local emulator completes. The
option alone: tests/fast/test_trackers.py.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
from cli_helpers import hpc

from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.rundir.observation.tracker_runs import read_tracker_runs
from hpc_hsdp.rundir.training.scalars import record_scalars
from tests.trackers_helpers import TINY

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- reading W&B's offline files


def wandb_records(path: Path):
    """The records of an offline run's ``.wandb`` file: W&B's header (``:W&B``, 0xBEE1, version),
    then LevelDB-log framing (32 KiB blocks, each chunk crc32c, length, type) around
    ``wandb_internal_pb2.Record`` protos, W&B's own record schema."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, data[:7]
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def wandb_attempts(run_dir: Path) -> list[dict]:
    """Each offline attempt's run id, branch point (rewind) step, config and history rows, in order
    (an attempt killed before W&B's service wrote its first records leaves a file of none)."""
    found = []
    for path in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        entry = {"run_id": None, "rewind_to": None, "config": {}, "rows": []}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                entry["run_id"] = record.run.run_id
                if record.run.HasField("branch_point"):
                    entry["rewind_to"] = int(record.run.branch_point.value)
                entry["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "config":
                entry["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
            elif kind == "history":
                row = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                entry["rows"].append(row)
        found.append(entry)
    return found


def wandb_history(attempts: list[dict]) -> dict[int, dict]:
    """The run's history as the server builds it from the files synced in order: a rewind drops
    the steps after its branch point."""
    history: dict[int, dict] = {}
    for entry in attempts:
        if entry["rewind_to"] is not None:
            history = {s: row for s, row in history.items() if s <= entry["rewind_to"]}
        for row in entry["rows"]:
            assert row["_step"] not in history, f"step {row['_step']} logged twice"
            history[row["_step"]] = row
    return history


# ----------------------------------------------------------------------------- a real run, crashed, stopped, resumed


def _spec(run: Path, steps: int):
    from hpc_hsdp.job.spec import RunSpec

    training = TrainingSpec.of(
        layers=1,
        width=32,
        heads=4,
        seq_len=8,
        batch_size=2,
        vocab_size=64,
        steps=steps,
        seed=3,
        checkpoint_every=3,
        straggler_every=0,
        tracker="tensorboard,wandb,mlflow",
    )
    return RunSpec(shard_size=2, run_dir=str(run), device="cpu", training=training, timeout_s=60)


def _rank0(outcomes) -> str:
    return next(o.log for o in outcomes if o.procid == 0)


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_crashed_stopped_and_resumed_runs_leave_one_tracker_run_with_every_step(tmp_path, monkeypatch):
    from dist_helpers import launch
    from mlflow.tracking import MlflowClient

    for name in ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    # attempt 1: rank 1 raises at the start of step 6: steps 1-5 logged, the checkpoint of step 3 kept
    first = launch(_spec(run, 8), tasks_per_node=[2], extra_env={"HPC_HSDP_FAULT_RAISE_AT": "1:6"}, expect_failure=True)
    assert not all(o.ok for o in first)
    # attempt 2 resumes from step 3 (4 and 5 are trained again) and stops on the warning signal after step 6
    second = launch(
        _spec(run, 8), tasks_per_node=[2], extra_env={"SLURM_RESTART_COUNT": "1", "HPC_HSDP_FAULT_SIGNAL_AT": "0:6"}
    )
    assert {o.value["steps"] for o in second} == {6}
    # attempt 3, submitted again with more steps, resumes from step 6 (nothing redone) and completes 7-10
    third = launch(_spec(run, 10), tasks_per_node=[2], extra_env={"SLURM_RESTART_COUNT": "2"})
    assert {(o.value["start_step"], o.value["steps"]) for o in third} == {(6, 10)}
    for outcomes in (first, second, third):
        assert "warning: tracker" not in _rank0(outcomes), _rank0(outcomes)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    expected = {r["step"]: record_scalars(r) for r in records}
    ids = read_tracker_runs(run)
    assert ids["wandb"]["attempts"] == 3 and ids["mlflow"]["attempts"] == 3

    # MLflow: one run, found with its own client in the run directory's store
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("hpc-hsdp")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]]
    found = runs[0]
    assert found.info.status == "FINISHED" and found.info.run_name == "run"
    assert found.data.params["steps"] == "8" and found.data.params["shard_size"] == "2"
    assert found.data.tags["hpc_hsdp.attempt3.steps"] == "10"
    assert found.data.tags["hpc_hsdp.redone_steps"] == "4-5 (attempt 2)"
    history = client.get_metric_history(found.info.run_id, "loss/train")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 4, 5, 5, 6, 7, 8, 9, 10]
    attempt_of = {}
    for m in client.get_metric_history(found.info.run_id, "attempt"):
        attempt_of.setdefault(m.step, []).append(int(m.value))
    assert {s: sorted(a) for s, a in attempt_of.items()} == {
        **{s: [1] for s in (1, 2, 3)},
        4: [1, 2],
        5: [1, 2],
        6: [2],
        **{s: [3] for s in (7, 8, 9, 10)},
    }
    latest = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        latest[m.step] = m.value  # a step's value is its latest attempt's
    assert all(math.isclose(latest[s], expected[s]["loss/train"], rel_tol=1e-6) for s in expected)

    # W&B: three offline attempts of one run; rewound to step 3 at the crash; every step once
    attempts = wandb_attempts(run)
    assert len(attempts) == 3 and {a["run_id"] for a in attempts} == {ids["wandb"]["run_id"]}
    assert [a["rewind_to"] for a in attempts] == [None, 3, None]
    assert attempts[0]["config"]["steps"] == 8 and attempts[2]["config"]["steps"] == 10
    assert attempts[0]["config"]["tracker"] == "tensorboard,wandb,mlflow"
    assert [[row["_step"] for row in a["rows"]] for a in attempts] == [[1, 2, 3, 4, 5], [4, 5, 6], [7, 8, 9, 10]]
    wandb_steps = wandb_history(attempts)
    assert sorted(wandb_steps) == list(range(1, 11))
    for step, scalars in expected.items():
        for tag, value in scalars.items():
            assert math.isclose(wandb_steps[step][tag], value, rel_tol=1e-6, abs_tol=1e-30), (step, tag)

    # TensorBoard, purged at each resume: the same steps once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss/train")] == list(range(1, 11))


# ----------------------------------------------------------------------------- a tracker that fails


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_tracker_that_cannot_write_is_a_warning_and_the_job_completes(tmp_path, local_submit):
    run = tmp_path / "run"
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory\n")
    env = {"MLFLOW_TRACKING_URI": (blocker / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true"}
    out = hpc(*local_submit(run, *TINY, "--tracker", "mlflow", "--steps", "3", "--wait"), env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    logs = "".join(p.read_text(errors="replace") for p in (run / "logs").glob("*_log.*"))
    warnings = [line for line in logs.splitlines() if "warning: tracker mlflow is off for this attempt" in line]
    assert len(warnings) == 1 and "training goes on without it" in warnings[0], logs[-3000:]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert not (run / "tb").exists()  # --tracker mlflow alone: no TensorBoard files
    # named where the user looks, with the reason: submit --wait (once) and status
    said = [line for line in out.stderr.splitlines() if "tracker mlflow is off: it could not start" in line]
    assert len(said) == 1 and said[0].startswith("hpc-hsdp: "), out.stderr
    status = hpc("status", str(run))
    assert "tracker mlflow is off: it could not start" in status.stdout, status.stdout


# ----------------------------------------------------------------------------- cancelled and submitted again


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_a_cancelled_job_submitted_again_continues_one_mlflow_and_one_wandb_run(tmp_path, local_submit, monkeypatch):
    import time

    from mlflow.tracking import MlflowClient

    env = {"WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": None, "WANDB_MODE": None, "WANDB_DIR": None}
    run = tmp_path / "run"
    job = local_submit(run, *TINY, "--tracker", "wandb,mlflow", "--steps", "30", "--checkpoint-every", "2")
    first = hpc(*job, env={**env, "HPC_HSDP_FAULT_STEP_DELAY_S": "0.5"})
    assert first.returncode == 0, first.stdout + first.stderr
    deadline = time.monotonic() + 150
    while len((run / "metrics.jsonl").read_text().splitlines() if (run / "metrics.jsonl").exists() else []) < 3:
        assert time.monotonic() < deadline, hpc("logs", str(run)).stdout
        time.sleep(0.3)
    assert hpc("cancel", str(run)).returncode == 0
    deadline = time.monotonic() + 60
    while json.loads(hpc("status", str(run), "--json").stdout)["state"] not in ("CANCELLED", "COMPLETED", "FAILED"):
        assert time.monotonic() < deadline
        time.sleep(0.5)
    stopped_at = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert 3 <= stopped_at < 30
    again = hpc(*job, "--wait", env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumes from step" in again.stderr
    logs = "".join(p.read_text(errors="replace") for p in (run / "logs").glob("*_log.*"))
    assert "warning: tracker" not in logs, logs[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 31))
    ids = read_tracker_runs(run)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    runs = client.search_runs([client.get_experiment_by_name("hpc-hsdp").experiment_id])
    assert [r.info.run_id for r in runs] == [ids["mlflow"]["run_id"]] and runs[0].info.status == "FINISHED"
    latest = {}
    for m in sorted(client.get_metric_history(ids["mlflow"]["run_id"], "loss/train"), key=lambda m: m.timestamp):
        latest[m.step] = m.value
    assert sorted(latest) == list(range(1, 31))
    assert all(math.isclose(latest[r["step"]], r["loss"], rel_tol=1e-6) for r in records)

    attempts = wandb_attempts(run)
    assert len(attempts) == 2 and {a["run_id"] for a in attempts} - {None} == {ids["wandb"]["run_id"]}
    assert attempts[1]["run_id"] == ids["wandb"]["run_id"]  # the one that completed
    history = wandb_history(attempts)
    assert sorted(history) == list(range(1, 31))
    assert all(math.isclose(history[r["step"]]["loss/train"], r["loss"], rel_tol=1e-6) for r in records)
