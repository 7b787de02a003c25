"""Nothing from a file runs as code (issue 26): hostile checkpoints, templates, exports, job
files and token data, and run-directory files truncated, garbage or huge. Each attack is the
real one (a pickle whose reduce would create a marker file, a sandbox-escaping template, a
symlink out of a directory, umask 077, a job id of ``--user=root``, token ids beyond the
vocabulary); the answer is one line and exit 2, or a safe fallback; never a traceback,
nothing run, nothing leaked, nothing half-written."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import UnreadableFile, UnsafeTarget, private_dir
from hpc_hsdp.plan.slurm_facts import check_job_id
from tests.hostile_helpers import MarkerPickle, _poison_bytes_entry, one_error_line, run_main

# ----------------------------------------------------------------------------- helpers


# ----------------------------------------------------------------------------- checkpoints (no process group)


def _tiny_checkpoint(path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=True)


def _state_to_load():
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


_state_to_load()  # at import: torch's first optimizer step sets TORCHINDUCTOR_CACHE_DIR, not a test's doing


def test_a_metadata_pickle_that_runs_a_command_is_refused_unrun(tmp_path):
    from hpc_hsdp.task.checkpointing.safe_dcp import UnsafeCheckpoint, load_state, unsafe_content

    checkpoint, marker = tmp_path / "ck", tmp_path / "MARKER"
    _tiny_checkpoint(checkpoint)
    assert unsafe_content(checkpoint) is None
    load_state(_state_to_load(), checkpoint, no_dist=True)  # a clean one loads

    (checkpoint / ".metadata").write_bytes(pickle.dumps(MarkerPickle(marker)))
    problem = unsafe_content(checkpoint)
    assert problem is not None and "posix.system" in problem and "\n" not in problem
    with pytest.raises(BaseException) as caught:  # DCP wraps it in its CheckpointException
        load_state(_state_to_load(), checkpoint, no_dist=True)
    assert "posix.system" in repr(caught.value) or isinstance(caught.value, UnsafeCheckpoint)
    assert not marker.exists()


def test_a_non_tensor_entry_that_runs_a_command_is_refused_unrun(tmp_path):
    import torch.distributed.checkpoint as dcp

    from hpc_hsdp.task.checkpointing.safe_dcp import load_state, unsafe_content

    checkpoint, marker = tmp_path / "ck", tmp_path / "MARKER"
    _tiny_checkpoint(checkpoint)
    _poison_bytes_entry(checkpoint, marker)
    problem = unsafe_content(checkpoint)
    assert problem is not None and "optim.param_groups.0.lr" in problem
    with pytest.raises(BaseException):  # noqa: B017,PT011 - DCP's CheckpointException is a BaseException
        load_state(_state_to_load(), checkpoint, no_dist=True)
    assert not marker.exists()
    # what the defence is for: DCP's own load runs the command
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    dcp.load(_state_to_load(), checkpoint_id=str(copy), no_dist=True)
    assert marker.exists()


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from hpc_hsdp.task.checkpointing.safe_dcp import read_metadata_file, unsafe_content

    checkpoint = tmp_path / "ck"
    _tiny_checkpoint(checkpoint)
    metadata = read_metadata_file(checkpoint / ".metadata")
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index] = _StorageInfo("../../secret", 0, 10)
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    assert "outside the checkpoint" in unsafe_content(checkpoint)


# ----------------------------------------------------------------------------- templates


ESCAPES = [
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ joiner.__init__.__globals__['os'].system('touch MARKER') }}",
    "{% set x = [].append(1) %}{{ x }}",
]


@pytest.mark.parametrize("body", ESCAPES)
def test_a_sandbox_escaping_template_is_one_line_and_nothing_runs_or_is_written(tmp_path, capsys, monkeypatch, body):
    monkeypatch.chdir(tmp_path)
    template = tmp_path / "evil.sbatch.j2"
    template.write_text("#!/bin/bash\n" + body.replace("MARKER", str(tmp_path / "MARKER")) + "\n")
    out = tmp_path / "job.sbatch"
    code, _, err = run_main(
        ["render", "--shard", "8", "--venv", "none", "--run-dir", str(tmp_path / "r"), "--template", str(template)]
        + ["-o", str(out)],
        capsys,
    )
    one_error_line(code, err, "evil.sbatch.j2")
    assert not (tmp_path / "MARKER").exists() and not out.exists()


def test_the_shipped_template_renders_in_the_sandbox():
    import jinja2.sandbox

    from hpc_hsdp.submit_host.render import template_environment

    assert isinstance(template_environment(), jinja2.sandbox.ImmutableSandboxedEnvironment)


# ----------------------------------------------------------------------------- umask


@pytest.mark.parametrize(("umask", "script_mode"), [(0o077, 0o700), (0o022, 0o755), (0o027, 0o750)])
def test_render_output_honours_the_umask(tmp_path, capsys, umask, script_mode):
    target = tmp_path / "job.sbatch"
    old = os.umask(umask)
    try:
        code, _, err = run_main(
            ["render", "--shard", "8", "--venv", "none", "--run-dir", str(tmp_path / "r"), "-o", str(target)], capsys
        )
    finally:
        os.umask(old)
    assert code == 0, err
    assert stat.S_IMODE(target.stat().st_mode) == script_mode


# ----------------------------------------------------------------------------- export: symlinks


def test_export_copies_regular_tokenizer_files_only(tmp_path):
    from hpc_hsdp.task.checkpointing.export import _copy_tokenizer

    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    data = tmp_path / "data"
    (data / "tokenizer").mkdir(parents=True)
    (data / "dataset.json").write_text("{}")
    (data / "tokenizer" / "tokenizer.json").write_text("{}")
    (data / "tokenizer" / "vocab.json").symlink_to(secret)
    (data / "tokenizer" / "fifo").mkdir()
    out = tmp_path / "out"
    out.mkdir()
    skipped = _copy_tokenizer({"training": {"data": str(data)}}, out)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json"]
    assert str(data / "tokenizer" / "vocab.json") in skipped
    assert not any("private key" in p.read_text() for p in out.iterdir())


# ----------------------------------------------------------------------------- job ids and pids


@pytest.mark.parametrize("good", ["123", "123_4", "123+1", 4242])
def test_slurm_job_id_forms_are_admitted(good):
    assert check_job_id(good) == str(good)


@pytest.mark.parametrize("bad", ["--user=root", "-1", "123;rm", "../../x", "", "1 2", None, True, "123_", "a123"])
def test_other_job_ids_are_refused(bad):
    with pytest.raises(SpecError, match="not a SLURM job id"):
        check_job_id(bad)


def _job_record(run: Path, **fields) -> None:
    run.mkdir(parents=True, exist_ok=True)
    record = {
        "job_id": "123",
        "cluster": "slurm",
        "run_dir": str(run),
        "logs_dir": str(run / "logs"),
        "job_name": "x",
        "ntasks": 2,
        "launcher": "srun",
        "submitted_at": 1.0,
    }
    record.update(fields)
    (run / "job.json").write_text(json.dumps(record))


@pytest.fixture
def slurm_stubs(tmp_path, monkeypatch) -> Path:
    """squeue, scancel, sacct, scontrol on PATH that record their arguments (a marker)."""
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    marker = tmp_path / "CALLED"
    for name in ("squeue", "scancel", "sacct", "scontrol"):
        (stubs / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {marker}\n')
        (stubs / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}{os.pathsep}{os.environ['PATH']}")
    return marker


@pytest.mark.parametrize("command", ["cancel", "status", "logs"])
def test_a_job_id_of_an_option_never_reaches_the_scheduler(tmp_path, capsys, slurm_stubs, command):
    run = tmp_path / "run"
    _job_record(run, job_id="--user=root")
    code, _, err = run_main([command, str(run)], capsys)
    one_error_line(code, err, "--user=root", "not a SLURM job id")
    assert not slurm_stubs.exists()


JOB_FILES = {
    "truncated": b'{"job_id": "123", "clus',
    "garbage": b"\xff\xfe\x00garbage",
    "a list": b"[1, 2, 3]",
    "wrong types": json.dumps({"job_id": 123, "cluster": ["slurm"]}).encode(),
    "huge": b'{"job_id": "' + b"1" * (1 << 20) + b'"}',
    "a null ntasks": None,
}


@pytest.mark.parametrize("kind", sorted(JOB_FILES))
@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
def test_a_broken_job_file_is_one_line_and_exit_2(tmp_path, capsys, slurm_stubs, kind, command):
    run = tmp_path / "run"
    if JOB_FILES[kind] is None:
        _job_record(run, ntasks=None)
    else:
        run.mkdir()
        (run / "job.json").write_bytes(JOB_FILES[kind])
    code, _, err = run_main([command, str(run)], capsys)
    one_error_line(code, err, "job.json")
    assert not slurm_stubs.exists()


@pytest.mark.parametrize("kind", ["truncated", "garbage", "huge"])
def test_runs_lists_a_run_with_a_broken_job_file_without_a_traceback(tmp_path, capsys, slurm_stubs, kind):
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "job.json").write_bytes(JOB_FILES[kind])
    (run / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.0}\n\xff\xfe{"step": 2, "lo')
    code, out, err = run_main(["runs", str(tmp_path / "runs")], capsys)
    assert "Traceback" not in err
    assert code in (0, 2), err
    assert not slurm_stubs.exists()


@pytest.mark.parametrize(
    "metrics", [b"", b'{"step": 1, "lo', b"\xff\xfe\x00\x01" * 1000, b"[1]\n{}\n" + b"x" * (3 << 20), b"null\n"]
)
def test_report_and_status_on_garbage_metrics_never_trace_back(tmp_path, capsys, slurm_stubs, metrics):
    run = tmp_path / "run"
    _job_record(run, cluster="local")
    (run / "logs").mkdir()
    (run / "metrics.jsonl").write_bytes(metrics)
    for command in (["status", str(run)], ["report", str(run)], ["status", "--json", str(run)]):
        code, out, err = run_main(command, capsys)
        assert "Traceback" not in err, (command, err)
        assert code in (0, 1, 2), (command, code, err)
        if code == 2:
            one_error_line(code, err)


def test_the_emulator_signals_only_its_own_supervisor(tmp_path):
    from hpc_hsdp.scheduler.emulator.emulated_job import LocalJob
    from hpc_hsdp.scheduler.emulator.processes import process_start_time
    from hpc_hsdp.scheduler.emulator.state_files import state_path

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        logs = tmp_path / "logs"
        logs.mkdir()
        state = {"job_id": "12345", "state": "RUNNING", "supervisor_pid": bystander.pid, "tasks_per_node": [1]}
        for started in (None, 1, (process_start_time(bystander.pid) or 0) + 7):  # missing, or a pid reused
            state_path(logs, "12345").write_text(json.dumps(dict(state, supervisor_started=started)))
            job = LocalJob(logs_dir=logs, job_id="12345")
            job.cancel()
            assert bystander.poll() is None  # not signalled
        for pid in ("1; rm -rf /", [1], True, os.getpid()):
            state_path(logs, "12345").write_text(json.dumps(dict(state, supervisor_pid=pid)))
            LocalJob(logs_dir=logs, job_id="12345").cancel()
            assert LocalJob(logs_dir=logs, job_id="12345").info()["state"] in ("RUNNING", "FAILED")
        state_path(logs, "12345").write_bytes(b"\xff garbage")
        assert LocalJob(logs_dir=logs, job_id="12345").info()["state"] == "UNKNOWN"
        # pid, start time and owner all copied from /proc (issue 38): still not the job's supervisor
        state_path(logs, "12345").write_text(
            json.dumps(dict(state, supervisor_started=process_start_time(bystander.pid)))
        )
        LocalJob(logs_dir=logs, job_id="12345").cancel()
        with pytest.raises(subprocess.TimeoutExpired):  # a signal would end it within this second
            bystander.wait(timeout=1)
    finally:
        bystander.kill()
        bystander.wait()


def test_the_emulator_signals_the_process_started_for_that_state_file_only(tmp_path):
    """The supervisor's environment names its state file (set at launch, readable by its owner
    alone): a process started with another job's mark is not this job's."""
    from hpc_hsdp.scheduler.emulator.emulated_job import LocalJob
    from hpc_hsdp.scheduler.emulator.processes import SUPERVISOR_MARK, process_start_time
    from hpc_hsdp.scheduler.emulator.state_files import state_path

    logs = tmp_path / "logs"
    logs.mkdir()
    other = tmp_path / "other" / "12345_local.json"
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    marked = subprocess.Popen(sleep, env={**os.environ, SUPERVISOR_MARK: str(state_path(logs, "12345"))})
    elsewhere = subprocess.Popen(sleep, env={**os.environ, SUPERVISOR_MARK: str(other)})
    try:
        for proc in (elsewhere, marked):
            state = {"job_id": "12345", "state": "RUNNING", "supervisor_pid": proc.pid}
            state["supervisor_started"] = process_start_time(proc.pid)
            state_path(logs, "12345").write_text(json.dumps(state))
            LocalJob(logs_dir=logs, job_id="12345").cancel()
        assert marked.wait(timeout=10) != 0
        with pytest.raises(subprocess.TimeoutExpired):
            elsewhere.wait(timeout=1)
    finally:
        for proc in (marked, elsewhere):
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------------- state directories


def test_state_directories_are_private_and_refused_when_a_symlink(tmp_path):
    made = private_dir(tmp_path / "state" / "jobs")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    wide = tmp_path / "wide"
    wide.mkdir(mode=0o777)
    wide.chmod(0o777)
    assert stat.S_IMODE(private_dir(wide).stat().st_mode) == 0o700
    target = tmp_path / "theirs"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(PermissionError, match="symlink"):
        private_dir(tmp_path / "link")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory of another user needs root")
def test_another_users_state_directory_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to user id 12345"):
        private_dir(theirs)


def test_the_jobs_index_is_made_private(tmp_path, monkeypatch):
    from hpc_hsdp.rundir.lifecycle.job_record import JobRecord, jobs_index

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    run = tmp_path / "run"
    run.mkdir()
    JobRecord(
        job_id="77", cluster="local", run_dir=str(run), logs_dir=str(run), job_name="x", ntasks=1, launcher="srun",
        submitted_at=1.0,
    ).save()  # fmt: skip
    assert stat.S_IMODE(jobs_index().stat().st_mode) == 0o700
    assert JobRecord.load("77").run_dir == str(run)


def test_the_emulators_port_reservations_are_private(tmp_path, monkeypatch):
    from hpc_hsdp.scheduler.emulator.ports import reserve_port
    from hpc_hsdp.scheduler.emulator.state_files import emulator_state_dir

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    reserve_port("4242", tmp_path / "state.json", is_free=lambda port: True)
    assert stat.S_IMODE(emulator_state_dir().stat().st_mode) == 0o700
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(emulator_state_dir())
    emulator_state_dir().symlink_to(elsewhere)
    with pytest.raises(SpecError, match="the local emulator cannot use .* is a symlink"):
        reserve_port("4243", tmp_path / "state.json", is_free=lambda port: True)
    assert not list(elsewhere.iterdir())  # nothing written through the link


# ----------------------------------------------------------------------------- token data


def test_ids_beyond_what_the_sidecar_says_stop_with_the_file_and_the_id(tmp_path):
    from hpc_hsdp.data.tokens import DataError, check_token_data, open_dataset, write_token_file

    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(64) % 50, vocab_size=64)
    sidecar = json.loads(path.with_suffix(".json").read_text())
    tokens = np.fromfile(path, dtype=sidecar["dtype"])
    tokens[40] = 60000  # beyond the vocabulary; the sidecar still says max_token_id 49
    tokens.tofile(path)
    ds = open_dataset(path)
    check_token_data(ds, model_vocab_size=64, seq_len=8, global_batch=2)  # the sidecar's word: fine
    with pytest.raises(DataError) as caught:
        ds.read(32, 16)
    message = str(caught.value)
    assert str(path) in message and "60000" in message and "\n" not in message
    assert ds.read(0, 32).max() < 64


def test_the_model_vocabulary_check_names_the_id(tmp_path):
    from hpc_hsdp.data.tokens import DataError, check_token_data, open_dataset, write_token_file

    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(256) % 200, vocab_size=256)
    with pytest.raises(DataError, match="holds token id 199"):
        check_token_data(open_dataset(path), model_vocab_size=128, seq_len=8, global_batch=2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_token_id", "12"),
        ("max_token_id", -1),
        ("max_token_id", 99999),
        ("vocab_size", True),
        ("num_tokens", 1.5),
        ("dtype", "float64"),
        ("document_index", "../../etc/passwd"),
        ("document_index", 7),
    ],
)
def test_sidecar_fields_are_type_and_range_checked(tmp_path, field, value):
    from hpc_hsdp.data.tokens import DataError, open_dataset, write_token_file

    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(64) % 50, vocab_size=64, eos_id=49)
    sidecar = json.loads(path.with_suffix(".json").read_text())
    sidecar[field] = value
    path.with_suffix(".json").write_text(json.dumps(sidecar))
    with pytest.raises(DataError) as caught:
        open_dataset(path)
    assert "\n" not in str(caught.value)


def test_a_bin_whose_size_does_not_fit_its_dtype_is_refused(tmp_path):
    from hpc_hsdp.data.tokens import DataError, open_dataset, write_token_file

    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(64) % 50, vocab_size=64)
    with open(path, "ab") as f:
        f.write(b"\x01")
    with pytest.raises(DataError, match="not a whole number of uint16 tokens"):
        open_dataset(path)


def test_prepare_data_refuses_an_enormous_line_naming_the_option(tmp_path, capsys):
    big = tmp_path / "big.jsonl"
    big.write_bytes(b'{"text": "' + b"a" * (3 << 20) + b'"}')  # one line, no newline
    code, _, err = run_main(
        ["prepare-data", str(big), "--field", "text", "-o", str(tmp_path / "out"), "--max-line-bytes", "1000000", "-q"],
        capsys,
    )
    one_error_line(code, err, "--max-line-bytes", "big.jsonl")
    assert not (tmp_path / "out").exists()


def test_an_enormous_line_after_the_first_is_refused_while_reading(tmp_path):
    from hpc_hsdp.data.inputs import DataError, discover_inputs, iter_blocks

    big = tmp_path / "big.jsonl"
    big.write_bytes(b'{"text": "small"}\n{"text": "' + b"a" * (3 << 20) + b'"}')
    files, _ = discover_inputs((str(big),), field="text", max_line_bytes=1 << 20)
    with pytest.raises(DataError, match="line 2 is longer than"):
        list(iter_blocks(files, val_fraction=0.0, block_bytes=1 << 16, max_line_bytes=1 << 20))


# ----------------------------------------------------------------------------- --entry and --model


@pytest.mark.parametrize(
    "value", ["__import__('os').system('touch MARKER')", "os.system('x'):y", "a:b:c", "/tmp/x.py:main", "mod:"]
)
def test_entry_and_model_names_are_identifiers_only(value):
    from hpc_hsdp.models.base import split_import_name

    with pytest.raises(SpecError, match="is not module:function"):
        split_import_name("--entry", value)
    assert split_import_name("--model", "pkg.mod:build") == ("pkg.mod", "build")


def test_the_task_refuses_an_entry_that_is_not_a_name_before_importing():
    from hpc_hsdp.models.factory import resolve_factory
    from hpc_hsdp.task.entry import resolve_entry

    for resolve in (resolve_entry, resolve_factory):
        with pytest.raises(SpecError, match="is not module:function"):
            resolve("os.system('touch x'):y")


def test_the_dev_clusters_state_directory_is_refused_when_a_symlink_or_anothers(tmp_path):
    """``scripts/dev-cluster``'s own check, run alone (the script itself needs root and the cluster)."""
    script = (Path(__file__).resolve().parents[2] / "scripts" / "dev-cluster").read_text()
    start = script.index("check_state_dir() {")
    function = script[start : script.index("\n}\n", start) + 3]
    prelude = 'PROG=dev-cluster\ndie() { echo "$PROG: $*" >&2; exit 1; }\n' + function

    def run(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "-c", prelude + 'check_state_dir "$1"', "bash", str(path)], capture_output=True, text=True
        )

    assert run(tmp_path / "new").returncode == 0
    (tmp_path / "mine").mkdir()
    assert run(tmp_path / "mine").returncode == 0
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    refused = run(tmp_path / "link")
    assert refused.returncode == 1 and "is a symlink or belongs to another user" in refused.stderr
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 12345, 12345)
        assert run(theirs).returncode == 1


