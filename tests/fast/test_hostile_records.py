"""Records read from a run directory that others can write, and what the tools do with them
(SECURITY.md): a job.json naming another run's job is neither cancelled nor signalled; every
record and model config is bounded and range-checked before any work proportional to it, its
errors one line; what a terminal shows of a record is escaped; another user's staging directory
is never used. Pure, or the CLI in this process: no job runs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from hpc_hsdp.cli import main
from hpc_hsdp.errors import SpecError
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.scheduler.backends.local import LocalBackend
from hpc_hsdp.scheduler.emulator.state_files import state_path
from hpc_hsdp.submit_host import handle as handle_module
from hpc_hsdp.submit_host.handle import JobHandle


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def one_error_line(code: int, err: str, *words: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpc-hsdp: error: "), err
    assert "Traceback" not in err
    for word in words:
        assert word in lines[0], (word, err)


def _job_json(run: Path, **fields) -> None:
    run.mkdir(parents=True, exist_ok=True)
    record = {
        "job_id": "12345",
        "cluster": "local",
        "run_dir": str(run),
        "logs_dir": "logs",
        "job_name": "x",
        "ntasks": 1,
        "launcher": "srun",
        "submitted_at": 1.0,
        **fields,
    }
    (run / "job.json").write_text(json.dumps(record))


def _victim(tmp_path: Path, **state) -> Path:
    """Another run of the user's, running on the emulator (its supervisor: this very process)."""
    victim = tmp_path / "victim"
    (victim / "logs").mkdir(parents=True)
    _job_json(victim)
    state_path(victim / "logs", "12345").write_text(
        json.dumps(
            {
                "job_id": "12345",
                "state": "RUNNING",
                "exit_code": None,
                "supervisor_pid": os.getpid(),
                "logs_dir": str(victim / "logs"),
                **state,
            }
        )
    )
    return victim


class _Spy(LocalBackend):
    def __init__(self) -> None:
        super().__init__(alive=lambda pid: True)
        self.cancelled: list[str] = []

    def cancel(self, record):
        self.cancelled.append(record.job_id)


def test_a_job_json_with_an_absolute_logs_dir_outside_its_run_is_one_line(tmp_path, capsys):
    victim = _victim(tmp_path)
    forged = tmp_path / "forged"
    _job_json(forged, logs_dir=str(victim / "logs"))
    for command in ("cancel", "status"):
        code, _, err = run_main([command, str(forged)], capsys)
        one_error_line(code, err, "logs_dir", "leaves the run directory")
    assert json.loads(state_path(victim / "logs", "12345").read_text())["state"] == "RUNNING"


def test_a_logs_symlink_to_another_runs_logs_is_not_where_the_job_runs(tmp_path, capsys, monkeypatch):
    victim = _victim(tmp_path)
    forged = tmp_path / "forged"
    _job_json(forged)
    (forged / "logs").symlink_to(victim / "logs")
    spy = _Spy()
    monkeypatch.setattr(handle_module, "backend", lambda name: spy)
    with pytest.raises(SpecError, match=f"is not where job 12345 runs: the scheduler says it writes {victim} "):
        JobHandle(JobRecord.load(str(forged))).cancel()
    assert spy.cancelled == []
    JobHandle(JobRecord.load(str(victim))).cancel()  # the run itself is cancelled as before
    assert spy.cancelled == ["12345"]


def test_cancel_of_a_run_whose_job_json_names_another_runs_job_signals_nothing(tmp_path, capsys):
    victim = _victim(tmp_path)
    forged = tmp_path / "forged"
    _job_json(forged)
    (forged / "logs").symlink_to(victim / "logs")
    code, _, err = run_main(["cancel", str(forged)], capsys)
    one_error_line(code, err, f"the scheduler says it writes {victim}", "nothing cancelled")


def test_cancel_refuses_a_job_whose_scheduler_does_not_say_where_it_writes(tmp_path, monkeypatch):
    victim = _victim(tmp_path, logs_dir=None)
    spy = _Spy()
    monkeypatch.setattr(handle_module, "backend", lambda name: spy)
    with pytest.raises(SpecError, match="does not say where job 12345 .* writes"):
        JobHandle(JobRecord.load(str(victim))).cancel()
    assert spy.cancelled == []


