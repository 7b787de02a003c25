"""``hpc-hsdp status`` as a list of sections (hpc_hsdp/submit_host/status_sections.py and each record's
``*_SECTION`` in hpc_hsdp/rundir/): each section's lines and JSON keys from its record, nothing
from a run directory without it, and the registry's two orders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpc_hsdp.rundir.observation.stacks import write_hang_stacks
from hpc_hsdp.rundir.training.staging_record import node_staging, write_staging_record
from hpc_hsdp.submit_host.status_sections import JSON_ORDER, SECTIONS

NCCL_TRACES = Path(__file__).resolve().parents[1] / "data" / "nccl-trace"
JOB_SECTIONS = ("job", "scheduler", "step", "time", "slow", "failure", "run-directory")
"""The sections that read the job (its handle, its scheduler's answer), not a record alone."""


def _lines(*records: dict) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def _staging(run: Path) -> None:
    copied = {"source": "/data/a.bin", "action": "copied", "checksum_from": "sidecar"}
    per_rank = [
        ("n1", {"seconds": 2.0, "copy_s": 1.5, "verify_s": 0.5, "copied_bytes": 1 << 20, "files": [copied]}),
        ("n2", {"seconds": 1.0, "copy_s": 0.1, "verify_s": 0.1, "copied_bytes": 0, "files": [copied]}),
    ]
    per_rank[0][1]["fallback"] = None
    per_rank[1][1].update(fallback="disk full", files=[dict(copied, action="shared")])
    write_staging_record(run, node_staging(per_rank, "/local/stage"))


def _hang(run: Path) -> None:
    shutil.copytree(NCCL_TRACES, run / "hang", ignore=shutil.ignore_patterns("*.py"))


def _hang_stacks(run: Path) -> None:
    frames = [
        {"function": "wait", "file": "torch/distributed/c10d.py", "line": 12, "native": False},
        {"function": "train", "file": "loop.py", "line": 3, "native": False},
    ]
    stacks = [
        {"rank": rank, "node": "n1", "pid": 10 + rank, "how": "watchdog", "error": None,
         "threads": [{"name": "MainThread", "main": True, "frames": frames[rank:]}]}
        for rank in range(2)
    ]  # fmt: skip
    write_hang_stacks(run, stacks, world_size=2, step=7)


LAST_METRICS = {"step": 4, "replicas": 1, "replica_groups": 2}
HANG = "NCCL _allgather_base #31 on mesh axis shard (ranks 2,3): rank 2 waiting in it; rank 3 never entered it (last entered 3: #30)"  # noqa: E501
STAGED = (
    "--stage-data: token files on node-local disk of 1/2 node(s) in 2.00 s (slowest n1; the ranks waited 0.00 s "
    "for it after the model was built); copied 1.0 MB; files: copied 1, shared 1 (staging.json)"
)

# (section, its record: files of the run directory or a writer, its text lines, its JSON keys or a subset of them)
ROWS = [
    (
        "compile",
        {"metrics.jsonl": _lines({"step": 4, "compile_s": 12.5, "compile_cache": {"hits": 3}})},
        ["compile: 12.5 s at step 4 (apart from the step times)"],
        {"compile": {"step": 4, "compile_s": 12.5, "compile_cache": {"hits": 3}}},
    ),
    (
        "restarts",
        {
            "restarts.jsonl": _lines(
                {"restart": 1, "resumed_from_step": 40, "reason": "hang"},
                {"restart": 2, "resumed_from_step": 60, "reason": "odd\x1b"},
            )
        },
        ["restarts: step 40: hang; step 60: odd\x1b"],  # the command escapes it, as every line
        {"restart_causes": ["step 40: hang", "step 60: odd\x1b"]},
    ),
    (
        "membership",
        {
            "replicas.jsonl": _lines(
                {"time": 1.0, "event": "replica group lost", "replica_id": "1", "nodes": ["n3"], "cause": "node down"},
                {"time": 2.0, "event": "quorum", "size": 1},
            )
        },
        [
            "replica groups (1/2 now):",
            "  00:00:01 replica group 1 lost on n3 (node down)",
            "  00:00:02 quorum",
        ],
        {"membership": ["00:00:01 replica group 1 lost on n3 (node down)", "00:00:02 quorum"]},
    ),
    (
        "staging",
        _staging,
        [STAGED, "warning: --stage-data: n2: disk full"],
        {"staging": [STAGED, "warning: --stage-data: n2: disk full"]},
    ),
    (
        "checkpoint-store",
        {"checkpoint_store.json": {"url": "s3://bucket/run\x1b[2J", "committed_step": 10}},
        ["store: s3://bucket/run\\x1b[2J: step 10 committed"],
        {"checkpoint_store": {"url": "s3://bucket/run\x1b[2J", "committed_step": 10}},
    ),
    (
        "check",
        {
            "check.json": {
                "seconds": 3.25,
                "threshold": 0.8,
                "nodes": {"n1": {}, "n2": {}},
                "links": {},
                "bad_nodes": ["n2"],
            }
        },
        [
            "check: 2 node(s), 0 link(s) in 3.2 s: below their peers: n2 (threshold 0.8 of the median)",
            "  node         matmul TFLOP/s h->d GB/s memory GiB intra all-reduce GB/s",
            "  n1                        -         -          -                     -",
            "  n2                        -         -          -                     -  <- below its peers",
        ],
        None,  # text only: --json has no check (as before the sections)
    ),
    (
        "evals",
        {"evals/step-10.json": {"state": "submitted", "job_id": "77"}},
        ["1 eval job: 1 submitted", "  step 10: submitted (job 77)"],
        {
            "evals": [
                {"step": 10, "state": "submitted", "job_id": "77", "exit_code": None, "reason": None, "metrics": {}}
            ]
        },
    ),
    ("hang", _hang, [f"last hang: {HANG}"], {"hang": HANG}),
    (
        "hang-stacks",
        _hang_stacks,
        [
            "stacks the watchdog took after step 7 (hpc-hsdp stacks: the ranks' stacks now):",
            "  rank 0 (1 of 2): wait in distributed/c10d.py:12",
            "      wait (distributed/c10d.py:12)",
            "      train (loop.py:3)",
            "  rank 1 (1 of 2): train in loop.py:3",
            "      train (loop.py:3)",
        ],
        None,
    ),
    (
        "trackers-off",
        {"trackers.json": {"wandb": {"off": "no WANDB_API_KEY\x07"}, "tensorboard": {"dir": "tb"}}},
        ["tracker wandb is off: no WANDB_API_KEY\\x07"],
        {"trackers_off": ["tracker wandb is off: no WANDB_API_KEY\x07"]},
    ),
    (
        "code",
        {"provenance.json": {"code": [{"name": "hpc_hsdp", "checkout": "/src/x", "commit": "0123456789abcdef"}]}},
        ["code: 0123456789 (/src/x: hpc_hsdp)"],
        {"code": "0123456789 (/src/x: hpc_hsdp)", "commit": "0123456789"},
    ),
    (
        "versions",
        {"task_provenance.json": {"torch": "2.13.0", "python": "3.12.1"}},
        ["ran with: torch 2.13.0, Python 3.12.1"],
        {"versions": {"torch": "2.13.0", "python": "3.12.1"}},
    ),
]
BY_NAME = {section.name: section for section in SECTIONS}


def _view(run: Path) -> SimpleNamespace:
    return SimpleNamespace(run_dir=str(run), last_metrics=LAST_METRICS)


@pytest.mark.parametrize(("name", "record", "lines", "fields"), ROWS, ids=[row[0] for row in ROWS])
def test_a_section_says_its_record(tmp_path, name, record, lines, fields):
    if callable(record):
        record(tmp_path)
    else:
        for path, value in record.items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(value if isinstance(value, str) else json.dumps(value))
    section = BY_NAME[name]
    found = section.read(_view(tmp_path))
    assert list(section.lines(found)) == lines
    if section.fields is None:
        assert fields is None
    elif fields is not None:
        assert dict(section.fields(found)) == fields


def test_every_record_section_has_a_row_and_says_nothing_without_its_record(tmp_path):
    assert {row[0] for row in ROWS} == {s.name for s in SECTIONS} - set(JOB_SECTIONS)
    for name, *_ in ROWS:
        section = BY_NAME[name]
        assert list(section.lines(section.read(_view(tmp_path)))) == [], name
    assert not list(tmp_path.iterdir())  # reading wrote nothing


def test_the_sections_have_one_name_each_and_json_order_places_every_dumped_one_once():
    names = [s.name for s in SECTIONS]
    assert len(names) == len(set(names))
    assert sorted(JSON_ORDER) == sorted(s.name for s in SECTIONS if s.fields is not None)


def _local_job(run: Path) -> None:
    run.mkdir()
    (run / "logs").mkdir()
    record = {"job_id": "5", "cluster": "local", "run_dir": str(run), "logs_dir": str(run / "logs")}
    (run / "job.json").write_text(
        json.dumps({**record, "job_name": "x", "ntasks": 2, "launcher": "srun", "submitted_at": 1.0})
    )


def test_status_prints_the_sections_in_order_and_dumps_them_in_json_order(tmp_path):
    """The whole command on a run directory with several records: the text in SECTIONS' order,
    each line escaped; --json's keys in JSON_ORDER's order, the scheduler's last."""
    from click.testing import CliRunner  # noqa: PLC0415

    from hpc_hsdp.cli import cli  # noqa: PLC0415

    run = tmp_path / "run"
    _local_job(run)
    (run / "metrics.jsonl").write_text(_lines({"step": 3, "loss": 2.5, "tokens_per_s": 100.0}))
    (run / "restarts.jsonl").write_text(_lines({"restart": 1, "resumed_from_step": 2, "reason": "hang"}))
    (run / "trackers.json").write_text(json.dumps({"wandb": {"off": "no key\x1b[2J"}}))
    (run / "task_provenance.json").write_text(json.dumps({"python": "3.12.1"}))
    text = CliRunner().invoke(cli, ["status", str(run)])
    assert text.exit_code == 0, text.output
    assert text.output.splitlines() == [
        "job 5 (local): UNKNOWN, restarts 0",
        "last step 3 loss 2.5000 100 tok/s",
        "time: no time limit (local emulator)",
        "restarts: step 2: hang",
        "tracker wandb is off: no key\\x1b[2J",
        "ran with: Python 3.12.1",
        f"run directory: {run}",
    ]
    dump = CliRunner().invoke(cli, ["status", "--json", str(run)])
    assert dump.exit_code == 0, dump.output
    keys = list(json.loads(dump.output))
    assert keys == [
        *("job_id", "cluster", "state", "exit_code", "restarts", "reason", "run_dir", "last_step", "total_steps"),
        *("progress", "stragglers", "restart_causes", "membership", "hang", "trackers_off", "compile", "failure"),
        *("code", "commit", "versions", "evals", "staging", "hang_stacks", "checkpoint_store"),
        *("controller_answered", "accounting_answered", "scheduler_note", "last_known_state", "last_known_age_s"),
    ]