# ----------------------------------------------------------------------------- run-directory files: one reader (issue 38)


class Blocked(BaseException):
    """Raised by :func:`_no_hang`; no reader's ``except OSError`` swallows it."""


@contextmanager
def _no_hang(seconds: float = 5.0):
    """Fail the test instead of blocking forever (an open of a FIFO without a writer)."""

    def stop(signum, frame):
        raise Blocked(f"blocked for {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _valid_manifest(run: Path) -> None:
    """A complete checkpoint of step 1 (whatever train_state.json is there already stays)."""
    ck = run / "checkpoints" / "step-000001"
    ck.mkdir(parents=True, exist_ok=True)
    (ck / "COMPLETE").write_text("step 1\n")
    if not os.path.lexists(ck / "train_state.json"):
        (ck / "train_state.json").write_text(json.dumps({"step": 1}))


def _reader_cases() -> dict[str, tuple[str, bytes, object]]:
    """file -> (its path in the run directory, bytes hpc-hsdp would write, reader(run) -> what it read,
    falsy when nothing was taken from the file)."""
    from hpc_hsdp.rundir.checkpointing.state import damage, saved_train_state
    from hpc_hsdp.rundir.layout import rank_entries
    from hpc_hsdp.rundir.lifecycle.attempts import read_attempt, read_restarts
    from hpc_hsdp.rundir.lifecycle.claim import read_claim
    from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
    from hpc_hsdp.rundir.lifecycle.job_state import load_job_state
    from hpc_hsdp.rundir.observation.flight_recorder import read_dumps
    from hpc_hsdp.rundir.observation.replica_membership import read_membership
    from hpc_hsdp.rundir.observation.tracker_runs import read_tracker_runs
    from hpc_hsdp.rundir.training.metrics import last_metrics
    from hpc_hsdp.scheduler.emulator.emulated_job import LocalJob
    from hpc_hsdp.task.checkpointing.export import read_model_record

    def job(run):
        try:
            return JobRecord.load(str(run))
        except SpecError:
            return None

    def model(run):
        try:
            return read_model_record(run)
        except SpecError:
            return None

    def local(run):
        return LocalJob(logs_dir=run / "logs", job_id="123").info()["state"] != "UNKNOWN"

    def train_state(run):
        _valid_manifest(run)
        ck = run / "checkpoints" / "step-000001"
        try:
            return damage(ck) is None and saved_train_state(ck)
        except (OSError, ValueError):
            return None

    def manifest(run):
        _valid_manifest(run)
        return damage(run / "checkpoints" / "step-000001") is None

    record = {
        "job_id": "123", "cluster": "slurm", "run_dir": "/x", "logs_dir": "logs", "job_name": "x", "ntasks": 2,
        "launcher": "srun", "submitted_at": 1.0,
    }  # fmt: skip
    dump = pickle.dumps({"version": "2.10", "pg_config": {}, "entries": []})
    return {
        "claim.json": ("claim.json", b'{"state": "claimed", "job_id": "7"}', read_claim),
        "trackers.json": ("trackers.json", b'{"wandb": {"run_id": "x"}}', read_tracker_runs),
        "job.json": ("job.json", json.dumps(record).encode(), job),
        "layout.json": ("layout.json", json.dumps({"ranks": [LAYOUT_ENTRY]}).encode(), rank_entries),
        "model.json": ("model.json", b'{"model": "builtin", "adapter": {"kind": "builtin"}}', model),
        "attempt.json": ("attempt.json", b'{"total_steps": 5, "ended": null}', read_attempt),
        "job_state.json": (
            "job_state.json",
            b'{"job_id": "123", "state": "RUNNING", "at": 1.0}',
            lambda run: load_job_state(run, "123"),
        ),  # fmt: skip
        "train_state.json": ("checkpoints/step-000001/train_state.json", b'{"step": 1}', train_state),
        "manifest.json": (
            "checkpoints/step-000001/manifest.json",
            json.dumps({"format": "hpc-hsdp-checkpoint-manifest", "files": {}}).encode(),
            manifest,
        ),
        "replicas.jsonl": ("replicas.jsonl", b'{"time": 1.0, "event": "lighthouse started"}\n', read_membership),
        "restarts.jsonl": ("restarts.jsonl", b'{"restart": 1, "reason": "error"}\n', read_restarts),
        "metrics.jsonl": ("metrics.jsonl", b'{"step": 1, "loss": 2.0}\n', last_metrics),
        "logs/123_local.json": ("logs/123_local.json", b'{"state": "COMPLETED"}', local),
        "flight recorder": ("hang/nccl-trace-rank0.pkl", dump, lambda run: read_dumps(run)[0]),
    }


LAYOUT_ENTRY = {
    "rank": 1, "node": "n1", "slurm_procid": 1, "local_rank": 1, "device": "cuda:1", "launch_mode": "srun",
    "node_switch": None, "shard_group": [0, 1], "replicate_group": [1, 3],
}  # fmt: skip
"""One rank's entry as rank 0 writes it (task/parallelism/dist.py)."""
READERS = sorted(_reader_cases())


def _place(run: Path, name: str, how: str, data: bytes, elsewhere: Path) -> None:
    path = run / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "regular":
        path.write_bytes(data)
    elif how == "symlink":
        elsewhere.write_bytes(data)
        path.symlink_to(elsewhere)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "dev-zero":
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("how", ["symlink", "fifo", "dev-zero"])
@pytest.mark.parametrize("reader", READERS)
def test_every_run_directory_file_is_read_only_as_a_regular_file(tmp_path, reader, how):
    """The same bytes are read from a regular file and refused through a symlink (to a secret it
    would copy), from a FIFO (which blocked submit and status) and from /dev/zero (memory)."""
    name, data, read = _reader_cases()[reader]
    regular, hostile = tmp_path / "regular", tmp_path / "hostile"
    _place(regular, name, "regular", data, tmp_path / "unused")
    assert read(regular), "the regular file is read: the test can fail"
    _place(hostile, name, how, data, tmp_path / "secret")
    with _no_hang():
        assert not read(hostile)


def test_the_reader_refuses_what_is_not_a_small_regular_file(tmp_path):
    from hpc_hsdp.files import UnreadableFile, read_capped, read_json

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "big").write_bytes(b"x" * 100)
    with _no_hang():
        for name, words in (("fifo", "not a regular file"), ("zero", "symlink"), ("big", "more than 50 bytes")):
            with pytest.raises(UnreadableFile, match=words):
                read_capped(tmp_path / name, max_bytes=50)
    assert read_capped(tmp_path / "big", max_bytes=50, tail=True) == b""  # no whole line in the window
    (tmp_path / "lines").write_bytes(b"a" * 60 + b"\nlast\n")
    assert read_capped(tmp_path / "lines", max_bytes=50, tail=True) == b"last\n"
    with pytest.raises(FileNotFoundError):
        read_json(tmp_path / "missing", max_bytes=50)


