"""Checkpoints that survive damage and full disks, and periodic saves in the background
(issue 13), on real gloo processes: a truncated, deleted or altered shard file is found on
load and the previous whole checkpoint is used with a warning (none left: one clear error);
a disk that fills up (a small tmpfs mounted here, as root) leaves the previous checkpoint
intact and loadable, nothing incomplete marked complete, and an error naming the path and the
bytes needed; an asynchronous save holds the state of its step although training went on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from dist_helpers import in_child, launch

from hpc_hsdp.job.spec import RunSpec, TrainingSpec
from hpc_hsdp.rundir.checkpointing.state import MANIFEST, complete_checkpoints, damage, run_dir_state
from hpc_hsdp.rundir.files import read_jsonl

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

TINY = TrainingSpec.of(
    layers=1,
    width=32,
    heads=4,
    seq_len=8,
    batch_size=2,
    vocab_size=64,
    steps=6,
    seed=3,
    checkpoint_every=3,
    keep_checkpoints=2,
)
LAYOUT = [2, 2]


def spec_for(run_dir: Path, training: TrainingSpec = TINY) -> RunSpec:
    return RunSpec(shard_size=2, run_dir=str(run_dir), device="cpu", training=training, timeout_s=60)


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def rank0_log(outcomes) -> str:
    return next(o.log for o in outcomes if o.procid == 0)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run of 6 steps with checkpoints at 3 (in the background) and 6 (at the end)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    launch(spec_for(run), tasks_per_node=LAYOUT, timeout_s=180)
    return run


def test_the_manifest_records_every_file_with_size_and_crc(finished):
    assert [s for s, _ in complete_checkpoints(finished)] == [3, 6]
    for _, path in complete_checkpoints(finished):
        manifest = json.loads((path / MANIFEST).read_text())
        on_disk = sorted(p.name for p in path.iterdir() if p.name.startswith("__") or p.name == ".metadata")
        assert sorted(manifest["files"]) == on_disk and len(on_disk) == 5  # 4 ranks' shards + .metadata
        assert all(
            rec["bytes"] == (path / name).stat().st_size and "crc32" in rec for name, rec in manifest["files"].items()
        )
        assert damage(path, checksum_files=["*"]) is None


def test_damaged_checkpoints_fall_back_to_the_previous_whole_one(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    step6 = run / "checkpoints" / "step-000006"
    shard = step6 / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated

    assert run_dir_state(run).resume_step == 3  # what submit would say, without torch
    again = launch(spec_for(run), tasks_per_node=LAYOUT, timeout_s=180)
    log = rank0_log(again)
    assert (
        f"warning: checkpoint {step6} is damaged (__1_0.distcp has {shard.stat().st_size:,} bytes" in log
        or "warning: checkpoint" in log
        and "__1_0.distcp has" in log
    ), log
    assert "resumed from step 3" in log
    assert {o.value["start_step"] for o in again} == {3} and {o.value["steps"] for o in again} == {6}
    assert losses(run) == losses(finished)  # steps 4-6 redone exactly

    # an altered byte (same size: only the CRC sees it) in the newest, a deleted shard in the one before
    step6 = run / "checkpoints" / "step-000006"
    victim = step6 / "__2_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    (run / "checkpoints" / "step-000003" / "__0_0.distcp").unlink()
    failed = launch(spec_for(run), tasks_per_node=LAYOUT, timeout_s=180, expect_failure=True)
    assert not any(o.ok for o in failed)
    message = next(line for line in str(failed[0].value).splitlines() if "CheckpointError" in line)
    assert f"no whole checkpoint left in {run / 'checkpoints'}" in message
    assert "step-000006: __2_0.distcp has the right size but not the bytes saved (CRC-32 differs)" in message
    assert "step-000003: __0_0.distcp is missing" in message and "remove" in message


def test_a_background_save_holds_its_steps_state(finished, tmp_path):
    """Training goes on while step 3 is written; resuming from it must give the same steps 4-6
    (and the same final checkpoint) as the run that never stopped."""
    from tests.runtime_helpers import compare_checkpoints

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "checkpoints" / "step-000006")
    again = launch(spec_for(run), tasks_per_node=LAYOUT, timeout_s=180)
    assert {o.value["start_step"] for o in again} == {3}
    assert losses(run) == losses(finished)
    diffs = in_child(compare_checkpoints, run / "checkpoints" / "step-000006", finished / "checkpoints" / "step-000006")
    assert diffs == []


# ----------------------------------------------------------------------------- a full disk


@pytest.fixture
def small_disk(tmp_path, finished):
    """A run directory whose checkpoints/ is a tmpfs with room for one checkpoint of TINY and a
    half (mounted as root here; metrics and logs stay on the ordinary disk)."""
    one = sum(f.stat().st_size for f in (finished / "checkpoints" / "step-000003").iterdir())
    run = tmp_path / "run"
    mount = run / "checkpoints"
    mount.mkdir(parents=True)
    size_kib = (one * 3 // 2) // 1024 + 4
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); needs root"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the full-disk tests: {reason}")
        pytest.skip(reason)
    try:
        yield run, one
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _agree_on_space(disk: Path, *, fill: bool, errno_on: int | None):
    """fn: fill the disk (or not), then every rank asks whether the failed write ran out of space,
    with an ENOSPC inside its error only on rank ``errno_on``; the others have DCP's "unexpected
    pos" RuntimeError, as it reaches them pickled, without the OSError it came from."""

    def fn(ctx):
        import errno

        import torch.distributed as dist

        from hpc_hsdp.task.checkpointing.checkpoint import _ran_out_of_space

        if fill and ctx.rank == 0:
            with open(disk / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
        dist.barrier()
        error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        if ctx.rank == errno_on:
            try:
                raise error from OSError(errno.ENOSPC, "No space left on device")
            except RuntimeError as chained:
                error = chained
        return _ran_out_of_space(error, disk / "step-000004.tmp", needed=1 << 20)

    return fn


@pytest.mark.parametrize(
    ("fill", "errno_on", "expected"),
    [(True, None, True), (False, 1, True), (False, None, False)],
    ids=["disk-full-errno-lost", "errno-on-one-rank", "room-and-no-errno"],
)
def test_the_ranks_agree_that_a_failed_write_ran_out_of_space(tmp_path, fill, errno_on, expected):
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if done.returncode != 0:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the full-disk tests: cannot mount a tmpfs ({done.stderr.strip()})")
        pytest.skip("cannot mount a tmpfs here; needs root")
    try:
        out = launch(
            spec_for(tmp_path / "run"),
            tasks_per_node=LAYOUT,
            timeout_s=120,
            fn=_agree_on_space(disk, fill=fill, errno_on=errno_on),
        )
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    assert [o.value for o in out] == [expected] * 4


def load_newest(ctx):
    """fn: build the model, load the newest whole checkpoint (verified), report its step."""
    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.task.checkpointing import checkpoint
    from hpc_hsdp.task.training.model import build_model, make_optimizer

    training = ctx.spec.training
    model = build_model(ctx, resolve_model(training, data_vocab_size=None), training)
    optimizer = make_optimizer(model, training.optimizer)
    step, path = checkpoint.latest_checkpoint(ctx.run_dir)
    return checkpoint.load(path, model, optimizer)["step"]


@pytest.mark.parametrize("check_first", [True, False], ids=["refused-before-writing", "out-of-space-mid-write"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_names_path_and_bytes(small_disk, check_first):
    run, one = small_disk
    training = TINY.replace(checkpoint_every=2, keep_checkpoints=2)
    env = {} if check_first else {"HPC_HSDP_FAULT_SKIP_SPACE_CHECK": "1"}
    out = launch(spec_for(run, training), tasks_per_node=LAYOUT, timeout_s=180, expect_failure=True, extra_env=env)
    assert not any(o.ok for o in out)
    errors = {
        next((line for line in str(o.value).splitlines() if "CheckpointSpaceError" in line), str(o.value)[-800:])
        for o in out
    }
    assert len(errors) == 1, errors  # the same line on every rank
    error = errors.pop()
    step4 = run / "checkpoints" / "step-000004.tmp"
    when = "has no room for" if check_first else "ran out of space while writing"
    assert f"the disk of {run / 'checkpoints'} {when} the checkpoint of step 4 ({step4})" in error, error
    needed = int(error.split("about ")[1].split(" bytes needed")[0].replace(",", ""))
    assert 0.5 * one < needed < 1.5 * one, (needed, one)  # the estimate is about one checkpoint's size
    assert f"the previous checkpoint {run / 'checkpoints' / 'step-000002'} is intact" in error

    assert [s for s, _ in complete_checkpoints(run)] == [2]  # nothing incomplete marked complete
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002"]  # the partial one removed
    assert damage(run / "checkpoints" / "step-000002", checksum_files=["*"]) is None
    loaded = launch(spec_for(run, training), tasks_per_node=LAYOUT, fn=load_newest, timeout_s=180)
    assert {o.value for o in loaded} == {2}
