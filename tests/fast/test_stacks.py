"""``hpc-hsdp stacks`` and the watchdog's grouped stacks: the pure grouping and wording of
:mod:`hpc_hsdp.rundir.observation.stacks`, the parsers of py-spy's and faulthandler's output, the node
collector's argv and answer, and the SLURM step it runs in (a canned runner)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hpc_hsdp.errors import SchedulerError
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.rundir.observation.stacks import (
    group_stacks,
    headline,
    read_hang_stacks,
    short_function,
    short_path,
    stack_lines,
    summary,
    threads_from_faulthandler,
    threads_from_py_spy,
    write_hang_stacks,
)
from hpc_hsdp.scheduler.backends.slurm import SlurmBackend
from hpc_hsdp.submit_host import live_stacks

SITE = "/venv/lib/python3.11/site-packages/"
WAIT = [
    {"function": "pthread_cond_wait", "file": "libc.so.6", "line": None, "native": True},
    {"function": "0x7f3e3484524a", "file": "libc.so.6", "line": None, "native": True},
    {"function": "wrapper", "file": "/src/hpc_hsdp/task/observation/collectives.py", "line": 150, "native": False},
    {
        "function": "all_gather_into_tensor",
        "file": SITE + "torch/distributed/distributed_c10d.py",
        "line": 3850,
        "native": False,
    },
    {"function": "train", "file": "/src/hpc_hsdp/task/training/loop.py", "line": 106, "native": False},
    {"function": "<module>", "file": "/src/hpc_hsdp/task/submitit_job.py", "line": 38, "native": False},
]
SLEEP = [
    {"function": "sleep", "file": "/usr/lib/python3.11/time.py", "line": None, "native": False},
    {"function": "at_step", "file": "/src/hpc_hsdp/task/resilience/injected_faults.py", "line": 190, "native": False},
    {"function": "<module>", "file": "/src/hpc_hsdp/task/submitit_job.py", "line": 38, "native": False},
]


def rank(number: int, frames, *, other_line: int | None = None, address: str | None = None) -> dict:
    frames = [dict(f) for f in frames]
    if other_line is not None:  # the same call, another line of the loop
        frames[-2]["line"] = other_line
    if address is not None:
        frames[1]["function"] = address
    watchdog = {"name": "watchdog", "main": False, "frames": [dict(SLEEP[0])]}
    return {
        "rank": number,
        "node": f"n{number // 8}",
        "pid": 100 + number,
        "how": "py-spy --native",
        "threads": [watchdog, {"name": "MainThread", "main": True, "frames": frames}],
        "error": None,
    }


@pytest.mark.parametrize(
    ("stacks", "world", "expected"),
    [
        pytest.param(
            [rank(r, SLEEP if r == 1 else WAIT) for r in range(16)],
            16,
            [([1], "sleep in"), ([0, *range(2, 16)], "all_gather_into_tensor")],
            id="one-frozen-rank-first",
        ),
        pytest.param(
            [rank(r, WAIT, other_line=200 + r, address=hex(0x7F0000 + r)) for r in range(4)],
            4,
            [([0, 1, 2, 3], "all_gather_into_tensor")],
            id="lines-and-addresses-aside",
        ),
        pytest.param(
            [rank(0, WAIT), rank(2, WAIT), {"rank": 3, "error": "process 103 has ended", "threads": []}],
            4,
            [([1], "no answer"), ([3], "process 103 has ended"), ([0, 2], "all_gather_into_tensor")],
            id="errors-and-silent-ranks",
        ),
        pytest.param(
            [rank(r, WAIT if r < 2 else SLEEP) for r in (3, 0, 2, 1, 0)],
            None,
            [([2, 3], "sleep in"), ([0, 1], "all_gather_into_tensor")],
            id="ties-outside-collectives-first-duplicates-once",
        ),
        pytest.param(
            [rank(0, WAIT), rank(1, SLEEP), rank(2, WAIT[2:]), rank(3, WAIT[2:])],
            4,
            [([1], "sleep in"), ([0], "all_gather_into_tensor"), ([2, 3], "all_gather_into_tensor")],
            id="two-odd-ones-the-one-outside-collectives-first",
        ),
    ],
)
def test_group_stacks(stacks, world, expected):
    groups = group_stacks(stacks, world)
    got = [(g["ranks"], g.get("headline") or g.get("error")) for g in groups]
    assert [ranks for ranks, _ in got] == [ranks for ranks, _ in expected]
    for (_, words), (_, wanted) in zip(got, expected):
        assert wanted in words


@pytest.mark.parametrize(
    ("frames", "expected"),
    [
        (WAIT, "pthread_cond_wait [native] < all_gather_into_tensor in torch/distributed/distributed_c10d.py:3850"),
        (SLEEP, "sleep in python3.11/time.py"),
        (WAIT[:2], "pthread_cond_wait [native]"),
        ([], "no Python frames"),
    ],
)
def test_headline_names_the_call_a_wrapper_passes_on(frames, expected):
    assert headline(frames) == expected


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("std::condition_variable::wait", "std::condition_variable::wait"),
        ("f<std::vector<int>>(int, char)::{lambda(c10d::Work*)#1}::_FUN", "f<...>(...)::{lambda(...)#1}::_FUN"),
        ("x" * 150, "x" * 97 + "..."),
    ],
)
def test_short_function_folds_templates_and_parameters(name, expected):
    assert short_function(name) == expected


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (SITE + "torch/distributed/c10d.py", "torch/distributed/c10d.py"),
        ("/home/u/code/hpc_hsdp/task/training/loop.py", "hpc_hsdp/task/training/loop.py"),
        ("/home/u/train.py", "u/train.py"),
        ("<string>", "<string>"),
    ],
)
def test_short_path(path, expected):
    assert short_path(path) == expected


def test_stack_lines_odd_ones_out_first_with_their_frames():
    groups = group_stacks([rank(r, SLEEP if r == 1 else WAIT) for r in range(16)], 16)
    lines = stack_lines(groups, 16, frames_shown=2)
    assert lines[0] == "rank 1 (1 of 16): sleep in python3.11/time.py"
    assert lines[1:4] == [
        "    sleep (python3.11/time.py)",
        "    at_step (hpc_hsdp/task/resilience/injected_faults.py:190)",
        "    ... 1 outer frames",
    ]
    assert lines[4].startswith("ranks 0,2-15 (15 of 16): pthread_cond_wait [native] < all_gather_into_tensor in ")
    assert lines[5] == "    pthread_cond_wait (libc.so.6) [native]"
    assert summary(groups).startswith("rank 1: sleep in python3.11/time.py; ranks 0,2-15: ")


def test_py_spy_json_threads_main_by_os_thread_id():
    data = [
        {
            "thread_name": "watchdog",
            "os_thread_id": 9,
            "frames": [{"name": "wait", "filename": "/x/threading.py", "module": None, "line": 3}],
        },
        {
            "thread_name": "MainThread",
            "os_thread_id": 7,
            "frames": [
                {
                    "name": "clock_nanosleep",
                    "filename": "/lib/libc.so.6",
                    "short_filename": "libc.so.6",
                    "module": "/lib/libc.so.6",
                    "line": 0,
                },
                {"name": "<module>", "filename": "<string>", "module": None, "line": 1},
            ],
        },
    ]
    threads = threads_from_py_spy(data, pid=7)
    assert [t["main"] for t in threads] == [False, True]
    assert threads[1]["frames"] == [
        {"function": "clock_nanosleep", "file": "libc.so.6", "line": None, "native": True},
        {"function": "<module>", "file": "<string>", "line": 1, "native": False},
    ]
    with pytest.raises(ValueError):
        threads_from_py_spy({"not": "a list"})


FAULTHANDLER_LOG = """\
[hpc-hsdp] step 3 loss 4.1
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