def test_a_failed_submission_never_copies_what_claim_json_links_to(tmp_path):
    from hpc_hsdp.submit_host.claims import claimed

    secret = tmp_path / "secret"
    secret.write_text('{"state": "released", "key": "SECRET"}')
    run = tmp_path / "run"
    run.mkdir()
    (run / "claim.json").symlink_to(secret)
    with pytest.raises(UnsafeTarget, match="claim.json is a symlink"), claimed(run, cluster="local"):
        raise RuntimeError("sbatch failed")
    assert secret.read_text() == '{"state": "released", "key": "SECRET"}'
    assert not any(b"SECRET" in p.read_bytes() for p in run.iterdir() if p.is_file() and not p.is_symlink())


def test_a_tracker_entry_never_copies_what_trackers_json_links_to(tmp_path):
    from hpc_hsdp.rundir.observation.tracker_runs import record_progress

    secret = tmp_path / "secret"
    secret.write_text('{"tensorboard": {"token": "SECRET"}}')
    run = tmp_path / "run"
    run.mkdir()
    (run / "trackers.json").symlink_to(secret)
    with pytest.raises(UnsafeTarget, match="trackers.json is a symlink"):
        record_progress(run, {"tensorboard": 4})
    assert secret.read_text() == '{"tensorboard": {"token": "SECRET"}}'
    assert os.path.islink(run / "trackers.json")


DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("reader", [r for r in READERS if r != "flight recorder"])
def test_nesting_that_exhausts_the_stack_reads_as_no_file(tmp_path, reader):
    """A RecursionError in json is no file read, never a traceback."""
    name, _, read = _reader_cases()[reader]
    _place(tmp_path / "run", name, "regular", DEEP + b"\n", tmp_path / "unused")
    assert not read(tmp_path / "run")


NUMBERS = {
    "job.json": "submitted_at",
    "job_state.json": "at",
    "attempt.json": "total_steps",
    "layout.json": "rank",
    "replicas.jsonl": "time",
    "restarts.jsonl": "restart",
    "metrics.jsonl": "step",
    "train_state.json": "step",
}


@pytest.mark.parametrize("reader", sorted(NUMBERS))
@pytest.mark.parametrize("number", ["1e999", "1" + "0" * 400, "-1e999"], ids=["1e999", "10**400", "-1e999"])
def test_numbers_out_of_range_read_as_no_record(tmp_path, reader, number):
    """1e999 is infinity and 10**400 overflows a float: as a time, a step or a rank they failed
    far from the reader (localtime, a format, an index)."""
    name, data, read = _reader_cases()[reader]
    key = NUMBERS[reader].encode()
    start = data.index(b'"' + key + b'": ') + len(key) + 4
    end = start + next(i for i, c in enumerate(data[start:]) if chr(c) in ",}]")
    _place(tmp_path / "run", name, "regular", data[:start] + number.encode() + data[end:], tmp_path / "unused")
    assert not read(tmp_path / "run")


