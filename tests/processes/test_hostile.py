"""Nothing from a file runs as code (issue 26), on a real small run (gloo): hostile checkpoints and
exports, a broken train state on resume and in status, and the rendezvous store's address."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch._dynamo  # noqa: F401  at import: its first import (a meta build's) sets TORCHINDUCTOR_CACHE_DIR, not a test's doing
from cli_helpers import hpc

from tests.hostile_helpers import MarkerPickle, _poison_bytes_entry, one_error_line, run_main
from tests.job_helpers import tiny_job

# ----------------------------------------------------------------------------- checkpoints in a run (gloo)

TINY = dict(layers=1, width=32, heads=4, seq_len=8, batch_size=2, vocab_size=64, steps=4, seed=3)
TINY_ARGS = tiny_job()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run: checkpoints at steps 2 and 4 (2 tasks, one shard group of 2)."""
    from dist_helpers import launch

    from hpc_hsdp.job.spec import RunSpec, TrainingSpec

    run = tmp_path_factory.mktemp("hostile") / "run"
    training = TrainingSpec.of(**TINY, checkpoint_every=2, keep_checkpoints=3)
    launch(RunSpec(shard_size=2, run_dir=str(run), device="cpu", training=training, timeout_s=60), tasks_per_node=[2])
    return run


def _forge_manifest(checkpoint: Path) -> None:
    """Whoever can write a pickle can write the manifest: make its sizes and CRCs match."""
    from hpc_hsdp.rundir.checkpointing.state import MANIFEST, file_record

    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][".metadata"] = file_record(checkpoint / ".metadata", checksum=True)
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.parametrize("manifest", ["forged", "deleted"])
def test_a_hostile_checkpoint_is_damaged_export_refuses_and_resume_falls_back(trained, tmp_path, capsys, manifest):
    from dist_helpers import launch

    from hpc_hsdp.job.spec import RunSpec, TrainingSpec
    from hpc_hsdp.rundir.checkpointing.state import MANIFEST

    run, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(trained, run)
    newest = run / "checkpoints" / "step-000004"
    (newest / ".metadata").write_bytes(pickle.dumps(MarkerPickle(marker)))
    if manifest == "forged":
        _forge_manifest(newest)
    else:
        (newest / MANIFEST).unlink()

    code, out, err = run_main(["export", str(run), "-o", str(tmp_path / "out")], capsys)
    one_error_line(code, err, "step-000004", "damaged", "posix.system")
    assert not (tmp_path / "out").exists() and not marker.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]

    training = TrainingSpec.of(**dict(TINY, steps=6), checkpoint_every=2, keep_checkpoints=3)
    again = launch(
        RunSpec(shard_size=2, run_dir=str(run), device="cpu", training=training, timeout_s=60), tasks_per_node=[2]
    )
    log = next(o.log for o in again if o.procid == 0)
    assert f"warning: checkpoint {newest} is damaged" in log and "resumed from step 2" in log, log
    assert not marker.exists()

    # the previous one exports
    code, out, err = run_main(["export", str(run), "--step", "2", "-o", str(tmp_path / "out2")], capsys)
    assert code == 0, err


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_a_hostile_non_tensor_entry_is_refused_by_export(trained, tmp_path, capsys):
    run, marker = tmp_path / "run", tmp_path / "MARKER"
    shutil.copytree(trained, run)
    newest = run / "checkpoints" / "step-000004"
    _poison_bytes_entry(newest, marker)
    (newest / MANIFEST_NAME).unlink()
    code, _, err = run_main(["export", str(run), "-o", str(tmp_path / "out")], capsys)
    one_error_line(code, err, "optim.param_groups.0.lr")
    assert not marker.exists()


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_export_replaces_only_a_previous_export_of_the_same_run(trained, tmp_path, capsys):
    out = tmp_path / "out"
    code, _, err = run_main(["export", str(trained), "--step", "2", "-o", str(out)], capsys)
    assert code == 0, err
    first = json.loads((out / "hpc-hsdp-export.json").read_text())
    assert first["run_dir"] == str(trained.resolve()) and first["step"] == 2
    code, _, err = run_main(["export", str(trained), "-o", str(out)], capsys)  # the same run: replaced
    assert code == 0, err
    assert json.loads((out / "hpc-hsdp-export.json").read_text())["step"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name != "out"]  # no temporary or replaced copy left

    other = tmp_path / "other-run"
    shutil.copytree(trained, other)
    code, _, err = run_main(["export", str(other), "-o", str(out)], capsys)  # another run's export: refused
    one_error_line(code, err, "is not an export of this run")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, _, err = run_main(["export", str(trained), "-o", str(mine)], capsys)  # someone's directory: refused
    one_error_line(code, err, "is not an export of this run")
    assert (mine / "notes.txt").read_text() == "keep me"


MANIFEST_NAME = "manifest.json"


@pytest.mark.dist
@pytest.mark.timeout(400)
@pytest.mark.parametrize("content", [b"", b'{"step": 4, "seed"', b"\xff\xfe garbage", b"[1, 2]", b" " * (5 << 20)])
def test_a_broken_train_state_falls_back_on_resume_and_in_status(trained, tmp_path, content):
    from hpc_hsdp.rundir.checkpointing.state import TRAIN_STATE, run_dir_state

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "checkpoints" / "step-000004" / TRAIN_STATE).write_bytes(content)
    state = run_dir_state(run)
    assert state.resume_step == 2 and "train_state.json" in state.skipped[0]