@pytest.mark.parametrize("state", ["", " ", "running", "\x1b[31mRUNNING", 7, None, "PENDING" * 40])
def test_an_emulator_state_file_of_no_state_is_unknown_in_status_status_sweep_and_runs(tmp_path, capsys, state):
    from hpc_hsdp.rundir.lifecycle.sweep_record import SweepPoint, SweepRecord

    sweep = tmp_path / "runs" / "sw"
    sweep.mkdir(parents=True)
    SweepRecord(
        sweep_dir=str(sweep),
        job_ids=("12345",),
        cluster="local",
        mode="grid",
        parallelism=None,
        sweep=("seed=0",),
        points=(SweepPoint(index=0, name="seed=0", values=(("seed", "0"),), job_id="12345_0"),),
    ).save()
    run = sweep / "seed=0"
    _job_json(run, job_id="12345_0")
    (run / "logs").mkdir()
    state_path(run / "logs", "12345_0").write_text(json.dumps({"job_id": "12345_0", "state": state}))
    for argv in (["status", str(run)], ["status", str(sweep)], ["runs", str(tmp_path / "runs")]):
        code, out, err = run_main(argv, capsys)
        assert code == 0 and "Traceback" not in err, (argv, err)
        assert "UNKNOWN" in out and "\x1b" not in out, (argv, out)


@pytest.mark.parametrize("state", ["", " ", "\x1b]0;title\x07"])
def test_a_last_known_state_of_no_state_is_no_record(tmp_path, state):
    from hpc_hsdp.rundir.lifecycle.job_state import load_job_state

    (tmp_path / "job_state.json").write_text(json.dumps({"job_id": "1", "state": state, "at": 1.0}))
    assert load_job_state(tmp_path, "1") is None


def _axes(n: int, count: int) -> list[str]:
    return [
        f"{key}={','.join(str(v + 1) for v in range(n))}"
        for key in ("seed", "steps", "layers", "heads", "width")[:count]
    ]


def test_a_sweep_is_counted_before_it_is_expanded():
    from hpc_hsdp.job.sweep import MAX_POINTS, count_points, expand, parse_axes

    assert count_points(parse_axes(_axes(10, 4))) == 10_000 == MAX_POINTS
    with pytest.raises(SpecError, match=r"the sweep has 14641 points \(11 x 11 x 11 x 11 values\), more than 10000"):
        expand(parse_axes(_axes(11, 4)))
    with pytest.raises(SpecError, match="the sweep has 9765625 points"):  # 25^5: refused at once, nothing made
        expand(parse_axes(_axes(25, 5)))
    assert count_points(parse_axes(_axes(25, 5)), "zip") == 25


def test_submit_of_a_sweep_of_millions_of_points_is_one_line(tmp_path, capsys):
    argv = [
        "submit",
        "--dry-run",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--shard",
        "1",
        "--run-dir",
        str(tmp_path / "sw"),
    ]
    for axis in _axes(25, 5):
        argv += ["--sweep", axis]
    code, _, err = run_main(argv, capsys)
    one_error_line(code, err, "9765625 points")


DEEP = "[" * 200_000 + "]" * 200_000


@pytest.mark.parametrize(
    "body", [DEEP, '{"tokenizer": ' + DEEP + "}", '{"num_tokens": 1e999}'], ids=["deep", "deep-field", "1e999"]
)
def test_a_token_sidecar_nested_past_the_stack_or_out_of_range_is_one_line(tmp_path, capsys, body):
    import numpy as np

    from hpc_hsdp.data.tokens import DataError, open_dataset, write_token_file

    path = tmp_path / "train.bin"
    write_token_file(path, np.arange(64) % 50, vocab_size=64, eos_id=49)
    path.with_suffix(".json").write_text(body)
    with pytest.raises(DataError) as caught:
        open_dataset(path)
    assert "\n" not in str(caught.value) and "train.json" in str(caught.value)


