"""One eval job per checkpoint (``--eval-job COMMAND``): its submission by rank 0 and its wrapper.

Rank 0 of the training job calls :func:`submit_due` whenever a checkpoint may have been
completed (after a save is committed, at resume, after the final save): every complete
checkpoint whose step has no record under ``<run_dir>/evals/`` is claimed (``O_EXCL``, see
:mod:`hpc_hsdp.rundir.training.evals`) and submitted: on SLURM ``sbatch --parsable --wrap`` of one task
on one node, in the training job's partition and account, its output in ``evals/step-N.out``; on
the local emulator (or with no scheduler) a detached background process. A step is submitted
once across requeues and resubmits; a submission that fails is recorded, never raised:
training goes on either way.

The job runs ``python -m hpc_hsdp.batch_shell.eval_job RUN_DIR STEP -- COMMAND``, :func:`main`: it runs
the command (``sh -c``), takes its result, the JSON object it wrote to ``{result}`` or else the
last JSON object line it printed, and writes ``evals/step-N.result.json`` and a line of
``evals.jsonl``. Standard library only: no torch.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from hpc_hsdp.files import UnreadableFile, open_for_writing, read_json, write_atomically
from hpc_hsdp.rundir.checkpointing.state import checkpoint_root, complete_checkpoints, step_dir_name
from hpc_hsdp.rundir.files import append_jsonl
from hpc_hsdp.rundir.training.evals import (
    DONE,
    EVALS_LOG,
    FAILED,
    MAX_RESULT_BYTES,
    RUNNING,
    claim,
    evals_dir,
    last_json_object,
    metrics_file_path,
    output_path,
    record_submission,
    recorded_steps,
    result_path,
    steps_to_submit,
    substitute,
)
from hpc_hsdp.scheduler.backends import task_environment

_KEPT_VARIABLES = ("SLURM_CONF", "HPC_HSDP_SLURM_TIMEOUT", "HPC_HSDP_CONFIG", "HPC_HSDP_PROFILE")
_DROPPED_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "HPC_HSDP_", "TORCHELASTIC_", "PMI_", "PMIX_", "OMPI_")
_DROPPED = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
_TAIL_LINES = 200
"""The wrapper keeps the command's last lines of output to find its JSON result in."""


