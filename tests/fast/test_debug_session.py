"""``hpc-hsdp debug``'s parts without a job: the request in the run directory (taken once, only
this user's), the stop code that carries it, one pdb session over a socket, and the socket check
of the node side."""

from __future__ import annotations

import json
import os
import socket
import threading

import pytest

from hpc_hsdp.rundir.observation.debug_session import (
    read_session,
    request_path,
    socket_dir_name,
    take_request,
    write_request,
    write_session,
)
from hpc_hsdp.submit_host.debug_attach import check_socket
from hpc_hsdp.task.observation.debugger import CONTINUE, QUIT, run_pdb
from hpc_hsdp.task.resilience.preemption import TERMINATE, WARNING, Preemption, join_stop_code, split_stop_code


@pytest.mark.parametrize(
    ("signal_code", "debug_code"), [(0, 0), (WARNING, 0), (TERMINATE, 0), (0, 1), (WARNING, 8), (TERMINATE, 512)]
)
def test_stop_code_carries_the_signals_and_the_debugged_rank(signal_code, debug_code):
    code = join_stop_code(signal_code, debug_code)
    assert split_stop_code(code) == (signal_code, debug_code)
    assert split_stop_code(float(code)) == (signal_code, debug_code)  # as the fused all_reduce returns it
    preemption = Preemption({})
    assert preemption.agree(code, 5) is (signal_code != 0)
    assert preemption.agreed_debug == debug_code


def test_a_request_is_taken_once(tmp_path):
    request_id = write_request(tmp_path, rank=3, at_step=7)
    assert take_request(tmp_path, world_size=4) == {"id": request_id, "rank": 3, "at_step": 7}
    assert take_request(tmp_path, world_size=4) is None and not request_path(tmp_path).exists()


@pytest.mark.parametrize(
    "record",
    [
        {"id": "x", "rank": 4, "at_step": None},  # not a rank of the job
        {"id": "x", "rank": -1, "at_step": None},
        {"id": "x", "rank": True, "at_step": None},
        {"id": "x", "rank": 0, "at_step": "5; rm -rf /"},
        {"rank": 0, "at_step": None},
        ["not", "an", "object"],
    ],
)
def test_a_request_that_is_not_one_is_dropped(tmp_path, record):
    request_path(tmp_path).parent.mkdir()
    request_path(tmp_path).write_text(json.dumps(record))
    assert take_request(tmp_path, world_size=4) is None


def test_a_request_through_a_symlink_is_not_read(tmp_path):
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"id": "x", "rank": 0, "at_step": None}))
    request_path(tmp_path).parent.mkdir()
    request_path(tmp_path).symlink_to(real)
    assert take_request(tmp_path, world_size=4) is None


def test_session_read_for_its_request_only(tmp_path):
    write_session(tmp_path, {"id": "a", "rank": 1, "node": "n1", "socket": "/tmp/s", "step": 4, "state": "waiting"})
    assert read_session(tmp_path, "a")["socket"] == "/tmp/s"
    assert read_session(tmp_path, "b") is None
    write_session(tmp_path, {"id": "a", "rank": 1, "node": "n1", "socket": 5, "step": 4, "state": "waiting"})
    assert read_session(tmp_path, "a") is None


@pytest.mark.parametrize(
    ("typed", "outcome"),
    [
        (b"c\n", CONTINUE),
        (b"where\np 6 * 7\nup\nc\n", CONTINUE),
        (b"q\n", QUIT),
        (b"", QUIT),  # the connection's end
    ],
)
def test_one_pdb_session_over_a_socket(typed, outcome):
    ours, theirs = socket.socketpair()
    shown = []

    def user() -> None:
        theirs.sendall(typed)
        theirs.shutdown(socket.SHUT_WR)
        while data := theirs.recv(65536):
            shown.append(data)

    thread = threading.Thread(target=user)
    thread.start()
    assert run_pdb(ours, rank=1, world=2, step=3) == outcome
    ours.close()
    thread.join(timeout=10)
    text = b"".join(shown).decode()
    assert text.startswith("rank 1 of 2 stopped after step 3;") and "(Pdb rank 1) " in text
    if b"p 6 * 7" in typed:
        assert "(Pdb rank 1) 42\n" in text


def test_the_attach_side_connects_only_to_a_socket_of_this_user_in_its_private_directory(tmp_path):
    private = tmp_path / socket_dir_name(os.getuid())
    private.mkdir(mode=0o700)
    path = private / "1-rank0.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    try:
        assert check_socket(str(path)) is None
        private.chmod(0o755)
        assert "only they reach" in check_socket(str(path))
        private.chmod(0o700)
        plain = private / "plain"
        plain.write_text("")
        assert "not a socket" in check_socket(str(plain))
        elsewhere = tmp_path / "other"
        elsewhere.mkdir()
        assert "not in a directory" in check_socket(str(elsewhere / "x.sock"))
        assert "the session ended" in check_socket(str(private / "gone.sock"))
    finally:
        server.close()


def test_the_watchdog_sees_no_hang_while_paused_and_a_full_timeout_after():
    import time
    from types import SimpleNamespace

    from hpc_hsdp.task.resilience.watchdog import Watchdog

    watchdog = Watchdog(SimpleNamespace(rank=0, world_size=1, run_dir=None), timeout_s=0.3, exit_fn=lambda code: None)
    hung = []
    watchdog._hung = lambda: hung.append(time.monotonic())
    watchdog.paused = True
    watchdog.start(step=1)
    watchdog.step_times = [0.01]
    try:
        time.sleep(1.2)  # four timeouts in the debugger: no hang
        assert not hung
        watchdog.step_done(1)  # what the pause does as it ends
        watchdog.paused = False
        ended = time.monotonic()
        time.sleep(1.5)
        assert hung and hung[0] - ended >= 0.25, hung
    finally:
        watchdog.stop()