def test_a_jsonl_line_nested_past_the_stack_and_a_datasets_state_are_one_line(tmp_path):
    from hpc_hsdp.data.inputs import _datasets_files, jsonl_text
    from hpc_hsdp.data.tokens import DataError

    with pytest.raises(DataError, match="in.jsonl line 3 is nested too deeply"):
        jsonl_text(DEEP.encode(), "text", "in.jsonl", 3)
    (tmp_path / "state.json").write_text(DEEP)
    with pytest.raises(DataError, match="has no readable state.json"):
        _datasets_files(tmp_path, "ds")


LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": None,
    "vocab_size": 96,
}


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("num_attention_heads", 0, "num_attention_heads is 0, outside 1-4096"),
        ("hidden_size", "64", "hidden_size is '64', not an integer"),
        ("vocab_size", 1e300, "vocab_size is '1e+300', not an integer"),
        ("num_hidden_layers", 100_000_000, "num_hidden_layers is 100000000, outside 1-1024"),
        ("num_hidden_layers", 1 << 62, "num_hidden_layers is out of range, outside 1-1024"),
        ("intermediate_size", True, "intermediate_size is 'True', not an integer"),
        ("num_hidden_layers", 1e999, "number 1e999 out of range"),
        ("num_key_value_heads", -2, "num_key_value_heads is -2"),
    ],
)
def test_an_hf_config_of_sizes_out_of_range_is_one_line_before_any_work(tmp_path, capsys, field, value, said):
    model = tmp_path / "model"
    model.mkdir()
    text = json.dumps({**LLAMA, field: value}).replace("Infinity", "1e999")
    (model / "config.json").write_text(text)
    code, _, err = run_main(
        ["plan", "--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--model", f"hf:{model}"], capsys
    )
    one_error_line(code, err, "config.json", said)
    from hpc_hsdp.models.hf import load_config

    with pytest.raises(
        SpecError, match=re.escape(said)
    ):  # the task reads it through the same check before transformers does
        load_config(model / "config.json", model=f"hf:{model}")


def test_an_hf_config_nested_past_the_stack_is_one_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "rope_scaling": ' + DEEP + "}")
    code, _, err = run_main(
        ["plan", "--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--model", f"hf:{model}"], capsys
    )
    one_error_line(code, err, "nested too deeply")