def test_out_of_range_membership_times_and_wrong_types_are_skipped(tmp_path):
    from hpc_hsdp.rundir.observation.replica_membership import membership_changes, read_membership

    (tmp_path / "replicas.jsonl").write_text(
        '{"time": 1e999, "event": "x"}\n{"time": ' + "9" * 400 + ', "event": "y"}\n{"time": -5, "event": "z"}\n'
        '{"time": 1.0, "event": "replica group lost", "replica_id": 1, "nodes": "n1"}\n'
    )
    records = read_membership(tmp_path)
    assert [r["event"] for r in records] == ["replica group lost"]
    assert membership_changes(records)


def test_a_hostile_flight_recorder_dump_is_a_note(tmp_path):
    from hpc_hsdp.rundir.observation.flight_recorder import hang_words

    hang = tmp_path / "hang"
    hang.mkdir()
    entries = [
        {"collective_seq_id": float("inf"), "process_group": ("0", ""), "time_created_ns": 1, "state": "started"},
        {"collective_seq_id": "7", "process_group": ("0", ""), "time_created_ns": 1e999, "state": "started"},
        {"collective_seq_id": 10**400, "process_group": ("0", ""), "time_created_ns": 1, "state": "started"},
    ]
    for rank in (0, 1):
        dump = {"pg_config": {"0": {"ranks": "[" * 50_000 + "]" * 50_000, "desc": "default_pg"}}, "entries": entries}
        (hang / f"nccl-trace-rank{rank}.pkl").write_bytes(pickle.dumps(dump))
    dump = {"pg_config": {"0": {"ranks": "[0, 1]", "desc": "default_pg"}}, "entries": entries}
    (hang / "nccl-trace-rank2.pkl").write_bytes(pickle.dumps(dump))
    hang_words(tmp_path)  # no traceback


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("attempt.json", {"total_steps": "5", "ended": 5}),
        ("attempt.json", {"ended": {"reason": ["x"]}}),
        ("restarts.jsonl", {"restart": "x", "resumed_from_step": [1], "reason": 3}),
        ("layout.json", {"ranks": [{"rank": "0", "node": 3}]}),
        ("layout.json", {"ranks": 5}),
    ],
)
def test_wrong_types_in_run_files_are_no_record_and_runs_goes_on(tmp_path, capsys, name, content):
    root = tmp_path / "runs"
    for run in ("bad", "good"):
        (root / run).mkdir(parents=True)
        (root / run / "metrics.jsonl").write_text('{"step": 3, "loss": 1.5}\n')
    (root / "bad" / name).write_text(json.dumps(content) + ("\n" if name.endswith(".jsonl") else ""))
    code, out, err = run_main(["runs", str(root)], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert "good" in out and "bad" in out


def test_runs_goes_on_past_a_directory_that_cannot_be_read(tmp_path, capsys, monkeypatch):
    import hpc_hsdp.cli.jobs_cmd as jobs_cmd

    root = tmp_path / "runs"
    for run in ("a", "b"):
        (root / run).mkdir(parents=True)
        (root / run / "metrics.jsonl").write_text('{"step": 3, "loss": 1.5}\n')
    real = jobs_cmd.load_run

    def load_run(path, **kw):
        if Path(path).name == "a":
            raise RecursionError("maximum recursion depth exceeded")
        return real(path, **kw)

    monkeypatch.setattr(jobs_cmd, "load_run", load_run)
    code, out, err = run_main(["runs", str(root)], capsys)
    assert code == 0 and "Traceback" not in err, err
    lines = out.splitlines()
    assert any(line.startswith("a ") and "UNKNOWN" in line for line in lines)
    assert any(line.startswith("b ") and "1.5000" in line for line in lines)


@pytest.mark.parametrize("command", ["status", "logs", "cancel"])
def test_deeply_nested_or_out_of_range_job_json_is_one_line(tmp_path, capsys, slurm_stubs, command):
    run = tmp_path / "run"
    run.mkdir()
    for data in (DEEP[:60_000] + DEEP[-60_000:], json.dumps({"job_id": "1", "submitted_at": 1}).encode()[:-1] + b", "
                 b'"ntasks": ' + b"9" * 500 + b"}"):  # fmt: skip
        (run / "job.json").write_bytes(data)
        code, _, err = run_main([command, str(run)], capsys)
        one_error_line(code, err, "job.json")
    assert not slurm_stubs.exists()


def test_a_model_record_of_other_types_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    _valid_manifest(run)
    for record in ({"training": [1]}, {"adapter": {"kind": "hf", "config": 3}}, {"model": 5}, {"vocab_size": "x"}):
        (run / "model.json").write_text(json.dumps(record))
        code, _, err = run_main(["export", str(run), "-o", str(tmp_path / "out")], capsys)
        one_error_line(code, err, "model.json")


def test_a_data_position_of_other_types_is_a_damaged_checkpoint(tmp_path):
    from hpc_hsdp.rundir.checkpointing.state import damage

    _valid_manifest(tmp_path)
    ck = tmp_path / "checkpoints" / "step-000001"
    (ck / "train_state.json").write_text(json.dumps({"step": 1, "data": {"global_batch": "8"}}))
    assert "data position" in damage(ck)
    (ck / "train_state.json").write_text(json.dumps({"step": 1, "data": [1]}))
    assert "data position" in damage(ck)


# ----------------------------------------------------------------------------- names from files, shown (issue 38)

XSS = "n1'><script>alert(1)</script><x a='"


def test_node_names_and_causes_from_the_run_are_escaped_in_the_html_report(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": s, "loss": 3.0 - 0.1 * s, "stragglers": {"own_time_s": [0.05, 0.05, 0.05, 0.2]}} for s in range(1, 9)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ranks = [
        {"rank": r, "node": XSS if r < 2 else "n2</title><script>alert(2)</script>", "slurm_procid": r}
        for r in range(4)
    ]
    (run / "layout.json").write_text(json.dumps({"ranks": ranks}))
    (run / "restarts.jsonl").write_text(
        json.dumps({"restart": 1, "resumed_from_step": 4, "reason": "<script>alert(3)</script>", "detail": "x"}) + "\n"
    )
    out = tmp_path / "report.html"
    code, _, err = run_main(["report", str(run), "-o", str(out)], capsys)
    assert code in (0, None), err
    html = out.read_text()
    assert "<script" not in html
    assert "&lt;script&gt;alert(1)" in html and "&lt;script&gt;alert(2)" in html


def test_status_escapes_terminal_sequences_from_the_runs_files(tmp_path, capsys, slurm_stubs):
    run = tmp_path / "run"
    _job_record(run, cluster="local")
    (run / "logs").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 3, "loss": 1.5, "replicas": 1, "replica_groups": 2}\n')
    title, clear, bidi = "\x1b]0;owned\x07", "\x1b[2J\x1b[H", "\u202e"
    (run / "replicas.jsonl").write_text(
        json.dumps(
            {
                "time": 1.0,
                "event": f"replica group lost{title}",
                "replica_id": clear,
                "nodes": [bidi + "n1"],
                "cause": "\x9b31m",
            }
        )
        + "\n"  # fmt: skip
    )
    (run / "restarts.jsonl").write_text(
        json.dumps({"restart": 1, "resumed_from_step": 2, "reason": f"error{clear}\rfake line"}) + "\n"
    )
    (run / "attempt.json").write_text(json.dumps({"total_steps": 9, "ended": {"reason": f"hang{title}"}}))
    code, out, err = run_main(["status", str(run)], capsys)
    assert code == 0, err
    assert "replica group" in out and "restarts:" in out
    for raw in ("\x1b", "\x07", "\x9b", "\r", "\u202e"):
        assert raw not in out, repr(out)
    assert "\\x1b]0;owned\\x07" in out and "\\u202e" in out
    (run / "job.json").unlink()  # runs shows the attempt's own end
    code, out, err = run_main(["runs", str(tmp_path)], capsys)
    assert code == 0 and "\x1b" not in out and "hang\\x1b" in out, out