# ----------------------------------------------------------------------------- export: symlinks


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_export_refuses_a_symlinked_or_non_empty_output(trained, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    code, _, err = run_main(["export", str(trained), "-o", str(tmp_path / "link")], capsys)
    one_error_line(code, err, "link")
    assert list(elsewhere.iterdir()) == []


# ----------------------------------------------------------------------------- rendezvous


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of the TCP sockets listening on ``port`` (/proc/net/tcp and tcp6, hex)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def report_store_address(ctx):
    return {"rank": ctx.rank, "listening": _listening_addresses(ctx.layout.master_port)}


@pytest.mark.dist
def test_the_store_listens_on_the_job_address_only(tmp_path):
    """torch's env:// store binds every interface; the job's is served on MASTER_ADDR alone."""
    from dist_helpers import launch

    from hpc_hsdp.job.spec import RunSpec

    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", timeout_s=60)
    outcomes = launch(spec, tasks_per_node=[2], fn=report_store_address, timeout_s=120)
    seen = {o.value["rank"]: o.value["listening"] for o in outcomes}
    assert seen[0] == ["0100007F"], seen  # 127.0.0.1, little-endian hex; not 00000000 (every interface)


# ----------------------------------------------------------------------------- issue 43: what a job runs (emulator)


def _point_states(sweep: Path) -> dict[str, dict]:
    return {p.parent.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/logs/*_local.json")}


def _ended_points(sweep: Path, count: int, limit_s: float = 240) -> dict[str, dict]:
    """The states of a sweep's points once all ``count`` have ended (or at the limit)."""
    import time

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        states = _point_states(sweep)
        if len(states) == count and all(s["state"] in ("COMPLETED", "FAILED", "CANCELLED") for s in states.values()):
            return states
        time.sleep(1)
    return _point_states(sweep)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_swapped_script_of_a_pending_sweep_point_fails_that_point_in_one_line_unrun(tmp_path, local_submit):
    """Issue 43: a point ran ``exec bash "$point_dir/point.sbatch"``: whoever could write a pending
    point's directory replaced that file and it ran as the submitting user (COMPLETED). Now the
    array's script carries the SHA-256 submit wrote: the swapped point FAILS, its script unrun."""
    import os

    sweep = tmp_path / "sweep"
    argv = local_submit(sweep, "--steps", "3", *TINY_ARGS, nodes=1, gpus_per_node=1, shard=1)
    out = hpc(*argv, "--sweep", "seed=0,1", "--array-parallelism", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    marker = tmp_path / "pwned"
    pending = sweep / "seed=1"
    planted = pending / ".planted"
    planted.write_text(f"#!/bin/bash\ntouch {marker}\n")
    os.replace(planted, pending / "point.sbatch")  # what another user with write access to the directory can do
    states = _ended_points(sweep, 2)
    assert states["seed=0"]["state"] == "COMPLETED", states
    assert states["seed=1"]["state"] == "FAILED" and states["seed=1"]["exit_code"] == 2, states
    assert not marker.exists()
    said = [
        line
        for p in (pending / "logs").glob("*_0_log.err")
        for line in p.read_text().splitlines()
        if "submit wrote" in line
    ]
    assert len(said) == 1 and "point.sbatch is not the script submit wrote" in said[0], said
    # the point's script is private whatever the umask, and so is the array's
    assert oct(os.stat(sweep / "seed=0" / "point.sbatch").st_mode & 0o777) == "0o600"
    assert oct(os.stat(sweep / "sweep.sbatch").st_mode & 0o777) == "0o600"


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_forged_state_file_of_a_pending_sweep_point_reaches_neither_its_environment_nor_its_directory(
    tmp_path, local_submit
):
    """Issue 43: the emulator started a pending point with the ``array_env`` and ``submit_dir`` its
    state file in the point's logs directory named: whoever could write that file set ``BASH_ENV``
    (a script bash runs first) for a job running as the submitting user. Now what starts a job is
    the emulator's private copy; the state file is read for the state alone."""
    import os

    sweep = tmp_path / "sweep"
    argv = local_submit(sweep, "--steps", "3", *TINY_ARGS, nodes=1, gpus_per_node=1, shard=1)
    out = hpc(*argv, "--sweep", "seed=0,1", "--array-parallelism", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.sh"
    evil.write_text(f"touch {marker}\n")
    (state_file,) = (sweep / "seed=1" / "logs").glob("*_local.json")
    forged = json.loads(state_file.read_text())
    forged["array_env"]["BASH_ENV"] = str(evil)
    forged["submit_dir"] = str(tmp_path / "elsewhere")
    planted = state_file.with_name(".planted")
    planted.write_text(json.dumps(forged))
    os.replace(planted, state_file)  # what another user with write access to the directory can do
    states = _ended_points(sweep, 2)
    assert states["seed=1"]["state"] == "COMPLETED", states
    assert not marker.exists()


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_export_of_a_factory_run_builds_the_model_the_user_names_not_the_one_model_json_names(tmp_path, local_submit):
    """Issue 43: export imported the MODULE:FUNCTION of model.json; now only the --model named on its
    command line, and without one it says so in one line."""
    examples = str(Path(__file__).resolve().parents[2] / "examples")
    run = tmp_path / "run"
    factory = ["--model", "my_model:build", "--steps", "2", "--checkpoint-every", "2"]
    argv = local_submit(run, *factory, *TINY_ARGS, gpus_per_node=1, shard=1)
    env = {"PYTHONPATH": examples}
    out = hpc(*argv, "--wait", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    refused = hpc("export", str(run), "-o", str(tmp_path / "refused"), env=env)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "'my_model:build'" in refused.stderr and "--model MODULE:FUNCTION" in refused.stderr
    assert not (tmp_path / "refused").exists()
    done = hpc("export", str(run), "--model", "my_model:build", "-o", str(tmp_path / "out"), env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
