"""The pure parts of ``--checkpoint-store`` (hpc_hsdp/rundir/checkpointing/checkpoint_store.py, store_record.py):
the URL, the commit rule, the store's listing, retention, the resume order, the retries and
how long the way out waits; the server-backed behaviour is tests/processes/test_checkpoint_store.py."""

from __future__ import annotations

import sys

import pytest

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.plan.estimates import save_estimate
from hpc_hsdp.plan.topology import plan_for
from hpc_hsdp.rundir.checkpointing.checkpoint_store import (
    Candidate,
    CheckpointStore,
    StoreError,
    StoreURL,
    doomed_steps,
    missing_uploads,
    own_files,
    parse_listing,
    parse_store_url,
    resume_candidates,
    retrying,
    wait_limit_s,
)
from hpc_hsdp.rundir.checkpointing.store_record import read_store_record, store_lines, write_store_record


@pytest.mark.parametrize(
    ("text", "url"),
    [
        ("s3://bucket", StoreURL("s3", "bucket", "")),
        ("s3://bucket/", StoreURL("s3", "bucket", "")),
        ("S3://my-bucket.1/runs//llama-70b/", StoreURL("s3", "my-bucket.1", "runs/llama-70b")),
        (" s3://b_1/a=1/b+2 ", StoreURL("s3", "b_1", "a=1/b+2")),
    ],
)
def test_urls_that_name_a_bucket_and_a_prefix(text, url):
    assert parse_store_url(text) == url
    assert str(url) == f"s3://{url.root}"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("bucket/prefix", "is not a URL"),
        ("gs://bucket/p", "scheme gs:// is not supported"),
        ("s3:///prefix", "names no bucket"),
        ("s3://", "names no bucket"),
        ("s3://AKIA:secret@bucket/p", "holds credentials or a port"),
        ("s3://host:9000/p", "holds credentials or a port"),
        ("s3://bucket/p?versionId=1", "holds a query"),
        ("s3://bucket/a b", "white space"),
        ("s3://bucket/../other", "no '..'"),
        ("s3://-bucket/p", "is not a bucket name"),
    ],
)
def test_urls_refused_in_one_line(text, said):
    with pytest.raises(SpecError, match=said) as caught:
        parse_store_url(text)
    assert "\n" not in str(caught.value) and "secret" not in str(caught.value)


def test_the_training_spec_keeps_the_url_in_its_plain_form_and_passes_it_to_the_tasks():
    spec = TrainingSpec.of(checkpoint_store="S3://ckpt//runs/a/")
    assert spec.checkpoint.checkpoint_store == "s3://ckpt/runs/a"
    assert spec.to_args()[-2:] == ["--checkpoint-store", "s3://ckpt/runs/a"]
    with pytest.raises(SpecError, match="names no bucket"):
        TrainingSpec.of(checkpoint_store="s3://")


RANK0 = {".metadata": {"bytes": 10, "crc32": 1}, "__0_0.distcp": {"bytes": 5, "crc32": 2}}
RANK1 = {"__1_0.distcp": {"bytes": 6, "crc32": 3}}
MANIFEST = {"files": {**RANK0, **RANK1}}


@pytest.mark.parametrize(
    ("world", "markers", "problem"),
    [
        (2, {0: RANK0, 1: RANK1}, None),
        (2, {0: RANK0}, "rank 1 of 2 still uploading"),
        (4, {0: RANK0}, "ranks 1-3 of 4 still uploading"),
        (5, {0: RANK0, 2: {}}, "ranks 1,3-4 of 5 still uploading"),
        (2, {0: RANK0, 1: {}}, "__1_0.distcp was uploaded by no rank"),
        (
            2,
            {0: RANK0, 1: {"__1_0.distcp": {"bytes": 6, "crc32": 4}}},
            "__1_0.distcp was uploaded with another size or CRC-32 than the manifest's",
        ),
        (3, {0: RANK0, 1: {}, 2: RANK1}, None),  # a share of another world size: who uploaded it does not matter
    ],
)
def test_a_step_is_committed_only_when_every_rank_uploaded_what_the_manifest_lists(world, markers, problem):
    assert missing_uploads(MANIFEST, world, markers) == problem


def test_each_rank_uploads_its_own_files():
    names = [".metadata", "__0_0.distcp", "__1_0.distcp", "__10_0.distcp", "__1_1.distcp"]
    assert own_files(names, 0) == [".metadata", "__0_0.distcp"]
    assert own_files(names, 1) == ["__1_0.distcp", "__1_1.distcp"]
    assert own_files(names, 10) == ["__10_0.distcp"]


def test_the_listing_tells_committed_steps_from_the_others():
    keys = [
        "/step-000002/COMPLETE",
        "/step-000002/__0_0.distcp",
        "/step-000004/__0_0.distcp",
        "/step-000004/uploaded/rank-00000.json",
        "/step-000006/COMPLETE",
        "/step-000006/manifest.json",
        "/.hpc-hsdp-probe-1",
        "/notes/step-000008/COMPLETE",
        "/step-00000x/COMPLETE",
    ]
    assert parse_listing(keys) == ([2, 6], [4])