# ----------------------------------------------------------------------------- export and checkpoints: no symlink, no FIFO (issue 38)


def test_export_does_not_follow_a_tokenizer_directory_that_is_a_symlink(tmp_path):
    from hpc_hsdp.task.checkpointing.export import _copy_tokenizer

    secrets = tmp_path / "dot-ssh"
    secrets.mkdir()
    (secrets / "id_ed25519").write_text("PRIVATE KEY")
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset.json").write_text("{}")
    (data / "tokenizer").symlink_to(secrets)
    out = tmp_path / "out"
    out.mkdir()
    skipped = _copy_tokenizer({"training": {"data": str(data)}}, out)
    assert list(out.iterdir()) == []
    assert skipped == [str(data / "tokenizer")]


@pytest.mark.parametrize("manifest", ["none", "symlink"])
def test_export_copies_the_tokenizer_of_a_prepared_dataset_only(tmp_path, manifest):
    """model.json's data path edited to lead to someone else's directory (or a directory above the
    dataset swapped for a symlink): its tokenizer/ holds regular files, but no dataset.json of
    prepare-data's sits beside it (or only a symlink named so), and nothing is copied."""
    from hpc_hsdp.task.checkpointing.export import _copy_tokenizer

    elsewhere = tmp_path / "home" / "project"
    (elsewhere / "tokenizer").mkdir(parents=True)
    (elsewhere / "tokenizer" / "credentials.json").write_text("SECRET")
    if manifest == "symlink":
        (tmp_path / "real.json").write_text("{}")
        (elsewhere / "dataset.json").symlink_to(tmp_path / "real.json")
    link = tmp_path / "run" / "data"
    link.parent.mkdir()
    link.symlink_to(elsewhere)
    out = tmp_path / "out"
    out.mkdir()
    skipped = _copy_tokenizer({"training": {"data": str(link)}}, out)
    assert list(out.iterdir()) == [] and skipped == [str(link / "tokenizer")]
    (elsewhere / "dataset.json").unlink(missing_ok=True)
    (elsewhere / "dataset.json").write_text("{}")  # a prepared dataset behind a symlinked path: copied
    assert _copy_tokenizer({"training": {"data": str(link)}}, out) == []
    assert [p.name for p in out.iterdir()] == ["credentials.json"]


def test_export_skips_a_fifo_in_the_tokenizer_directory_without_blocking(tmp_path):
    from hpc_hsdp.task.checkpointing.export import _copy_tokenizer

    data = tmp_path / "data"
    (data / "tokenizer").mkdir(parents=True)
    (data / "dataset.json").write_text("{}")
    (data / "tokenizer" / "tokenizer.json").write_text("{}")
    os.mkfifo(data / "tokenizer" / "vocab.json")
    out = tmp_path / "out"
    out.mkdir()
    with _no_hang():
        skipped = _copy_tokenizer({"training": {"data": str(data)}}, out)
    assert [p.name for p in out.iterdir()] == ["tokenizer.json"]
    assert skipped == [str(data / "tokenizer" / "vocab.json")]


def _tensor_file_elsewhere(checkpoint: Path) -> None:
    """Point every tensor entry of the metadata at ``__1_0.distcp``, a file without non-tensor
    entries: what the checks of non-tensor entries never open."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from hpc_hsdp.task.checkpointing.safe_dcp import read_metadata_file

    metadata = read_metadata_file(checkpoint / ".metadata")
    for index, info in list(metadata.storage_data.items()):
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            metadata.storage_data[index] = _StorageInfo("__1_0.distcp", info.offset, info.length)
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("how", ["fifo", "dev-zero", "symlink"])
def test_a_checkpoint_file_that_is_not_a_regular_file_is_refused_unread(tmp_path, how):
    from hpc_hsdp.task.checkpointing.safe_dcp import unsafe_content

    checkpoint = tmp_path / "ck"
    _tiny_checkpoint(checkpoint)
    _tensor_file_elsewhere(checkpoint)
    shutil.copy(checkpoint / "__0_0.distcp", tmp_path / "copy.distcp")
    target = checkpoint / "__1_0.distcp"
    if how == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero" if how == "dev-zero" else tmp_path / "copy.distcp")
    with _no_hang():
        problem = unsafe_content(checkpoint)
    assert problem == "__1_0.distcp is a symlink, FIFO or device, not a file"
    target.unlink()
    shutil.copy(tmp_path / "copy.distcp", target)
    assert unsafe_content(checkpoint) is None  # the same entries in a regular file: whole


def test_a_metadata_fifo_is_refused_without_blocking(tmp_path):
    from hpc_hsdp.task.checkpointing.safe_dcp import unsafe_content

    checkpoint = tmp_path / "ck"
    _tiny_checkpoint(checkpoint)
    (checkpoint / ".metadata").unlink()
    os.mkfifo(checkpoint / ".metadata")
    with _no_hang():
        assert ".metadata is a symlink, FIFO or device" in unsafe_content(checkpoint)


@pytest.mark.parametrize("name", ["/dev/zero", "../../../dev/zero", "fifo"])
def test_a_manifest_naming_a_device_or_fifo_is_a_damaged_checkpoint(tmp_path, name):
    from hpc_hsdp.rundir.checkpointing.state import damage

    _valid_manifest(tmp_path)
    ck = tmp_path / "checkpoints" / "step-000001"
    if name == "fifo":
        name = "__0_0.distcp"
        os.mkfifo(ck / name)
    manifest = {"format": "hpc-hsdp-checkpoint-manifest", "files": {name: {"bytes": 0, "crc32": 0}}}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    with _no_hang():
        problem = damage(ck, checksum_files=["*"])
    assert problem is not None and "\n" not in problem


# ----------------------------------------------------------------------------- datasets: decoded size (issue 38)


def _dictionary_bomb(path: Path, rows: int = 1_000_000, value: bytes = b"a" * 1100) -> None:
    """A Parquet file of ``rows`` rows that all name one dictionary value: about 100 KB on disk,
    1.1 GB decoded, and its metadata says 110 KB uncompressed."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    column = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, dtype=np.int32)), pa.array([value.decode()]))
    pq.write_table(pa.table({"text": column}), path, compression="zstd", row_group_size=rows, store_schema=False)


def test_a_parquet_file_that_decodes_to_a_gigabyte_is_read_in_bounded_batches(tmp_path):
    from hpc_hsdp.data.inputs import BLOCK_BYTES, discover_inputs, iter_blocks

    bomb = tmp_path / "bomb.parquet"
    _dictionary_bomb(bomb)
    assert bomb.stat().st_size < 200_000
    files, _ = discover_inputs((str(bomb),), field="text")
    blocks = iter_blocks(files, val_fraction=0.0, field="text")
    for _ in range(3):  # the first blocks: each about BLOCK_BYTES, never a batch of 65,536 rows (72 MB)
        block = next(blocks)
        held = sum(len(piece.data) for piece in block.pieces)
        assert held <= BLOCK_BYTES + 256 * 1100, held
    from hpc_hsdp.data.inputs import _open_table

    batches = _open_table(files[0])[1]("text")  # the rows as a dictionary: indices and the one value
    assert max(next(batches).nbytes for _ in range(3)) <= 256 * 4 + 1100 + 4096