def test_an_hf_config_of_sane_sizes_still_plans(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    code, out, err = run_main(
        ["plan", "--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--model", f"hf:{model}"], capsys
    )
    assert code in (0, None), err


@pytest.mark.parametrize(
    ("header", "said"),
    [
        ((1 << 62).to_bytes(8, "little"), "a header of 4611686018427387904 bytes"),
        (len(DEEP).to_bytes(8, "little") + DEEP.encode(), "nested too deeply"),
        ((4).to_bytes(8, "little") + b"[1] ", "no safetensors header"),
    ],
    ids=["huge", "deep", "list"],
)
def test_a_safetensors_header_is_sized_and_read_as_hostile_json(tmp_path, header, said):
    from hpc_hsdp.models.weights import SafetensorsFile

    path = tmp_path / "model.safetensors"
    path.write_bytes(header)
    with pytest.raises(SpecError, match=said):
        SafetensorsFile(path)


def test_a_safetensors_index_naming_files_outside_its_directory_is_one_line(tmp_path):
    from hpc_hsdp.models.weights import safetensors_files

    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../secret"}}))
    with pytest.raises(SpecError, match="names a file outside its directory"):
        safetensors_files(tmp_path)


def _check_json(run: Path, mode: int = 0o644, **fields) -> Path:
    record = {"job_id": "77", "time": 1.0, "seconds": 2.0, "threshold": 0.9, "nodes": {}, "links": {}, **fields}
    path = run / "check.json"
    path.write_text(json.dumps(record))
    path.chmod(mode)
    return path


def _verdict(tmp_path, monkeypatch, capsys) -> tuple[int, str, str]:
    from hpc_hsdp.batch_shell import fabric_check_verdict as check_verdict

    monkeypatch.setenv("SLURM_JOB_NODELIST", "n[1-3]")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    code = check_verdict.main([str(tmp_path), "2"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("bad", [5, "n1", {"n1": 1}, [1, 2], None], ids=["int", "text", "object", "ints", "null"])
def test_the_batch_step_trains_on_the_jobs_nodes_when_check_json_holds_other_types(tmp_path, monkeypatch, capsys, bad):
    _check_json(tmp_path, bad_nodes=bad)
    code, out, err = _verdict(tmp_path, monkeypatch, capsys)
    assert (code, out) == (0, "n[1-2]\n") and "no readable" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("mode", "job_id", "said"),
    [
        (0o666, "77", "writable by others: not the check's"),
        (0o664, "77", "writable by others: not the check's"),
        (0o644, "76", "was not written by the check of job 77"),
        (0o644, None, "no readable"),
    ],
)
def test_a_forged_verdict_is_not_the_checks(tmp_path, monkeypatch, capsys, mode, job_id, said):
    _check_json(tmp_path, mode, bad_nodes=["n1"], job_id=job_id)
    code, out, err = _verdict(tmp_path, monkeypatch, capsys)
    assert (code, out) == (0, "n[1-2]\n") and said in err
    _check_json(tmp_path, bad_nodes=["n1"])  # the check's own: n1 left out, spare n3 in its place
    code, out, err = _verdict(tmp_path, monkeypatch, capsys)
    assert (code, out) == (0, "n[2-3]\n"), err


def test_check_prints_its_own_result_escaped_and_says_where_it_read_it(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from hpc_hsdp.cli import jobs_cmd
    from hpc_hsdp.submit_host import submission

    run = tmp_path / "run"
    run.mkdir()
    handle = SimpleNamespace(job_id="77", record=SimpleNamespace(cluster="local"))
    monkeypatch.setattr(submission, "submit_spec", lambda spec, **kwargs: (handle, None, ""))
    monkeypatch.setattr(jobs_cmd, "follow", lambda handle, total_steps: 0)
    argv = ["check", "--nodes", "2", "--gpus-per-node", "1", "--run-dir", str(run)]
    _check_json(run, nodes={"\x1b]0;owned\x07n1": {"matmul_tflops": 1.0}}, transport_warning="\x1b[2J")
    code, out, err = run_main(argv, capsys)
    assert code == 0, err
    assert f"check job 77 found ({run / 'check.json'}):" in out
    assert "\x1b" not in out and "\\x1b]0;owned\\x07n1" in out and "warning: \\x1b[2J" in out

    _check_json(run, job_id="76", bad_nodes=[])  # written by someone else: not shown as the check's
    code, out, err = run_main(argv, capsys)
    assert code == 1 and "below its peers" not in out
    assert (
        f"check job 77 left no result of its own ({run / 'check.json'} was not written by the check of job 77)" in err
    )


def test_every_error_line_is_printed_with_its_control_characters_escaped(capsys):
    from hpc_hsdp.cli import fail

    with pytest.raises(SystemExit):
        fail("a run named \x1b]0;title\x07 and \x9b2J and \u202e")
    err = capsys.readouterr().err
    assert err == "hpc-hsdp: error: a run named \\x1b]0;title\\x07 and \\x9b2J and \\u202e\n"


@pytest.mark.parametrize(
    ("points", "said"),
    [
        ([{"index": 0, "name": "seed=0\x1b[2J", "values": []}], "is not a directory name submit writes"),
        ([{"index": 10**12, "name": "seed=0", "values": []}], "point index"),
        ([{"index": i, "name": f"p{i}", "values": []} for i in range(10_001)], "10001 points, more than 10000"),
    ],
    ids=["escape", "index", "count"],
)
def test_a_sweep_record_of_hostile_points_is_one_line(tmp_path, capsys, points, said):
    record = {"job_id": "5", "cluster": "local", "mode": "grid", "points": points}
    (tmp_path / "sweep.json").write_text(json.dumps(record))
    for command in ("status", "cancel"):
        code, _, err = run_main([command, str(tmp_path)], capsys)
        one_error_line(code, err, said)
        assert "\x1b" not in err
