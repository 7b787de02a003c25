"""The NCCL flight recorder on a hang, without a GPU: the parser on a recorded sample of
torch 2.13's dump format (tests/data/nccl-trace, a 2 x 2 job whose rank 3 never entered
step 7), the variants a real hang produces (a rank without a dump, every collective done, a
torn or hostile file), the watchdog's verdict and ``status``, and the variables every NCCL
task gets (the recorder's size, torch's own dump on a timeout into the run directory)."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from cli_helpers import hpc

from hpc_hsdp.rundir.observation.flight_recorder import find_hang, hang_words, load_dump, read_dumps, trace_files

SAMPLE = Path(__file__).parents[1] / "data" / "nccl-trace"


def _dumps() -> dict[int, dict]:
    return {rank: load_dump((SAMPLE / f"nccl-trace-rank{rank}.pkl").read_bytes()) for rank in range(4)}


def _planted(run_dir: Path, ranks=(0, 1, 2, 3)) -> Path:
    (run_dir / "hang").mkdir(parents=True)
    for rank in ranks:
        shutil.copy(SAMPLE / f"nccl-trace-rank{rank}.pkl", run_dir / "hang")
    return run_dir


def test_the_sample_names_the_collective_its_axis_and_the_rank_that_never_entered():
    found = find_hang(_dumps())
    assert (found.op, found.axis, found.seq, found.members) == ("_allgather_base", "shard", 31, [2, 3])
    assert (found.waiting, found.missing, found.last_entered, found.no_dump) == ([2], [3], {3: 30}, [])
    assert found.words() == (
        "NCCL _allgather_base #31 on mesh axis shard (ranks 2,3): rank 2 waiting in it; "
        "rank 3 never entered it (last entered 3: #30)"
    )


def test_a_rank_without_a_dump_is_named_in_the_group_it_left_waiting():
    dumps = _dumps()
    del dumps[3]  # its node died with it
    found = find_hang(dumps)
    assert (found.axis, found.seq, found.waiting, found.missing, found.no_dump) == ("shard", 31, [2], [], [3])
    assert found.words().endswith("rank 2 waiting in it; no trace from rank 3")


def test_groups_of_the_same_name_are_told_apart_by_their_ranks():
    dumps = {r: d for r, d in _dumps().items() if r in (0, 1)}  # every replicate group is named "2"
    found = find_hang(dumps)
    assert found.axis == "replicate" and found.op == "all_reduce" and found.seq == 7
    assert (found.members, found.waiting, found.no_dump) in (([0, 2], [0], [2]), ([1, 3], [1], [3]))


def test_nothing_hung_when_every_last_collective_completed(tmp_path):
    dumps = _dumps()
    for dump in dumps.values():  # steps 1-6 only: 7 collectives each
        dump["entries"] = [e for e in dump["entries"] if e["record_id"] < 42]
    assert find_hang(dumps) is None
    assert hang_words(tmp_path) is None  # no dumps at all


def test_entries_without_a_sequence_number_are_no_answer_never_a_traceback():
    dumps = _dumps()
    for entry in dumps[2]["entries"]:  # a dump of another format: every collective of rank 2 unnumbered
        del entry["collective_seq_id"]
    found = find_hang(dumps)
    assert (found.axis, found.seq, found.waiting, found.missing) == ("replicate", 7, [0], [2])
    assert found.last_entered == {2: None}


def test_a_torn_or_hostile_dump_is_refused_without_running_it(tmp_path):
    class Evil:
        def __reduce__(self):
            return (Path.touch, (tmp_path / "pwned",))

    run = _planted(tmp_path / "run", ranks=(0, 1, 2))
    (run / "hang" / "nccl-trace-rank3").write_bytes(pickle.dumps(Evil()))  # torch's timeout-dump name
    (run / "hang" / "nccl-trace-rank9.pkl").write_bytes(b"\x80\x04torn")
    assert sorted(trace_files(run)) == [0, 1, 2, 3, 9]
    dumps, notes = read_dumps(run)
    assert sorted(dumps) == [0, 1, 2] and len(notes) == 2 and not (tmp_path / "pwned").exists()
    assert any("plain data only" in n for n in notes), notes
    with pytest.raises(ValueError, match="not a flight recorder dump"):
        load_dump(b"not a pickle")
    assert "no trace from rank 3" in hang_words(run)


def test_the_watchdog_verdict_and_status_carry_the_finding(tmp_path):
    from hpc_hsdp.task.resilience.watchdog import Watchdog

    run = _planted(tmp_path / "run")
    watchdog = Watchdog.__new__(Watchdog)
    watchdog.ctx = SimpleNamespace(run_dir=run)
    assert watchdog._flight_recorder_finding() == hang_words(run)
    watchdog.ctx = SimpleNamespace(run_dir=tmp_path / "gloo-run")  # gloo: no dumps, the verdict stays as it was
    assert watchdog._flight_recorder_finding() is None

    logs = run / "logs"
    logs.mkdir()
    (logs / "5_local.json").write_text(json.dumps({"state": "FAILED", "exit_code": 86}))
    record = {"job_id": "5", "cluster": "local", "run_dir": str(run), "logs_dir": str(logs), "job_name": "x"}
    (run / "job.json").write_text(json.dumps({**record, "ntasks": 4, "launcher": "srun", "submitted_at": 0.0}))
    out = hpc("status", str(run))
    assert out.returncode == 0, out.stderr
    assert "last hang: NCCL _allgather_base #31 on mesh axis shard (ranks 2,3)" in out.stdout, out.stdout
    out = hpc("status", "--json", str(run))
    assert "rank 3 never entered it" in json.loads(out.stdout)["hang"]


def test_every_nccl_task_records_and_dumps_on_a_timeout_into_the_run_directory(tmp_path):
    from hpc_hsdp.task.parallelism.dist import flight_recorder_env

    got = flight_recorder_env({}, tmp_path)
    assert got["TORCH_FR_BUFFER_SIZE"] == "2000" and got["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert got["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path.absolute() / "hang" / "nccl-trace-rank")
    assert got["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == got["TORCH_FR_DUMP_TEMP_FILE"]
    mine = flight_recorder_env({"TORCH_FR_DUMP_TEMP_FILE": "/scratch/fr"}, tmp_path)
    assert "TORCH_FR_DUMP_TEMP_FILE" not in mine and mine["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert flight_recorder_env({"TORCH_FR_BUFFER_SIZE": "0"}, tmp_path) == {}  # the job turned it off