def test_a_parquet_file_of_long_repeated_rows_is_decoded_a_block_at_a_time(tmp_path):
    """100,000 rows naming one 200 KB value: 20 GB decoded from a file of a few hundred KB. A batch of
    even 256 rows decoded whole would hold 51 MB; the rows are measured before they are decoded and
    decoded about BLOCK_BYTES at a time, so pyarrow never holds more than a few blocks."""
    pa = pytest.importorskip("pyarrow")
    from hpc_hsdp.data.inputs import BLOCK_BYTES, discover_inputs, iter_blocks

    bomb = tmp_path / "bomb.parquet"
    _dictionary_bomb(bomb, rows=100_000, value=b"c" * 200_000)
    assert bomb.stat().st_size < 1_000_000
    files, _ = discover_inputs((str(bomb),), field="text")
    blocks = iter_blocks(files, val_fraction=0.0, field="text", max_line_bytes=1 << 20)
    for _ in range(40):
        block = next(blocks)
        assert sum(len(piece.data) for piece in block.pieces) <= 2 * BLOCK_BYTES
        assert pa.total_allocated_bytes() < 8 * BLOCK_BYTES, pa.total_allocated_bytes()


def test_a_parquet_row_longer_than_max_line_bytes_is_refused(tmp_path):
    from hpc_hsdp.data.inputs import DataError, discover_inputs, iter_blocks

    big = tmp_path / "big.parquet"
    _dictionary_bomb(big, rows=4, value=b"b" * 5000)
    files, _ = discover_inputs((str(big),), field="text")
    with pytest.raises(DataError, match=r"row 0 holds 5,000 bytes .*--max-line-bytes"):
        list(iter_blocks(files, val_fraction=0.0, field="text", max_line_bytes=4096))


def test_a_corrupt_parquet_file_is_one_line(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(2000)]}), path, compression="zstd")
    data = bytearray(path.read_bytes())
    data[100:4000] = os.urandom(3900)  # the data pages; the footer stays whole
    path.write_bytes(bytes(data))
    code, _, err = run_main(["prepare-data", str(path), "--field", "text", "-o", str(tmp_path / "out"), "-q"], capsys)
    one_error_line(code, err, "bad.parquet")


# ----------------------------------------------------------------------------- torchft's heal (issue 38)


