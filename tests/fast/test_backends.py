"""The scheduler backends behind one interface (hpc_hsdp.scheduler.backends), with fakes: SLURM's
statuses, cancel, logs directory and time limits from canned squeue/sacct/scontrol answers
(a fake runner), the emulator's from its state files and a fake process table; the code above
them routing each job to its backend; submitit's private hooks still where submitit_hooks.py
uses them (and the pin in pyproject.toml), and a submission through them with stand-in
sbatch/srun. No SLURM, no process of a job."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import time
from importlib.metadata import version
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_hsdp.errors import SchedulerError, SpecError
from hpc_hsdp.rundir.lifecycle import claim as claims
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.rundir.lifecycle.job_state import load_job_state, save_job_state
from hpc_hsdp.scheduler.backends import BACKEND_NAMES, CLUSTERS, backend, task_backend
from hpc_hsdp.scheduler.backends.base import Backend
from hpc_hsdp.scheduler.backends.local import LocalBackend
from hpc_hsdp.scheduler.backends.slurm import SlurmBackend
from hpc_hsdp.scheduler.backends.slurm_command import SchedulerTimeout
from hpc_hsdp.scheduler.emulator.allocation import EMULATOR_VARIABLE
from hpc_hsdp.scheduler.emulator.state_files import state_path
from hpc_hsdp.scheduler.status import JobStatus
from hpc_hsdp.submit_host import handle as handle_module
from hpc_hsdp.submit_host.handle import JobHandle, job_statuses

ROOT = Path(__file__).resolve().parents[2]


def record(root: Path, job_id: str, cluster: str = "slurm", *, ntasks: int = 2) -> JobRecord:
    run = root / f"run-{job_id}"
    (run / "logs").mkdir(parents=True, exist_ok=True)
    return JobRecord(
        job_id=job_id,
        cluster=cluster,
        run_dir=str(run),
        logs_dir=str(run / "logs"),
        job_name="t",
        ntasks=ntasks,
        launcher="srun",
        submitted_at=0.0,
    )


class CannedSlurm:
    """A fake runner: each command's canned (stdout, exit code, stderr) by its name, or the
    exception it raises; every call is kept."""

    def __init__(self, **answers) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv, **kwargs) -> subprocess.CompletedProcess:
        self.calls.append(list(argv))
        answer = self.answers[argv[0]]
        if isinstance(answer, Exception):
            raise answer
        out, code, err = answer if isinstance(answer, tuple) else (answer, 0, "")
        return subprocess.CompletedProcess(list(argv), code, out, err)

    @property
    def commands(self) -> list[str]:
        return [argv[0] for argv in self.calls]


def claim(run: JobRecord) -> None:
    claims.write_claim(run.run_dir, claims.CLAIMED, job_id=run.job_id, cluster=run.cluster, logs_dir="logs")


# ----------------------------------------------------------------------------- choice by name


def test_a_backend_is_chosen_by_the_name_a_record_holds():
    assert BACKEND_NAMES == ("slurm", "local")
    assert CLUSTERS == ("auto", "slurm", "local")
    assert isinstance(backend("slurm"), SlurmBackend) and backend("slurm").name == "slurm"
    assert isinstance(backend("local"), LocalBackend) and backend("local").name == "local"
    with pytest.raises(SpecError, match="neither slurm nor local"):
        backend("pbs")
    assert task_backend({EMULATOR_VARIABLE: "1", "SLURM_JOB_ID": "7"}).name == "local"
    assert task_backend({"SLURM_JOB_ID": "7"}).name == "slurm"
    # what the code above the backends reads instead of asking which one it has
    assert (SlurmBackend.has_time_limits, SlurmBackend.separate_machines) == (True, True)
    assert (LocalBackend.has_time_limits, LocalBackend.separate_machines) == (False, False)
    assert LocalBackend().requeue("7") is None


# ----------------------------------------------------------------------------- SLURM, canned answers


def test_slurm_statuses_of_many_jobs_ask_one_squeue_and_one_sacct(tmp_path):
    runs = [record(tmp_path, str(job_id)) for job_id in (1000, 1001, 1002, 1003, 1004)]
    claim(runs[2])
    runner = CannedSlurm(
        squeue="1000|RUNNING|None\n1001|PENDING|Priority\n", sacct="1002|COMPLETED|0:0\n1003|FAILED|1:0\n"
    )
    statuses = SlurmBackend(runner=runner).statuses(runs)
    assert runner.commands == ["squeue", "sacct"]
    assert "1000,1001,1002,1003,1004" in runner.calls[0] and "1002,1003,1004" in runner.calls[1]
    assert [statuses[r.run_dir].state for r in runs] == ["RUNNING", "PENDING", "COMPLETED", "FAILED", "UNKNOWN"]
    assert statuses[runs[1].run_dir].reason == "Priority" and statuses[runs[3].run_dir].exit_code == "1:0"
    assert all(s.controller_answered and s.current for s in statuses.values())
    assert load_job_state(runs[0].run_dir, "1000")["state"] == "RUNNING"  # SLURM's answer, recorded
    assert claims.read_claim(runs[2].run_dir)["state"] == claims.RELEASED  # it ended: the directory is free
    assert SlurmBackend(runner=CannedSlurm()).statuses([]) == {}  # nothing to ask: no call


def test_slurm_silent_controller_gives_the_last_known_state(tmp_path):
    run, never = record(tmp_path, "2000"), record(tmp_path, "2001")
    save_job_state(run.run_dir, "2000", state="RUNNING", restarts=1, now=time.time() - 90)
    silent = SchedulerTimeout("the SLURM controller c1 did not answer squeue within 1 s", command="squeue", timeout_s=1)
    runner = CannedSlurm(squeue=silent, sacct="2000|RUNNING|0:0\n")
    statuses = SlurmBackend(runner=runner).statuses([run, never])
    known, unknown = statuses[run.run_dir], statuses[never.run_dir]
    assert known.state == "RUNNING" and not known.current and known.controller_answered is False
    assert known.restarts == 1 and 85 < known.last_known_age_s() < 120
    assert known.note.startswith("the SLURM controller c1 did not answer squeue within 1 s (last known state RUNNING")
    assert unknown.state == "UNKNOWN" and "no state recorded before" in unknown.note


def test_slurm_status_of_one_job_asks_its_restarts_too(tmp_path):
    run = record(tmp_path, "3000")
    runner = CannedSlurm(squeue="3000|RUNNING|None\n", scontrol="JobId=3000 JobName=t Restarts=2 JobState=RUNNING\n")
    status = SlurmBackend(runner=runner).status(run)
    assert (status.state, status.restarts) == ("RUNNING", 2)
    assert runner.commands == ["squeue", "scontrol"]


def test_slurm_cancel_works_in_and_time_limits(tmp_path):
    run = record(tmp_path, "4000")
    shown = f"JobId=4000 StdErr=/x/logs/4000_0_log.err StdOut={run.logs_dir}/4000_0_log.out Restarts=0\n"
    runner = CannedSlurm(scancel="", scontrol=shown, squeue="1:00:00|2:00:00\n")
    slurm = SlurmBackend(runner=runner)
    slurm.cancel(run)
    assert runner.calls[-1] == ["scancel", "4000"]
    assert slurm.works_in(run) == Path(run.logs_dir)
    assert slurm.time_limits(run) == (3600.0, 7200.0)
    refused = SlurmBackend(runner=CannedSlurm(scancel=("", 1, "scancel: error: Kill job error on job id 4000\n")))
    with pytest.raises(SchedulerError, match="scancel 4000 failed: scancel: error: Kill job error"):
        refused.cancel(run)
    silent = SchedulerTimeout("the SLURM controller did not answer scancel within 1 s", command="scancel", timeout_s=1)
    with pytest.raises(SchedulerError, match=r"job 4000 may not be cancelled; see hpc-hsdp status .*run-4000"):
        SlurmBackend(runner=CannedSlurm(scancel=silent)).cancel(run)
    assert SlurmBackend(runner=CannedSlurm(scontrol=SchedulerError("no scontrol"))).works_in(run) is None


def test_slurm_fp8_refusal_reads_the_partitions_nodes(tmp_path):
    spec = SimpleNamespace(
        template=None,
        scheduler=SimpleNamespace(extra=(), partition="old", constraint=None),
        gpus_per_node=8,
    )
    sinfo = "old|n1|gpu:a100:8(S:0-1)|(null)\n"
    refusal = SlurmBackend(runner=CannedSlurm(sinfo=sinfo)).fp8_refusal(spec)
    assert refusal is not None and "a100" in refusal.lower() and "partition 'old'" in refusal
    assert SlurmBackend(runner=CannedSlurm(sinfo=("", 1, "invalid partition"))).fp8_refusal(spec) is None


# ----------------------------------------------------------------------------- the emulator, a fake process table


def _emulated(run: JobRecord, **state) -> Path:
    path = state_path(Path(run.logs_dir), run.job_id)
    path.write_text(json.dumps({"job_id": run.job_id, "exit_code": None, **state}))
    return path


def test_local_statuses_come_from_state_files_and_the_process_table(tmp_path):
    running, died, done, missing, broken = (record(tmp_path, str(j), "local") for j in (11, 12, 13, 14, 15))
    _emulated(running, state="RUNNING", supervisor_pid=4242)
    _emulated(died, state="RUNNING", supervisor_pid=4343)
    _emulated(done, state="COMPLETED", exit_code=0, supervisor_pid=4444)
    state_path(Path(broken.logs_dir), "15").write_text("{torn")
    for run in (died, done):
        claim(run)
    local = LocalBackend(alive=lambda pid: pid == 4242)  # only the first supervisor lives
    statuses = local.statuses([running, died, done, missing, broken])
    assert statuses[running.run_dir] == JobStatus(state="RUNNING")
    assert statuses[died.run_dir] == JobStatus(state="FAILED", exit_code="-1")  # its supervisor is gone
    assert statuses[done.run_dir] == JobStatus(state="COMPLETED", exit_code="0")
    assert statuses[missing.run_dir].state == statuses[broken.run_dir].state == "UNKNOWN"
    assert claims.read_claim(died.run_dir)["state"] == claims.read_claim(done.run_dir)["state"] == claims.RELEASED


def test_local_works_in_is_the_emulators_own_record(tmp_path):
    run = record(tmp_path, "21", "local")
    _emulated(run, state="RUNNING", supervisor_pid=1, logs_dir="/elsewhere/logs")
    assert LocalBackend(alive=lambda pid: True).works_in(run) == Path("/elsewhere/logs")
    _emulated(run, state="RUNNING", supervisor_pid=1, script="/older/logs/21_submission.sh")  # an older state file
    assert LocalBackend(alive=lambda pid: True).works_in(run) == Path("/older/logs")


def test_log_paths_are_the_rendered_scripts_for_every_backend(tmp_path):
    run = record(tmp_path, "31", "local", ntasks=3)
    logs = Path(run.logs_dir)
    for task in (2, 0, 10):
        for stream in ("out", "err"):
            (logs / f"31_{task}_log.{stream}").write_text("")
    (logs / "32_0_log.out").write_text("")  # another job's
    names = [p.name for p in LocalBackend().log_paths(run)]
    assert names == [f"31_{t}_log.{s}" for s in ("out", "err") for t in (0, 2, 10)]
    assert SlurmBackend().log_paths(run, 2) == [logs / "31_2_log.out", logs / "31_2_log.err"]


# ----------------------------------------------------------------------------- above the backends


class FakeBackend(Backend):
    name = "fake"
    title = "fake scheduler"
    has_time_limits = False
    separate_machines = False

    def __init__(self, calls: list) -> None:
        self.calls = calls

    def submit(self, spec, script, func, args, kwargs):
        raise AssertionError("not submitted here")

    def statuses(self, records):
        self.calls.append(("statuses", [r.job_id for r in records]))
        return {r.run_dir: JobStatus(state="RUNNING") for r in records}

    def cancel(self, record):
        self.calls.append(("cancel", record.job_id))

    def works_in(self, record):
        self.calls.append(("works_in", record.job_id))
        return Path(record.logs_dir)

    def requeue(self, job_id):
        return None

    def fp8_refusal(self, spec):
        return None


def test_the_code_above_routes_each_job_to_the_backend_its_record_names(tmp_path, monkeypatch):
    calls: list = []
    by_name = {}
    monkeypatch.setattr(handle_module, "backend", lambda name: by_name.setdefault(name, FakeBackend(calls)))
    runs = [record(tmp_path, "1", "slurm"), record(tmp_path, "2", "local"), record(tmp_path, "3", "slurm")]
    statuses = job_statuses(runs)
    assert set(statuses) == {r.run_dir for r in runs}
    assert sorted(calls) == [("statuses", ["1", "3"]), ("statuses", ["2"])]  # each scheduler asked once
    calls.clear()
    job = JobHandle(runs[1])
    assert job.status().state == "RUNNING" and job.time_limits() is None
    job.cancel()
    assert calls == [("statuses", ["2"]), ("works_in", "2"), ("cancel", "2")]
    assert job.backend is by_name["local"]


def test_no_code_outside_the_backends_asks_which_scheduler_it_is_on():
    """The branches on the scheduler's name, and the emulator's mark in a task's environment, live
    in hpc_hsdp/scheduler/backends (and the emulator they drive, hpc_hsdp/scheduler/emulator) only; elsewhere (the runtime and the pure plan too) a record's cluster
    only picks its backend (job_statuses groups the records by it), and a task asks its backend's
    facts (``task_backend(env).separate_machines``, ``.requeues``) or is told them."""
    package = ROOT / "hpc_hsdp"
    asks = ('== "local"', '== "slurm"', '!= "local"', '!= "slurm"', "HPC_HSDP_EMULATOR")
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if not {"backends", "emulator"} & set(path.relative_to(package).parts)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if any(ask in line for ask in asks) or ("cluster" in line and ("==" in line or "!=" in line))
    ]
    assert [f for f in found if "record.cluster == name]" not in f] == [], found


# ----------------------------------------------------------------------------- submitit's private hooks


def test_submitit_is_a_version_whose_hooks_are_known():
    import submitit  # noqa: PLC0415  (the backends load it only to submit)
    from submitit.core import utils  # noqa: PLC0415

    installed = tuple(int(part) for part in version("submitit").split(".")[:3])
    assert (1, 5, 4) <= installed < (1, 6), installed
    assert '"submitit>=1.5.4,<1.6"' in (ROOT / "pyproject.toml").read_text()
    hooks = {
        "_make_submission_file_text": ["self", "command", "uid"],
        "_make_submission_command": ["self", "submission_file_path"],
        "_num_tasks": ["self"],
    }
    for name, parameters in hooks.items():
        assert list(inspect.signature(getattr(submitit.SlurmExecutor, name)).parameters) == parameters, name
    assert submitit.SlurmExecutor.job_class is submitit.SlurmJob
    job = submitit.SlurmJob(folder="/nonexistent", job_id="5", tasks=(0, 1))
    assert [sub.paths.result_pickle.name for sub in job._sub_jobs] == ["5_0_result.pkl", "5_1_result.pkl"]
    assert "mode" in inspect.signature(job.watcher.is_done).parameters
    assert utils.JobPaths("/l", job_id="5").submitted_pickle == Path("/l/5_submitted.pkl")
    assert issubclass(utils.FailedJobError, Exception) and callable(utils.pickle_load)


def _stand_in_slurm(folder: Path, sbatch: str) -> dict:
    folder.mkdir()
    for name, body in (("sbatch", sbatch), ("srun", "exit 0")):
        (folder / name).write_text(f"#!/bin/sh\n{body}\n")
        (folder / name).chmod(0o755)
    return {"PATH": f"{folder}:{os.environ['PATH']}"}


def _spec(tmp_path: Path, **overrides) -> SimpleNamespace:
    values = {
        "log_dir": str(tmp_path / "logs"),
        "world_size": 4,
        "nodes": 2,
        "min_nodes": 2,
        "flexible": False,
        "launch": SimpleNamespace(launcher="srun"),
    }
    return SimpleNamespace(**{**values, **overrides})


def test_a_submission_through_the_hooks_sends_the_rendered_script(tmp_path, monkeypatch):
    from hpc_hsdp.scheduler.backends.submitit_hooks import FlexibleSlurmJob, submit_rendered  # noqa: PLC0415

    sent = tmp_path / "sent.sh"
    env = _stand_in_slurm(
        tmp_path / "bin", f'cp "$1" {sent}; echo "$*" > {tmp_path / "argv"}; echo "Submitted batch job 4242"'
    )
    monkeypatch.setenv("PATH", env["PATH"])
    script = "#!/bin/bash\n#SBATCH --job-name=rendered\necho the rendered script\n"
    job = submit_rendered(_spec(tmp_path), script, print, ("hello",), {})
    assert job.job_id == "4242" and sent.read_text() == script
    assert job.num_tasks == 4 and type(job).__name__ == "SlurmJob"
    assert (tmp_path / "logs" / "4242_submitted.pkl").is_file()
    flexible = submit_rendered(_spec(tmp_path, flexible=True, min_nodes=1), script, print, ("x",), {})
    assert isinstance(flexible, FlexibleSlurmJob) and (flexible.tasks_per_node, flexible.min_nodes) == (2, 1)
    launcher = submit_rendered(_spec(tmp_path, launch=SimpleNamespace(launcher="torchrun")), script, print, (), {})
    assert launcher.num_tasks == 2  # one task per node starts torchrun


def test_sbatch_refusing_or_silent_is_said_in_one_line(tmp_path, monkeypatch):
    from hpc_hsdp.scheduler.backends.submitit_hooks import submit_rendered  # noqa: PLC0415

    env = _stand_in_slurm(tmp_path / "bin", 'echo "sbatch: error: Invalid partition name specified" >&2; exit 1')
    monkeypatch.setenv("PATH", env["PATH"])
    with pytest.raises(SchedulerError, match="sbatch refused the job: .*Invalid partition name specified") as refused:
        submit_rendered(_spec(tmp_path), "#!/bin/bash\n", print, (), {})
    assert "\n" not in str(refused.value)
    env = _stand_in_slurm(tmp_path / "bin2", "sleep 30")
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("HPC_HSDP_SLURM_TIMEOUT", "0.5")
    start = time.monotonic()
    with pytest.raises(SchedulerTimeout, match="did not answer sbatch within 0.5 s"):
        submit_rendered(_spec(tmp_path), "#!/bin/bash\n", print, (), {})
    assert time.monotonic() - start < 5
