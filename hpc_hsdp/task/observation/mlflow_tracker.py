"""The MLflow tracker (``--tracker mlflow``; the ``mlflow`` extra, ``mlflow-skinny``).

The run goes to ``MLFLOW_TRACKING_URI`` (a tracking server, a database) where the environment
names one, else to a file store in ``<run-dir>/mlruns`` (``mlflow-skinny`` has no database
driver; MLflow 3 keeps its file store in maintenance mode and asks for
``MLFLOW_ALLOW_FILE_STORE=true``, which rank 0 sets for this store only). The experiment is
``MLFLOW_EXPERIMENT_NAME`` or ``hpc-hsdp``, the run's name the run directory's, its params the
job's options (a resumed job that changed one, ``--steps`` say, tags the new value as
``hpc_hsdp.attempt<N>.<option>``: MLflow refuses to change a param).

One run per run directory: its id is kept in ``trackers.json`` and every later attempt logs
into that run (``RUNNING`` again while it trains, then ``FINISHED``, ``KILLED`` when it stopped
to be resumed, or ``FAILED``). MLflow cannot overwrite a value: after a crash resumed from an
older checkpoint, the steps trained again are logged a second time, and every row carries
the ``attempt`` metric (1, 2, ... per attempt of this run) at its step, the run's
``hpc_hsdp.redone_steps`` tag lists them (``5-6 (attempt 2)``). A step's value is the one of
its latest attempt (``get_metric_history`` returns both; the later has the larger
``timestamp`` and the larger ``attempt``).
"""

from __future__ import annotations

import os

from hpc_hsdp.rundir.observation.tracker_runs import MLFLOW_DIR, tracker_run, write_tracker_run
from hpc_hsdp.task.observation.log import note

DEFAULT_EXPERIMENT = "hpc-hsdp"
REDONE_TAG = "hpc_hsdp.redone_steps"
ATTEMPT_METRIC = "attempt"
_BATCH = 100  # params per log_batch call (MLflow's limit)


class MlflowTracker:
    name = "mlflow"

    def __init__(self, client, run_id: str, attempt: int, *, through: int) -> None:
        from mlflow.entities import Metric  # noqa: PLC0415 - an optional extra: rank 0's tracker thread only

        self.client, self.run_id, self.attempt, self._metric = client, run_id, attempt, Metric
        self.through = through
        """The step after which this attempt logs (the run holds the rows before it)."""

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None) -> None:
        import time  # noqa: PLC0415 - (cheap) only where a row has no wall time

        stamp = int((wall_time if wall_time is not None else time.time()) * 1000)
        metrics = [self._metric(key, value, stamp, step) for key, value in scalars.items()]
        metrics.append(self._metric(ATTEMPT_METRIC, float(self.attempt), stamp, step))
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)

    def close(self, outcome: str) -> None:
        status = {"completed": "FINISHED", "error": "FAILED"}.get(outcome, "KILLED")
        self.client.set_terminated(self.run_id, status=status)


def tracking_uri(run_dir) -> str:
    """``MLFLOW_TRACKING_URI``, else the file store ``<run_dir>/mlruns`` as a ``file:`` URI."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / MLFLOW_DIR).resolve().as_uri()


def open_tracker(start) -> MlflowTracker:
    from mlflow.entities import Param, RunTag  # noqa: PLC0415 - an optional extra: rank 0's tracker thread only
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 - as above
    from mlflow.tracking import MlflowClient  # noqa: PLC0415 - as above

    uri = tracking_uri(start.run_dir)
    if "MLFLOW_TRACKING_URI" not in os.environ:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the run directory's own file store
    client = MlflowClient(tracking_uri=uri)
    entry = tracker_run(start.run_dir, "mlflow")
    run = None
    if entry is not None and entry.get("tracking_uri") == uri:
        try:
            run = client.get_run(entry["run_id"])
        except MlflowException as exc:
            note(
                f"warning: MLflow run {entry['run_id']} of this run directory is gone ({exc.error_code}); a new one starts"
            )
    elif entry is not None:
        note(f"warning: this run directory's MLflow run is in {entry.get('tracking_uri')}, not {uri}; a new one starts")
    if run is None:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        run = client.create_run(experiment_id, run_name=start.name, tags={"hpc_hsdp.run_dir": str(start.run_dir)})
        attempt, through, redone = 1, 0, range(0)
    else:
        assert entry is not None  # the run was found through it
        attempt = int(entry.get("attempts", 0)) + 1
        through = start.continues_after(entry)
        redone = start.redone_after(through)
        client.update_run(run.info.run_id, status="RUNNING")
    run_id = run.info.run_id
    write_tracker_run(
        start.run_dir,
        "mlflow",
        {
            "run_id": run_id,
            "experiment_id": run.info.experiment_id,
            "tracking_uri": uri,
            "attempts": attempt,
            "logged_through": through,
        },
    )
    logged = run.data.params
    params = [Param(k, str(v)) for k, v in start.config.items() if k not in logged]
    tags = [
        RunTag(f"hpc_hsdp.attempt{attempt}.{k}", str(v))
        for k, v in start.config.items()
        if logged.get(k, str(v)) != str(v)
    ]
    tags.append(RunTag("hpc_hsdp.attempts", str(attempt)))
    if len(redone):
        steps = f"{redone.start}-{redone.stop - 1} (attempt {attempt})"
        earlier = run.data.tags.get(REDONE_TAG)
        tags.append(RunTag(REDONE_TAG, f"{earlier}, {steps}" if earlier else steps))
    for first in range(0, max(len(params), 1), _BATCH):
        client.log_batch(run_id, params=params[first : first + _BATCH], tags=tags if first == 0 else [])
    return MlflowTracker(client, run_id, attempt, through=through)
