"""The Weights & Biases tracker (``--tracker wandb``; the ``wandb`` extra).

Offline unless the environment says otherwise: ``WANDB_MODE`` set by the user wins (``online``
where the nodes reach the server), else ``offline``, the run's files under
``<run-dir>/wandb/offline-run-*`` (``WANDB_DIR`` moves them) for ``wandb sync`` later. The
project is ``WANDB_PROJECT`` or ``hpc-hsdp``; the entity W&B's own (``WANDB_ENTITY``); the
run's name the run directory's; its config the job's options.

One run per run directory: its id is kept in ``trackers.json``, and every later attempt
opens the same id (``resume="allow"``). After a crash resumed from an older checkpoint the
attempt rewinds the run to the checkpoint's step (``resume_from="<id>?_step=<step>"``), so
the steps trained again replace the ones logged before; offline, the rewind is written into
the attempt's ``.wandb`` file (the run record's branch point) and done by the server at
``wandb sync``. Where the server refuses a rewind, the attempt resumes the run instead and
W&B keeps the first values of the redone steps (it drops a step below the run's last).
"""

from __future__ import annotations

import os
import secrets
import string

from hpc_hsdp.rundir.observation.tracker_runs import tracker_run, write_tracker_run
from hpc_hsdp.task.observation.log import note

DEFAULT_PROJECT = "hpc-hsdp"


class WandbTracker:
    name = "wandb"
    durable = False
    """Its rows go to W&B's service process, which writes them later: they count once the run closed."""

    def __init__(self, run, *, offline_dir: str | None, through: int) -> None:
        self.run = run
        self.offline_dir = offline_dir
        self.through = through
        """The step after which this attempt logs (the run holds the rows before it)."""

    def log(self, step: int, scalars: dict[str, float], wall_time: float | None) -> None:
        self.run.log(scalars, step=step)

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=1 if outcome == "error" else 0)
        if self.offline_dir is not None and outcome == "completed":
            note(f"W&B run {self.run.id} is offline; upload it with: wandb sync {self.offline_dir}/offline-run-*")


def new_run_id() -> str:
    """Eight lowercase letters and digits, as W&B's own run ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def open_tracker(start) -> WandbTracker:
    import wandb  # noqa: PLC0415 - an optional extra, slow to import: rank 0's tracker thread only

    entry = tracker_run(start.run_dir, "wandb")
    if os.environ.get("WANDB_MODE") == "":
        del os.environ["WANDB_MODE"]  # set empty: not set (W&B itself would refuse the empty mode)
    mode = os.environ.get("WANDB_MODE") or "offline"
    project = (entry or {}).get("project") or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
    run_id = (entry or {}).get("run_id") or new_run_id()
    attempts = int((entry or {}).get("attempts", 0)) + 1
    through = start.continues_after(entry)
    kept = {"run_id": run_id, "project": project, "attempts": attempts, "logged_through": through}
    # kept before the run starts: an attempt that dies in its first step still leaves the id to continue
    write_tracker_run(start.run_dir, "wandb", {**kept, "started": bool((entry or {}).get("started"))})
    root = os.environ.get("WANDB_DIR") or str(start.run_dir)
    common = {
        "project": project,
        "name": start.name,
        "dir": root,
        "mode": mode,
        "settings": wandb.Settings(console="off", silent=True),
    }
    run = None
    redone = start.redone_after(through)
    if (entry or {}).get("started") and len(redone):
        try:
            run = wandb.init(resume_from=f"{run_id}?_step={through}", **common)
        except Exception as exc:  # noqa: BLE001 - a server without rewind: resume instead
            wandb.teardown()  # the failed init's settings must not reach the next one
            note(
                f"warning: W&B did not rewind run {run_id} to step {through} ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:200]}); steps {redone.start}-{redone.stop - 1} keep "
                f"their first values there"
            )
    if run is None:
        run = wandb.init(id=run_id, resume="allow", **common)
    write_tracker_run(start.run_dir, "wandb", {**kept, "started": True})
    run.config.update(start.config, allow_val_change=True)
    offline_dir = os.path.join(root, "wandb") if mode == "offline" else None
    return WandbTracker(run, offline_dir=offline_dir, through=through)