@pytest.mark.parametrize(
    ("committed", "uncommitted", "keep", "doomed"),
    [
        ([], [2, 4], 2, []),  # nothing committed: nothing deleted
        ([2], [], 2, []),
        ([2, 4, 6], [], 2, [2]),
        ([2, 4, 6], [], 1, [2, 4]),
        ([2, 6], [4, 8], 2, [4]),  # 4 abandoned under 6; 8 may still be uploading
        ([2, 4, 6, 8], [], 3, [2]),
    ],
)
def test_retention_deletes_old_steps_only_after_a_newer_one_is_committed(committed, uncommitted, keep, doomed):
    assert doomed_steps(committed, uncommitted, keep) == doomed


def test_resume_takes_the_newest_step_of_the_run_directory_or_the_store():
    assert resume_candidates([2, 4], [4, 6]) == [
        Candidate(step=6, local=False, stored=True),
        Candidate(step=4, local=True, stored=True),
        Candidate(step=2, local=True, stored=False),
    ]
    assert resume_candidates([], []) == []


def test_a_failing_action_is_tried_again_with_growing_waits_until_the_deadline():
    waits, calls = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 4:
            raise ConnectionError("endpoint unreachable")
        return "done"

    retried = []
    assert retrying(flaky, what="x", sleep=waits.append, on_retry=lambda n, e, w: retried.append(n)) == "done"
    assert retried == [1, 2, 3] and waits == sorted(waits) and 0.5 <= waits[0] < waits[-1]

    def unreachable():
        raise ConnectionError("endpoint unreachable")

    with pytest.raises(StoreError, match=r"the upload of step 4: endpoint unreachable \(after 1 tries\)"):
        retrying(unreachable, what="the upload of step 4", deadline=lambda: 0.0, sleep=waits.append)


@pytest.mark.parametrize(
    ("env", "term_at", "limit"),
    [
        ({}, None, 3600.0),
        ({"SLURM_JOB_END_TIME": "1300"}, None, 290.0),  # the time limit, less the margin
        ({"SLURM_JOB_END_TIME": "1300"}, 995.0, 15.0),  # SIGTERM: KillWait (30 s) from its arrival
        ({"SLURM_JOB_END_TIME": "1005"}, None, 0.0),
        ({"SLURM_JOB_END_TIME": "0"}, None, 3600.0),
    ],
)
def test_the_way_out_waits_as_long_as_slurm_leaves(env, term_at, limit):
    assert wait_limit_s(env, now=1000.0, term_at=term_at) == limit


def test_the_record_of_the_uploads_reads_back_as_status_lines(tmp_path):
    assert read_store_record(tmp_path) is None and store_lines(None) == []
    write_store_record(
        tmp_path,
        {
            "url": "s3://ckpt/a",
            "committed_step": 6,
            "committed_at": 900.0,
            "uploading": {"step": 8, "since": 990.0, "waiting": "rank 3 of 4 still uploading"},
            "retrying": {"what": "the upload of step 8", "attempts": 3, "error": "Could not connect", "since": 995.0},
        },
    )
    record = read_store_record(tmp_path)
    assert store_lines(record, now=1000.0) == [
        "store: s3://ckpt/a: step 6 committed (100 s ago)",
        "  uploading step 8 for 10 s (rank 3 of 4 still uploading)",
        "  retrying: the upload of step 8 failed 3 time(s), last: Could not connect",
    ]
    (tmp_path / "checkpoint_store.json").write_text('{"url": 5}')
    assert read_store_record(tmp_path) is None


def test_without_the_extra_the_store_is_refused_naming_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if not installed: importlib finds no spec
    with pytest.raises(SpecError, match=r"s3fs is not installed in this environment; pip install 'hpc-hsdp\[s3\]'"):
        CheckpointStore.open("s3://ckpt/runs/a")


def test_plan_counts_the_upload_in_the_save_on_the_warning_signal():
    plan = plan_for(nodes=2, gpus_per_node=8, shard_size=8)
    local = save_estimate(plan, model_params=10**9, node_write_bandwidth=10**9, signal="USR2@30")
    stored = save_estimate(
        plan, model_params=10**9, node_write_bandwidth=10**9, signal="USR2@30", upload_bandwidth=10**8
    )
    assert local.upload_seconds == 0 and not local.too_slow
    assert stored.upload_seconds == pytest.approx(10 * stored.seconds) and stored.too_slow
    assert stored.total_seconds == pytest.approx(stored.seconds + stored.upload_seconds)
    assert "--upload-bandwidth" in " ".join(stored.lines()) and stored.to_dict()["upload_seconds"] > 0