def test_the_heal_server_listens_on_the_given_address_and_loads_plain_data_only(tmp_path):
    pytest.importorskip("torchft")
    import http.server
    import threading
    from datetime import timedelta

    import torch

    from hpc_hsdp.task.training.replica_coordinator import heal_transport

    transport = heal_transport(timedelta(seconds=10), "127.0.0.1")
    try:
        assert transport._server.socket.getsockname()[0] == "127.0.0.1"  # noqa: SLF001 - the listener itself
        assert transport.metadata().startswith("http://127.0.0.1:")
        state = {"user": {"model": {"w": torch.arange(4.0)}, "step": 3, "engine": {"a": [1, "b"]}}}
        transport.send_checkpoint([1], 3, state, timedelta(seconds=10))
        got = transport.recv_checkpoint(0, transport.metadata(), 3, timedelta(seconds=10))
        assert torch.equal(got["user"]["model"]["w"], state["user"]["model"]["w"]) and got["user"]["step"] == 3
    finally:
        transport.shutdown()

    from torch.distributed._serialization import _streaming_save
    from torchft.checkpointing.http_transport import HTTPTransport

    marker = tmp_path / "MARKER"
    payload = io.BytesIO()
    _streaming_save({"user": MarkerPickle(marker)}, payload)

    class Hostile(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(payload.getvalue())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/checkpoint/"
        receiver = heal_transport(timedelta(seconds=10), "127.0.0.1")
        with pytest.raises(Exception, match="unsupported GLOBAL posix.system"):
            receiver.recv_checkpoint(0, url, 3, timedelta(seconds=10))
        receiver.shutdown()
        assert not marker.exists()
        # what the defence is for: torchft's own transport runs the command
        HTTPTransport._load_from_address(f"{url}3/full", timedelta(seconds=10))  # noqa: SLF001
        assert marker.exists()
    finally:
        server.shutdown()


# ----------------------------------------------------------------------------- claims (issue 38)


def test_a_claim_naming_a_live_unrelated_pid_does_not_block_and_a_live_run_does(tmp_path):
    from hpc_hsdp.rundir.lifecycle.claim import who, write_claim
    from hpc_hsdp.scheduler.emulator.processes import process_start_time
    from hpc_hsdp.submit_host.claims import check_writer, claim_for_task, release_task_claim

    run = tmp_path / "run"
    run.mkdir()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        forged = {"pid": bystander.pid, "host": who()["host"], "pid_started": process_start_time(bystander.pid)}
        (run / "claim.json").write_text(json.dumps({"state": "claimed", "job_id": None, **forged}))
        said = check_writer(run)
        assert said is not None and "which has ended: this submission takes the claim over" in said
    finally:
        bystander.kill()
        bystander.wait()
    # a run of this process (outside any job) holds the directory: refused while it runs, free after
    said, own = claim_for_task(run, {})
    assert own
    with pytest.raises(SpecError, match="still writes run directory"):
        check_writer(run)
    release_task_claim(run)
    write_claim(run, "claimed", job_id=None)  # as if it had died without releasing
    assert "has ended" in check_writer(run)


def test_an_integer_past_a_floats_range_in_a_record_is_no_scalar():
    """float(10**400) raises OverflowError: it killed the tracker thread (and could stop the loop)."""
    from hpc_hsdp.rundir.training.scalars import record_scalars

    huge = 10**400
    record = {"step": 3, "loss": huge, "tokens_per_s": 5.0, "comm": {"shard": {"ag": {"wire_bytes": huge}}}}
    record["stragglers"] = {"spread": huge}
    scalars = record_scalars(record)
    assert 5.0 in scalars.values()
    assert not any("loss" in tag or "wire" in tag or "spread" in tag for tag in scalars), scalars


# ----------------------------------------------------------------------------- issue 43: every write refuses a planted link


def _evals_log(run):
    from hpc_hsdp.rundir.files import append_jsonl

    append_jsonl(run / "evals.jsonl", {"step": 2, "metrics": {"ppl": 1.0}})


def _checks_log(run):
    from hpc_hsdp.batch_shell.fabric_check_verdict import _append

    _append(run, {"job_id": "7", "action": "train"})


def _metrics_line(run):
    from hpc_hsdp.rundir.training.metrics import MetricsLog

    MetricsLog(run, start_step=0, replacing=True).write({"step": 1, "loss": 2.0})


def _restarts_log(run):
    from hpc_hsdp.rundir.lifecycle.attempts import begin_attempt

    begin_attempt(run, restart=1, job_id="7", start_step=3, total_steps=9)


def _eval_claim(run):
    from hpc_hsdp.rundir.training.evals import record_submission

    record_submission(run, 4, job_id="12")


def _atomic(run):
    from hpc_hsdp.rundir.files import atomic_write_text

    atomic_write_text(run / "layout.json", "{}")


WRITERS = {
    "evals.jsonl (append_jsonl)": ("evals.jsonl", _evals_log),
    "checks.jsonl (check_verdict)": ("checks.jsonl", _checks_log),
    "metrics.jsonl": ("metrics.jsonl", _metrics_line),
    "restarts.jsonl": ("restarts.jsonl", _restarts_log),
    "evals/step-N.result.json": ("evals/step-4.json", _eval_claim),
    "a replaced record": ("layout.json", _atomic),
}


@pytest.mark.parametrize("planted", ["symlink", "fifo"])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_no_write_into_a_run_directory_follows_a_planted_symlink_or_blocks_on_a_fifo(tmp_path, writer, planted):
    """Issue 43: appends followed symlinks (an eval's metrics went verbatim into the file the link
    named); each writer now refuses a symlink or FIFO at its file in one line, nothing written."""
    name, write = WRITERS[writer]
    run = tmp_path / "run"
    (run / "evals").mkdir(parents=True)
    secret = tmp_path / "bashrc"
    secret.write_text("# mine\n")
    target = run / name
    if planted == "symlink":
        target.symlink_to(secret)
    else:
        os.mkfifo(target)
    try:
        write(run)
    except (UnsafeTarget, UnreadableFile) as exc:  # refused writing, or reading what it would rewrite
        assert str(exc).startswith(f"{target} is ") and "\n" not in str(exc)
    else:
        # a writer that owns its file may replace it whole (never through it): the link is gone
        assert stat.S_ISREG(os.lstat(target).st_mode), writer
    assert secret.read_text() == "# mine\n"


def test_the_one_writer_makes_private_files_0600_whatever_the_umask(tmp_path):
    from hpc_hsdp.files import append_text, open_for_writing, write_atomically

    old = os.umask(0)
    try:
        write_atomically(tmp_path / "point.sbatch", "echo hi\n", private=True)
        with open_for_writing(tmp_path / "x", private=True) as f:
            f.write(b"x")
        append_text(tmp_path / "log", "a\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "point.sbatch").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "x").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "log").st_mode) == 0o666  # an ordinary record honours the umask
    (tmp_path / "dev").symlink_to("/dev/null")
    with pytest.raises(UnsafeTarget, match="is a symlink"):
        append_text(tmp_path / "dev", "a\n")
    with pytest.raises(UnsafeTarget, match="not a regular file"):
        append_text("/dev/null", "a\n")


# ----------------------------------------------------------------------------- issue 43: --snapshot-code


def _package(tmp_path: Path) -> Path:
    pkg = tmp_path / "src" / "mypkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("X = 1\n")
    (pkg / "sub" / "mod.py").write_text("Y = 2\n")
    return pkg


def test_the_snapshot_copies_regular_files_inside_the_tree_only_private_and_counted_as_it_copies(tmp_path):
    """Issue 43: the copy followed symlinks (a file outside the tree that others cannot read was copied
    readable into the run directory), did not count symlinked directories against its cap, copied
    /dev/zero until the disk was full, and took the umask (0777 under umask 000)."""
    from hpc_hsdp.batch_shell.code_snapshot import SnapshotTooLarge, copy_code

    pkg = _package(tmp_path)
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    secret.chmod(0o600)
    (pkg / "key.py").symlink_to(secret)  # leaves the tree
    (pkg / "outside").symlink_to(tmp_path)  # a directory outside: never walked
    (pkg / "zero").symlink_to("/dev/zero")
    os.mkfifo(pkg / "fifo")
    (pkg / "alias.py").symlink_to(pkg / "sub" / "mod.py")  # inside the tree: its content is copied
    old = os.umask(0)
    try:
        copied = copy_code([("mypkg", [pkg])], tmp_path / "code")
    finally:
        os.umask(old)
    code = tmp_path / "code"
    assert sorted(str(p.relative_to(code)) for p in code.rglob("*")) == [
        "mypkg",
        "mypkg/__init__.py",
        "mypkg/alias.py",
        "mypkg/sub",
        "mypkg/sub/mod.py",
    ]
    assert copied.skipped == 4 and copied.files == 3 and copied.bytes == len("X = 1\n") + 2 * len("Y = 2\n")
    assert b"PRIVATE" not in b"".join(p.read_bytes() for p in code.rglob("*") if p.is_file())
    for path in [code, *code.rglob("*")]:
        assert stat.S_IMODE(os.lstat(path).st_mode) == (0o700 if path.is_dir() else 0o600), path
        assert not path.is_symlink()
    # the cap is counted as files are copied: a large file inside the tree stops the copy there
    (pkg / "data.bin").write_bytes(b"x" * 5000)
    with pytest.raises(SnapshotTooLarge, match="passed 0 MiB"):
        copy_code([("mypkg", [pkg])], tmp_path / "code2", max_bytes=4096)


def test_a_changed_snapshot_is_refused_before_import_and_the_checked_copy_is_what_is_imported(tmp_path):
    """Issue 43: RUN_DIR/code was first on PYTHONPATH of every attempt and nothing checked it. The
    job now checks it against the SHA-256 submit put into its script, into a private copy."""
    from hpc_hsdp.batch_shell.code_snapshot import SnapshotMismatch, copy_code, main, verified_copy

    pkg = _package(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    digest = copy_code([("mypkg", [pkg])], run / "code").sha256
    cache = tmp_path / "cache"
    good = verified_copy(run / "code", digest, cache=cache)
    assert good == cache / digest and (good / "mypkg" / "sub" / "mod.py").read_text() == "Y = 2\n"
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
    # another user swaps code/ for their own (a rename needs only write access to the run directory)
    os.rename(run / "code", run / "code.old")
    evil = run / "code" / "mypkg"
    evil.mkdir(parents=True)
    (evil / "__init__.py").write_text("import os; os.system('touch pwned')\n")
    fresh = tmp_path / "cache2"
    with pytest.raises(SnapshotMismatch, match="is not the code submit copied"):
        verified_copy(run / "code", digest, cache=fresh)
    assert [p.name for p in fresh.iterdir()] == []  # nothing of it kept
    (run / "code").rename(run / "code.evil")
    (run / "code").symlink_to(run / "code.old")
    with pytest.raises(SnapshotMismatch, match="symlink"):
        verified_copy(run / "code", digest, cache=fresh)
    # a file inside changed in place, or one added: the same refusal
    shutil.rmtree(fresh)
    (run / "code").unlink()
    (run / "code.old").rename(run / "code")
    (run / "code" / "mypkg" / "extra.py").write_text("")
    with pytest.raises(SnapshotMismatch):
        verified_copy(run / "code", digest, cache=fresh)
    # the job's step: one line, exit 2
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HPC_HSDP_CODE_CACHE", str(fresh))
        mp.setattr(sys, "stderr", err)
        assert main([str(run / "code"), digest]) == 2
        assert main([str(run / "code"), ""]) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 2 and all(line.startswith("hpc-hsdp: error: --snapshot-code: ") for line in lines), lines
    assert "only submit copies the code" in lines[1]


# ----------------------------------------------------------------------------- issue 43: export runs no code a record names


@pytest.mark.timeout(60)
def test_export_imports_no_factory_a_model_record_names_unless_the_user_names_it_again(tmp_path, capsys, monkeypatch):
    """Issue 43: export imported and called the MODULE:FUNCTION model.json names (``signal:pause``
    hung it; a module placed in the run directory ran). Now it builds a factory model only from the
    --model the user names on the command line, and says so."""
    from hpc_hsdp.task.checkpointing.export import build_unsharded

    run = tmp_path / "run"
    _valid_manifest(run)
    (run / "evilmod.py").write_text(f"open({str(tmp_path / 'pwned')!r}, 'w').close()\ndef build(training):\n    pass\n")
    monkeypatch.chdir(run)  # the run directory on sys.path, as python -m puts the working directory there
    monkeypatch.syspath_prepend(str(run))
    for named in ("signal:pause", "evilmod:build"):
        record = {"adapter": {"kind": "factory", "model": named}, "training": {"model": named}}
        (run / "model.json").write_text(json.dumps(record))
        code, _, err = run_main(["export", str(run), "-o", str(tmp_path / "out")], capsys)
        one_error_line(code, err, "model.json", named, "export imports no code", "--model MODULE:FUNCTION")
        assert not (tmp_path / "pwned").exists() and "evilmod" not in sys.modules
    # the user names the factory again: that one builds the model (the record's is not imported)
    record = {"adapter": {"kind": "factory"}, "training": {"model": "evilmod:build", "vocab_size": 64}}
    model, kind = build_unsharded(record, model="tests.tp_factory:build")
    assert kind == "factory" and sum(p.numel() for p in model.parameters()) > 0
    assert not (tmp_path / "pwned").exists() and "evilmod" not in sys.modules
