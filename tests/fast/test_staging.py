"""``--stage-data``: the value's form and where it points (hpc_hsdp.plan.staging_dir), the copies'
decisions and the copies themselves on one process (hpc_hsdp.data.staging_copies), the sidecar's
sha256 (hpc_hsdp.data.tokens), the run directory's record (hpc_hsdp.rundir.training.staging_record) and the
refusals of render and submit (hpc_hsdp.submit_host.preflight). The multi-rank runs are in
tests/processes/test_staging.py."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import assert_cli_imports_no_torch, hpc

from hpc_hsdp.cli import main
from hpc_hsdp.data.staging_copies import (
    COPY,
    COPY_CHUNK,
    REUSE,
    SPACE_MARGIN_BYTES,
    VERIFY,
    FileStat,
    copy_state,
    launch_token,
    local_name,
    space_needed,
    stage_files,
    stage_root,
)
from hpc_hsdp.data.tokens import READ_LATENCY, open_dataset, read_latency_of, read_token_file, write_token_file
from hpc_hsdp.errors import DataError, SpecError
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.plan.staging_dir import check_stage_value, stage_base
from hpc_hsdp.rundir.training.staging_record import node_staging, staging_lines, write_staging_record

# ----------------------------------------------------------------------------- where the copies go


@pytest.mark.parametrize(
    ("value", "env", "expected"),
    [
        ("auto", {"SLURM_TMPDIR": "/local/job42", "TMPDIR": "/tmp/x"}, "/local/job42"),
        ("auto", {"TMPDIR": "/scratch/tmp"}, "/scratch/tmp"),
        ("auto", {"SLURM_TMPDIR": "  ", "TMPDIR": ""}, "/tmp"),
        ("auto", {}, "/tmp"),
        ("/nvme/stage", {"SLURM_TMPDIR": "/local"}, "/nvme/stage"),
        ("$LOCAL_SCRATCH/stage", {"LOCAL_SCRATCH": "/lscratch/u1"}, "/lscratch/u1/stage"),
        ("${LOCAL}x/y", {"LOCAL": "/l"}, "/lx/y"),
    ],
)
def test_stage_base(value, env, expected):
    assert stage_base(value, env) == Path(expected)


@pytest.mark.parametrize(
    ("value", "env", "message"),
    [
        ("stage", {}, "'stage' is not an absolute path"),
        ("./stage", {}, "not an absolute path"),
        ("$LOCAL_SCRATCH/stage", {}, "$LOCAL_SCRATCH is not set on this node"),
        ("$REL", {"REL": "relative/dir"}, "'relative/dir' on this node, not an absolute path"),
        ("/a/$/b", {}, "a '$' that names no variable"),
    ],
)
def test_bad_stage_values_are_one_line(value, env, message):
    with pytest.raises(SpecError, match="^--stage-data .*") as exc:
        stage_base(value, env)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_spec_refuses_a_relative_dir_and_staging_without_data():
    check_stage_value("auto")
    with pytest.raises(SpecError, match="not an absolute path"):
        TrainingSpec.of(data="/d", stage_data="local")
    with pytest.raises(SpecError, match="--stage-data without --data"):
        TrainingSpec.of(stage_data="auto")
    assert TrainingSpec.of(data="/d", stage_data="none").dataset.stage_data is None
    assert TrainingSpec.of(data="/d", stage_data="/nvme").to_args() == ["--data", "/d", "--stage-data", "/nvme"]


def test_copies_of_two_datasets_never_share_a_name(tmp_path):
    assert local_name(tmp_path / "a" / "00000.bin") != local_name(tmp_path / "b" / "00000.bin")
    assert local_name(tmp_path / "a" / "00000.bin").endswith("-00000.bin")
    assert stage_root(Path("/tmp"), uid=1234) == Path("/tmp/hpc-hsdp-staged-1234")


def test_the_launch_token_differs_for_a_second_job_a_requeue_and_another_rendezvous():
    base = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_RESTART_COUNT": "0"}
    one = launch_token(base, rendezvous="n1:29500", parent_pid=10)
    assert one == launch_token(dict(base), rendezvous="n1:29500", parent_pid=10)
    assert one != launch_token({**base, "SLURM_JOB_ID": "8"}, rendezvous="n1:29500", parent_pid=10)
    assert one != launch_token({**base, "SLURM_RESTART_COUNT": "1"}, rendezvous="n1:29500", parent_pid=10)
    assert one != launch_token(base, rendezvous="n1:29501", parent_pid=10)
    assert one != launch_token(base, rendezvous="n1:29500", parent_pid=11)


# ----------------------------------------------------------------------------- the decisions

SRC = FileStat(size=1000, mtime_ns=5)
GOOD = {"source_size": 1000, "source_mtime_ns": 5, "sha256": "ab" * 32, "launch": "L1", "local_mtime_ns": 9}


@pytest.mark.parametrize(
    ("expected", "record", "local", "launch", "state"),
    [
        ("ab" * 32, None, FileStat(1000, 9), "L1", COPY),  # no record: a copy of unknown origin
        ("ab" * 32, GOOD, None, "L1", COPY),  # no copy
        ("ab" * 32, GOOD, FileStat(1000, 9), "L1", REUSE),  # this launch verified it, untouched since
        ("ab" * 32, GOOD, FileStat(1000, 10), "L1", VERIFY),  # touched since: read it again
        ("ab" * 32, GOOD, FileStat(1000, 9), "L2", VERIFY),  # a second job: read it once
        (None, GOOD, FileStat(1000, 9), "L2", VERIFY),  # an old sidecar: the record's digest stands
        ("cd" * 32, GOOD, FileStat(1000, 9), "L1", COPY),  # the data was prepared again
        ("ab" * 32, {**GOOD, "source_mtime_ns": 4}, FileStat(1000, 9), "L1", COPY),  # source rewritten
        ("ab" * 32, {**GOOD, "source_size": 999}, FileStat(1000, 9), "L1", COPY),
        ("ab" * 32, GOOD, FileStat(999, 9), "L1", COPY),  # a truncated copy
        ("ab" * 32, {**GOOD, "sha256": None}, FileStat(1000, 9), "L1", COPY),
    ],
)
def test_copy_state(expected, record, local, launch, state):
    assert copy_state(source=SRC, expected=expected, record=record, local=local, launch=launch) == state


def test_space_needed_adds_a_margin_and_nothing_to_copy_needs_nothing():
    assert space_needed([]) == 0 and space_needed([0]) == 0
    assert space_needed([100 << 20, 100 << 20]) == (200 << 20) + SPACE_MARGIN_BYTES + int((200 << 20) * 0.02)


# ----------------------------------------------------------------------------- the sidecar's sha256


def test_the_sidecar_records_the_sha256_of_the_bin(tmp_path):
    tokens = np.arange(5000) % 300
    written = write_token_file(tmp_path / "a.bin", tokens, vocab_size=300)
    digest = hashlib.sha256((tmp_path / "a.bin").read_bytes()).hexdigest()
    assert written.sha256 == digest
    assert json.loads((tmp_path / "a.json").read_text())["sha256"] == digest
    assert read_token_file(tmp_path / "a.bin").sha256 == digest


def test_a_sidecar_without_sha256_still_opens_and_a_bad_one_is_refused(tmp_path):
    write_token_file(tmp_path / "a.bin", np.arange(100), vocab_size=300)
    side = json.loads((tmp_path / "a.json").read_text())
    del side["sha256"]
    (tmp_path / "a.json").write_text(json.dumps(side))
    assert read_token_file(tmp_path / "a.bin").sha256 is None
    (tmp_path / "a.json").write_text(json.dumps({**side, "sha256": "xyz"}))
    with pytest.raises(DataError, match="sha256 'xyz' is not a hex SHA-256 digest"):
        read_token_file(tmp_path / "a.bin")


def test_the_read_latency_hook_applies_under_its_directory_only(tmp_path):
    env = {READ_LATENCY: f"0.25@{tmp_path / 'shared'}"}
    assert read_latency_of(tmp_path / "shared" / "x.bin", env) == 0.25
    assert read_latency_of(tmp_path / "local" / "x.bin", env) == 0.0
    assert read_latency_of(tmp_path / "x.bin", {}) == 0.0
    with pytest.raises(DataError, match="not SECONDS@DIRECTORY"):
        read_latency_of(tmp_path / "x.bin", {READ_LATENCY: "slow"})


# ----------------------------------------------------------------------------- the copies, one process


@pytest.fixture
def shards(tmp_path) -> list:
    """Two shards of a shared dataset (one larger than a copy chunk)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    rng = np.random.default_rng(0)
    first = write_token_file(shared / "00000.bin", rng.integers(0, 60000, COPY_CHUNK // 2 + 123), vocab_size=60000)
    second = write_token_file(shared / "00001.bin", rng.integers(0, 60000, 4321), vocab_size=60000)
    return [first, second]


def _actions(result) -> list[str]:
    return [f.action for f in result.files]


def test_copy_then_reuse_then_verify_then_replace_a_damaged_copy(tmp_path, shards):
    root = tmp_path / "local" / "stage"
    first = stage_files(shards, root, launch="job1")
    assert _actions(first) == ["copied", "copied"] and first.fallback is None
    assert first.copied_bytes == sum(f.path.stat().st_size for f in shards)
    for f in first.files:
        assert Path(f.local).read_bytes() == Path(f.source).read_bytes() and f.checksum_from == "sidecar"
    again = stage_files(shards, root, launch="job1")  # another rank of the same launch
    assert _actions(again) == ["reused", "reused"] and again.verify_s == 0.0 and again.copy_s == 0.0

    second_job = stage_files(shards, root, launch="job2")
    assert _actions(second_job) == ["reused", "reused"] and second_job.verify_s > 0 and second_job.copy_s == 0.0

    # bit rot: one byte flipped, the size and even the mtime kept
    local = Path(second_job.files[0].local)
    info = local.stat()
    with open(local, "r+b") as f:
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.utime(local, ns=(info.st_atime_ns, info.st_mtime_ns))
    third_job = stage_files(shards, root, launch="job3")
    assert _actions(third_job) == ["replaced", "reused"]
    assert local.read_bytes() == shards[0].path.read_bytes()


def test_the_loader_reads_the_same_tokens_from_the_copies(tmp_path, shards):
    ds = open_dataset(tmp_path / "shared")
    before = [ds.read(start, 777) for start in (0, COPY_CHUNK // 4, COPY_CHUNK // 2 + 123 - 100, ds.num_tokens - 777)]
    result = stage_files(ds.files, tmp_path / "stage", launch="L")
    ds.read_from(result.local_paths())
    assert all(str(f.path).startswith(str(tmp_path / "stage")) for f in ds.files)
    after = [ds.read(start, 777) for start in (0, COPY_CHUNK // 4, COPY_CHUNK // 2 + 123 - 100, ds.num_tokens - 777)]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


def test_too_little_space_leaves_the_node_on_the_shared_copy(tmp_path, shards):
    result = stage_files(shards, tmp_path / "stage", launch="L", free_bytes=lambda root: 10 << 20)
    assert _actions(result) == ["shared", "shared"] and result.local_paths() == {}
    assert "MiB free" in result.fallback and "reading the shared copy" in result.fallback
    assert not [p for p in (tmp_path / "stage").iterdir() if p.name.endswith(".bin")]


def test_a_sidecar_without_sha256_is_checked_against_the_shared_copy_as_read(tmp_path, shards):
    side = shards[1].sidecar
    data = json.loads(side.read_text())
    del data["sha256"]
    side.write_text(json.dumps(data))
    old = [read_token_file(f.path) for f in shards]
    result = stage_files(old, tmp_path / "stage", launch="L")
    assert [f.checksum_from for f in result.files] == ["sidecar", "shared copy"]
    record = json.loads(Path(result.files[1].local + ".staged.json").read_text())
    assert record["sha256"] == hashlib.sha256(shards[1].path.read_bytes()).hexdigest()
    assert _actions(stage_files(old, tmp_path / "stage", launch="L2")) == ["reused", "reused"]


def test_a_damaged_shared_copy_is_refused_in_one_line(tmp_path, shards):
    with open(shards[1].path, "r+b") as f:
        f.write(b"\x00\x00")
    with pytest.raises(DataError) as exc:
        stage_files(shards, tmp_path / "stage", launch="L")
    assert "does not match the sha256 its sidecar records" in str(exc.value) and "\n" not in str(exc.value)
    assert not list((tmp_path / "stage").glob("*00001.bin"))


def test_a_stage_dir_that_is_a_file_fails_in_one_line(tmp_path, shards):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match=r"^--stage-data: cannot use .*file/hpc-hsdp-staged"):
        stage_files(shards, stage_root(tmp_path / "file"), launch="L")


# ----------------------------------------------------------------------------- the run directory's record


def _result(copy_s, seconds, actions, fallback=None, bytes_=100, verify_s=0.0):
    files = [
        {"source": f"/d/{i}.bin", "local": None, "bytes": bytes_, "action": a, "checksum_from": "sidecar"}
        for i, a in enumerate(actions)
    ]
    copied = sum(bytes_ for a in actions if a in ("copied", "replaced"))
    return {"root": "/tmp/s", "seconds": seconds, "copy_s": copy_s, "verify_s": verify_s, "copied_bytes": copied,
            "fallback": fallback, "files": files}  # fmt: skip


def test_the_record_keeps_each_nodes_copier_and_its_last_ready_rank():
    per_rank = [
        ("n1", _result(0.0, 2.0, ["reused", "reused"])),  # waited for the copier
        ("n1", _result(1.5, 1.6, ["copied", "copied"])),  # the copier
        ("n2", _result(0.0, 0.3, ["reused", "reused"])),
        ("n2", _result(0.0, 0.2, ["reused", "reused"], verify_s=0.15)),  # verified a second job's copies
        ("n3", _result(0.0, 0.1, ["shared", "shared"], fallback="/tmp/s has 1 MiB free")),
    ]
    record = node_staging(per_rank, "auto")
    assert record["nodes"]["n1"]["copy_s"] == 1.5 and record["nodes"]["n1"]["seconds"] == 2.0
    assert record["nodes"]["n1"]["copied_bytes"] == 200 and record["copied_bytes"] == 200
    assert record["seconds"] == 2.0 and record["dir"] == "auto"
    assert record["nodes"]["n2"]["verify_s"] == 0.15 and record["nodes"]["n2"]["seconds"] == 0.3
    lines = staging_lines(record)
    assert lines[0].startswith("--stage-data: token files on node-local disk of 2/3 node(s) in 2.00 s (slowest n1;")
    assert "copied 2, reused 2, shared 2" in lines[0] and "staging.json" in lines[0]
    assert lines[1:] == ["warning: --stage-data: n3: /tmp/s has 1 MiB free"]


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (None, False),  # a run without --stage-data
        ("JSON", True),
        ('{"nodes": {"n1": {"files": 3}}, "seconds": "x"}', False),  # not a record: nothing, no traceback
        ("[" * 10000, False),
    ],
)
def test_status_shows_the_staging_line(tmp_path, text, shown):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "5_local.json").write_text(json.dumps({"state": "COMPLETED", "exit_code": 0}))
    job = {"job_id": "5", "cluster": "local", "run_dir": str(tmp_path), "logs_dir": str(logs), "job_name": "x",
           "ntasks": 4, "launcher": "srun", "submitted_at": 0.0}  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(job))
    if text == "JSON":
        write_staging_record(
            tmp_path,
            node_staging([("n1", _result(1.5, 1.6, ["copied"])), ("n2", _result(0.0, 0.2, ["reused"]))], "auto"),
        )
    elif text is not None:
        (tmp_path / "staging.json").write_text(text)
    out = hpc("status", str(tmp_path))
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert ("--stage-data: token files on node-local disk of 2/2 node(s) in 1.60 s" in out.stdout) == shown, out.stdout


# ----------------------------------------------------------------------------- render and submit refuse


def _run_main(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize("command", ["render", "submit"])
@pytest.mark.parametrize(
    ("stage", "words"),
    [
        ("FILE", ["is not a directory"]),
        ("FILE/below", ["is not a directory"]),
        ("/proc/self", ["is not writable by you"]),  # not even root makes files there
        ("relative/dir", ["is not an absolute path"]),
    ],
)
def test_bad_staging_dirs_exit_2_with_one_line(command, stage, words, tmp_path, capsys):
    (tmp_path / "FILE").write_text("x")
    stage = stage.replace("FILE", str(tmp_path / "FILE"))
    data = tmp_path / "data.bin"
    write_token_file(data, np.arange(4000) % 256, vocab_size=256)
    run_dir = tmp_path / "run"
    argv = [command, "--shard", "1", "--gpus-per-node", "1", "--run-dir", str(run_dir), "--data", str(data)]
    code, out, err = _run_main([*argv, "--stage-data", stage], capsys)
    assert code == 2, (out, err)
    assert err.startswith("hpc-hsdp: error: --stage-data ") and err.count("\n") == 1, err
    assert all(word in err for word in words), err
    assert not run_dir.exists()


def test_a_writable_or_missing_staging_dir_renders_into_the_run_arguments(tmp_path, capsys):
    for stage in (str(tmp_path), str(tmp_path / "not" / "yet"), "auto", "$LOCAL/x"):
        argv = ["render", "--shard", "1", "--run-dir", str(tmp_path / "r"), "--data", "/d", "--stage-data", stage]
        code, out, err = _run_main([*argv, "-o", str(tmp_path / "job.sbatch")], capsys)
        assert code in (0, None), err
        assert f"--stage-data {shlex.quote(stage)}" in (tmp_path / "job.sbatch").read_text()
    assert not (tmp_path / "not").exists()  # the nodes make it


def test_the_staging_checks_import_no_torch(tmp_path):
    argv = ["--shard", "1", "--run-dir", str(tmp_path / "r"), "--data", "/d", "--stage-data", str(tmp_path)]
    assert_cli_imports_no_torch(["render", *argv, "-o", str(tmp_path / "job.sbatch")])


def test_every_dataset_a_run_reads_is_staged_a_mixtures_sources_and_held_out_splits_too(tmp_path):
    from hpc_hsdp.data.tokens import write_dataset_manifest
    from hpc_hsdp.task.training.run_data import open_data
    from hpc_hsdp.task.training.staging import token_datasets

    for name in ("web", "code"):
        root = tmp_path / name
        for split in ("train", "val"):
            (root / split).mkdir(parents=True)
            write_token_file(root / split / "00000.bin", np.arange(3000) % 256, vocab_size=256)
        splits = {"train": ["train/00000.bin"], "val": ["val/00000.bin"]}
        write_dataset_manifest(root, vocab_size=256, dtype="uint16", tokenizer={}, splits=splits)
    mixture = f"web={tmp_path / 'web'}:0.5,code={tmp_path / 'code'}:0.5"
    training = TrainingSpec.of(data=mixture, stage_data="auto", eval_every=2, seq_len=16, batch_size=2)
    found = sorted(str(f.path.relative_to(tmp_path)) for ds in token_datasets(open_data(training, 2)) for f in ds.files)
    assert found == ["code/train/00000.bin", "code/val/00000.bin", "web/train/00000.bin", "web/val/00000.bin"]
    one = TrainingSpec.of(data=str(tmp_path / "web"), stage_data="auto", eval_every=2, seq_len=16, batch_size=2)
    assert len(token_datasets(open_data(one, 2))) == 2
    assert token_datasets(open_data(TrainingSpec.of(seq_len=16), 2)) == []  # synthetic tokens: nothing to stage


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of another user's is made with chown, as root")
def test_another_users_staging_directory_is_never_used_the_node_reads_the_shared_copy(tmp_path, shards):
    """Another user who makes BASE/hpc-hsdp-staged-<uid> first (SECURITY.md): it blocked
    --stage-data; now the node reads the shared copy, says why, and touches nothing there."""
    root = stage_root(tmp_path / "base")
    root.mkdir(parents=True, mode=0o777)
    os.chown(root, 4321, 4321)
    result = stage_files(shards, root, launch="L")
    assert _actions(result) == ["shared", "shared"] and result.local_paths() == {}
    assert result.fallback == f"{root} belongs to user id 4321, not to you; reading the shared copy"
    assert list(root.iterdir()) == [] and os.lstat(root).st_uid == 4321


def test_a_symlink_in_place_of_the_staging_directory_is_never_followed(tmp_path, shards):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = stage_root(tmp_path / "base")
    root.parent.mkdir()
    root.symlink_to(elsewhere)
    result = stage_files(shards, root, launch="L")
    assert _actions(result) == ["shared", "shared"] and "is a symlink or not a directory" in result.fallback
    assert list(elsewhere.iterdir()) == []