[hpc-hsdp] a line of the job between the dumps
Current thread 0x00007f0000000001 (most recent call first):
  File "/src/hpc_hsdp/task/resilience/injected_faults.py", line 190 in at_step
  File "/src/hpc_hsdp/task/submitit_job.py", line ??? in <module>
"""


def test_faulthandler_dump_in_a_log_its_main_thread_the_module_body():
    threads = threads_from_faulthandler(FAULTHANDLER_LOG)
    assert [t["main"] for t in threads] == [False, True]
    assert threads[1]["frames"] == [
        {
            "function": "at_step",
            "file": "/src/hpc_hsdp/task/resilience/injected_faults.py",
            "line": 190,
            "native": False,
        },
        {"function": "<module>", "file": "/src/hpc_hsdp/task/submitit_job.py", "line": None, "native": False},
    ]
    assert threads_from_faulthandler("no dump here\n") == []


def test_hang_stacks_file_written_and_read_regrouped(tmp_path):
    stacks = [rank(r, SLEEP if r == 2 else WAIT) for r in range(4)]
    write_hang_stacks(tmp_path, stacks, world_size=4, step=7)
    found = read_hang_stacks(tmp_path)
    assert found["step"] == 7 and [g["ranks"] for g in found["groups"]] == [[2], [0, 1, 3]]
    (tmp_path / "hang" / "stacks.json").write_text(json.dumps({"stacks": [{"rank": "0; rm -rf /"}]}))
    assert read_hang_stacks(tmp_path)["groups"] == []  # a damaged entry is left out, never trusted
    (tmp_path / "hang" / "stacks.json").write_text("{")
    assert read_hang_stacks(tmp_path) is None
    assert read_hang_stacks(tmp_path / "none") is None


def test_node_output_lines_among_other_output():
    first = live_stacks.answer_lines({"node": "n1", "stacks": [rank(0, WAIT)]})
    second = live_stacks.answer_lines({"node": "n2", "stacks": [rank(8, SLEEP), {"rank": "x"}]})
    out = "srun: warning\n" + "\n".join(first) + "\n" + "\n".join("0: " + line for line in second) + "\n"
    out += live_stacks.MARKER + "{broken\n"
    assert [s["rank"] for s in live_stacks.parse_node_output(out)] == [0, 8]


def test_node_answers_longer_than_a_line_come_back_whole_when_srun_interleaves_their_pieces():
    """On the dev cluster srun split two nodes' one-line answers (tens of KiB of faulthandler
    frames) and interleaved the pieces: neither parsed, and `stacks --python-only` said no node
    answered. Each answer now travels as numbered lines of its own."""
    big = [rank(r, WAIT) for r in range(40)]
    first = live_stacks.answer_lines({"node": "n1", "stacks": big[:20]})
    second = live_stacks.answer_lines({"node": "n2", "stacks": big[20:]})
    assert len(first) > 2 and all(len(line) < live_stacks.LINE_CHUNK + 64 for line in first)
    mixed = [line for pair in zip(reversed(first), second) for line in pair]
    mixed += first[: len(first) - len(second)] if len(first) > len(second) else second[len(first) :]
    assert sorted(s["rank"] for s in live_stacks.parse_node_output("\n".join(mixed))) == list(range(40))
    assert live_stacks.parse_node_output("\n".join(first[1:])) == []  # a piece missing: left out, not guessed


def test_node_argv_and_targets_from_layout(tmp_path):
    (tmp_path / "layout.json").write_text(
        json.dumps(
            {
                "ranks": [
                    {"rank": 1, "node": "n1", "slurm_procid": 1, "local_rank": 1, "pid": 42},
                    {"rank": 0, "node": "n1", "slurm_procid": 0, "local_rank": 0, "pid": True},
                ]
            }
        )
    )
    targets = live_stacks.stack_targets(tmp_path)
    assert targets == [{"rank": 1, "node": "n1", "pid": 42}]  # a pid that is not a number is no target
    argv = live_stacks.node_argv("77", targets, native=True, this_node_only=True, py_spy=False)
    assert argv[:3] == [sys.executable, "-m", "hpc_hsdp.submit_host.live_stacks"]
    assert argv[3:] == ["--job", "77", "--targets", json.dumps(targets), "--native", "--no-py-spy", "--this-node-only"]


def test_a_process_of_another_job_or_gone_is_not_traced():
    assert live_stacks.check_process(os.getpid(), "no-such-job-id").endswith("(its process id was reused)")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert "has ended" in live_stacks.check_process(gone.pid, "1")
    stack = live_stacks.rank_stack({"rank": 0, "node": "n", "pid": gone.pid}, "1", native=True, py_spy=None)
    assert stack["threads"] == [] and "has ended" in stack["error"]


class Canned:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict]] = []

    def __call__(self, argv, **kwargs):
        self.calls.append((list(argv), kwargs))
        return subprocess.CompletedProcess(argv, 0, "\n".join(live_stacks.answer_lines({"stacks": []})) + "\n", "")


def record() -> JobRecord:
    return JobRecord(
        job_id="123",
        cluster="slurm",
        run_dir="/r",
        logs_dir="/r/logs",
        job_name="t",
        ntasks=16,
        launcher="srun",
        submitted_at=0.0,
    )


def test_slurm_runs_on_the_nodes_in_an_overlapping_step_of_the_job():
    runner = Canned()
    out, _ = SlurmBackend(runner=runner).run_on_nodes(record(), ["n1", "n2"], ["python", "-m", "x"], timeout_s=30)
    argv, kwargs = runner.calls[0]
    assert argv == [
        "srun",
        "--overlap",
        "--jobid=123",
        "--nodelist=n1,n2",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=0",
        "--quiet",
        "python",
        "-m",
        "x",
    ]
    assert kwargs == {"timeout_s": 30} and live_stacks.MARKER in out
    with pytest.raises(SchedulerError, match="not a node name"):
        SlurmBackend(runner=runner).run_on_nodes(record(), ["n1 --uid=0"], ["x"], timeout_s=30)
    interactive = SlurmBackend(runner=runner).on_node_command(record(), "n2", ["python", "-m", "y"])
    assert interactive[:4] == ["srun", "--overlap", "--jobid=123", "--nodelist=n2"] and "--unbuffered" in interactive
