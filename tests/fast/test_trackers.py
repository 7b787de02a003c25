"""--tracker tensorboard,wandb,mlflow without a job: the option parses and is refused in one line
when its package is absent (absence made real in a child interpreter: the package cannot be
found on its path, the function under test runs unchanged); a tracker added on a resubmission
gets the history so far."""

from __future__ import annotations

import sys

import pytest
from cli_helpers import hpc

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.rundir.observation.tracker_runs import read_tracker_runs
from tests.trackers_helpers import TINY

# ----------------------------------------------------------------------------- the option


@pytest.mark.parametrize(
    ("given", "stored", "names"),
    [
        ("tensorboard", "tensorboard", ("tensorboard",)),
        ("wandb, MLflow", "wandb,mlflow", ("wandb", "mlflow")),
        ("mlflow,tensorboard,wandb", "mlflow,tensorboard,wandb", ("mlflow", "tensorboard", "wandb")),
        ("none", "none", ()),
    ],
)
def test_tracker_names(given, stored, names):
    training = TrainingSpec.of(tracker=given)
    assert (training.observation.tracker, training.observation.trackers) == (stored, names)
    assert training.to_args() == ([] if stored == "tensorboard" else ["--tracker", stored])


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("wandbb", "--tracker 'wandbb': 'wandbb' is no tracker; choose from tensorboard, wandb, mlflow"),
        ("wandb,wandb", "--tracker 'wandb,wandb' names a tracker twice"),
        ("none,mlflow", "'none' is no tracker"),
    ],
)
def test_a_bad_tracker_is_one_line(given, message):
    with pytest.raises(SpecError, match=message):
        TrainingSpec.of(tracker=given)


# the packages cannot be found on this interpreter's path, as where they are not installed
HIDE = """
import importlib.machinery, sys
class _Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in {HIDDEN}:
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [_Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
"""


@pytest.mark.parametrize("hidden", [("wandb",), ("mlflow",), ("tensorboard", "wandb")])
def test_a_tracker_that_is_not_installed_is_refused_before_anything_is_written(tmp_path, local_submit, hidden):
    run = tmp_path / "run"
    prelude = HIDE.replace("{HIDDEN}", repr(set(hidden)))
    out = hpc(*local_submit(run, *TINY, "--tracker", "tensorboard,wandb,mlflow", "--steps", "2"), prelude=prelude)
    first = hidden[0]
    extra = {"tensorboard": "tb"}.get(first, first)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.splitlines() == [
        f"hpc-hsdp: error: --tracker {first}: the {first} package is not installed for {sys.executable}; pip "
        f"install 'hpc-hsdp[{extra}]' in the job's environment, or leave {first} out of --tracker; nothing submitted"
    ]
    assert not run.exists()
    # the check finds, it does not import: nothing of wandb or mlflow loads on the command line
    probe = hpc(
        "render",
        "--nodes",
        "1",
        "--shard",
        "1",
        "--run-dir",
        str(run),
        "--venv",
        "none",
        "--tracker",
        "wandb,mlflow",
        prelude="import atexit, sys\natexit.register(lambda: print(sorted(m for m in sys.modules if m.split('.')[0] "
        "in ('wandb', 'mlflow', 'torch', 'tensorboard')), file=sys.stderr))\n",
    )
    assert probe.returncode == 0 and probe.stderr.strip() == "[]", probe.stderr
    assert "--tracker wandb,mlflow" in probe.stdout


# ----------------------------------------------------------------------------- a tracker added later


def test_a_tracker_added_on_a_resubmission_gets_the_history_so_far(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from hpc_hsdp.rundir.training.metrics import MetricsLog
    from hpc_hsdp.task.observation.trackers import Trackers, TrackerStart

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    run = tmp_path / "run"
    metrics = MetricsLog(run, start_step=0)
    rows = [{"step": s, "loss": 1.0 / s, "lr": 0.1, "wall_time": 1.0e9 + s} for s in range(1, 8)]
    for row in rows[:5]:  # steps 1-5 trained without MLflow, checkpoint at 5
        metrics.write(row)
    start = TrackerStart(run_dir=run, start_step=5, last_logged=5, total_steps=7, config={"steps": 7})
    trackers = Trackers(("mlflow",), start)
    for row in rows[5:]:
        metrics.write(row)
        trackers.log(row)
    trackers.close("completed")
    assert trackers.opened == ["mlflow"]
    entry = read_tracker_runs(run)["mlflow"]
    assert entry["logged_through"] == 7 and entry["attempts"] == 1
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    history = client.get_metric_history(entry["run_id"], "loss/train")
    assert [(m.step, m.value, m.timestamp) for m in sorted(history, key=lambda m: m.step)] == [
        (r["step"], r["loss"], int(r["wall_time"] * 1000)) for r in rows
    ]
    assert "hpc_hsdp.redone_steps" not in client.get_run(entry["run_id"]).data.tags


def test_the_history_a_tracker_catches_up_on_ends_at_a_line_that_is_no_record(tmp_path):
    from hpc_hsdp.rundir.files import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n5\n{"step": 2}\n')  # a number was row.get's AttributeError in the tracker thread
    assert read_jsonl(path) == [{"step": 1}]
    path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')  # torn
    assert read_jsonl(path) == [{"step": 1}]