def eval_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The training task's environment without what belongs to its job and its rank (SLURM's and
    torch.distributed's variables, hpc-hsdp's test hooks), with this hpc-hsdp first on PYTHONPATH
    (the eval job runs the wrapper of the code that trains, a ``--snapshot-code`` copy too)."""
    out = {
        k: v for k, v in env.items() if k in _KEPT_VARIABLES or not (k.startswith(_DROPPED_PREFIXES) or k in _DROPPED)
    }
    package_root = str(Path(__file__).resolve().parents[2])  # the directory that holds hpc_hsdp/
    paths = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != package_root]
    out["PYTHONPATH"] = os.pathsep.join([package_root, *paths])
    return out


def wrapper_argv(run_dir: str, step: int, command: str, *, python: str | None = None) -> list[str]:
    """``python -m hpc_hsdp.batch_shell.eval_job RUN_DIR STEP -- COMMAND`` with the placeholders substituted."""
    inner = substitute(
        command,
        checkpoint=str(checkpoint_root(run_dir) / step_dir_name(step)),
        step=step,
        run_dir=str(run_dir),
        result=str(metrics_file_path(run_dir, step)),
    )
    return [python or sys.executable, "-m", "hpc_hsdp.batch_shell.eval_job", str(run_dir), str(step), "--", inner]


def submit_one(run_dir: str, step: int, command: str, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """Submit step N's eval job through the backend of the job this task runs in: (job id, None)
    or (None, why not). Never raises."""
    try:
        return task_environment(env).submit_side_job(
            wrapper_argv(run_dir, step, command),
            name=f"eval-step-{step}",
            output=output_path(run_dir, step),
            env=eval_environment(env),
        )
    except Exception as exc:  # noqa: BLE001 - a submission's failure is recorded, never raised
        return None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def submit_due(
    run_dir: str | os.PathLike, command: str, *, every: int, last: int, env: Mapping[str, str] | None = None
) -> list[dict]:
    """Rank 0: submit the eval job of every complete checkpoint of the cadence (``every`` steps and
    the ``last``, :func:`~hpc_hsdp.rundir.training.evals.steps_to_submit`) without one (each step once,
    ever); the submission records written, oldest first. Never raises for a step: its record says
    what failed."""
    env = os.environ if env is None else env
    run_dir = str(run_dir)
    done = []
    checkpoints = [step for step, _ in complete_checkpoints(run_dir)]
    due = steps_to_submit(checkpoints, recorded_steps(run_dir), every=every, last=last)
    for step in due:
        try:
            if not claim(run_dir, step):
                continue
        except OSError as exc:
            done.append(
                {"step": step, "state": "submit-failed", "reason": f"cannot write {evals_dir(run_dir)} ({exc})"}
            )
            continue
        job_id, reason = submit_one(run_dir, step, command, env)
        done.append(record_submission(run_dir, step, job_id=job_id, reason=reason))
    return done


# ----------------------------------------------------------------------------- the wrapper, in the eval job


def result_of(output_tail: str, result_file: Path) -> tuple[dict | None, str | None]:
    """The command's result: the JSON object in ``{result}``'s file when it wrote one, else the last
    JSON object line it printed; (metrics, None) or (None, why none)."""
    try:
        value = read_json(result_file, max_bytes=MAX_RESULT_BYTES)
    except FileNotFoundError:
        value = None
    except (OSError, UnreadableFile) as exc:
        return None, " ".join(str(exc).split())[:200]
    if value is not None:
        if isinstance(value, dict):
            return value, None
        return None, f"{result_file} holds no JSON object"
    found = last_json_object(output_tail)
    return (found, None) if found is not None else (None, "it printed no JSON object line")


def _job_id(env: Mapping[str, str]) -> str:
    """The eval job's id: SLURM's; a detached process has none of the training job's (its
    environment lost them, :func:`eval_environment`), and is ``local-PID``."""
    return env.get("SLURM_JOB_ID") or f"local-{os.getpid()}"


def run_eval(run_dir: str, step: int, command: str, *, env: Mapping[str, str] | None = None) -> dict:
    """Run ``command`` (``sh -c``) as step N's eval, its output passed through to ours; the result
    record, written to ``evals/step-N.result.json`` and appended to ``evals.jsonl``."""
    env = os.environ if env is None else env
    job_id = _job_id(env)
    started = time.time()
    result_file = metrics_file_path(run_dir, step)
    base = {"step": step, "job_id": job_id, "started": started}
    _write_result(run_dir, step, {**base, "state": RUNNING})
    try:
        result_file.unlink()  # an earlier run's result is not this one's
    except FileNotFoundError:
        pass
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    try:
        proc = subprocess.Popen(
            ["sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, errors="replace"
        )
    except OSError as exc:
        record = {**base, "state": FAILED, "exit_code": 127, "metrics": {}, "reason": f"sh: {exc}"}
        return _finish(run_dir, step, record)
    assert proc.stdout is not None  # stdout=subprocess.PIPE
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate())  # scancel, time limit: recorded
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line[:MAX_RESULT_BYTES])
        code = proc.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)
    code = code if code >= 0 else 128 - code
    metrics, reason = result_of("".join(tail), result_file)
    state = DONE if code == 0 and metrics is not None else FAILED
    if code != 0:
        reason = f"the command exited with {code}"
    record = {**base, "state": state, "exit_code": code, "metrics": metrics or {}, "finished": time.time()}
    if reason:
        record["reason"] = reason
    return _finish(run_dir, step, record)


def _write_result(run_dir: str, step: int, record: dict) -> None:
    evals_dir(run_dir).mkdir(parents=True, exist_ok=True)
    write_atomically(result_path(run_dir, step), json.dumps(record) + "\n")


def _finish(run_dir: str, step: int, record: dict) -> dict:
    _write_result(run_dir, step, record)
    line = {k: record.get(k) for k in ("step", "job_id", "exit_code", "state", "metrics")}
    append_jsonl(Path(run_dir) / EVALS_LOG, line)
    return record


def _output_to(path: Path) -> None:
    """This process's stdout and stderr (and so its command's) appended to ``evals/step-N.out``,
    opened here without following a symlink (the scheduler was told ``/dev/null``: its
    ``--output`` would follow one planted there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_for_writing(path, append=True) as out:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)


USAGE = "usage: python -m hpc_hsdp.batch_shell.eval_job RUN_DIR STEP -- COMMAND"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 4 or argv[2] != "--" or not argv[1].isdigit():
        print(USAGE, file=sys.stderr)
        return 2
    run_dir, step, command = argv[0], int(argv[1]), shlex.join(argv[3:]) if len(argv) > 4 else argv[3]
    try:
        _output_to(output_path(run_dir, step))
        record = run_eval(run_dir, step, command)
    except OSError as exc:  # a symlink or FIFO planted in evals/ (UnsafeTarget), a full disk
        print(f"[hpc-hsdp] eval of step {step}: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(
        f"[hpc-hsdp] eval of step {step}: {record['state']}"
        + (f" ({record['reason']})" if record.get("reason") else ""),
        file=sys.stderr,
    )
    return 0 if record["state"] == DONE else (record["exit_code"] or 1)


if __name__ == "__main__":
    sys.exit(main())
