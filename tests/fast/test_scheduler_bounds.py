"""When the scheduler stalls or a port is taken (issue 29), with stand-in SLURM commands:
where ``--cluster auto`` goes, the bounded runner, one query for many runs, the last known
state, the port picker and the emulator's lock. The real-cluster side: tests/cluster/test_scheduler_stall.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import hpc

from hpc_hsdp.errors import SchedulerError, SlurmEnvError, SpecError
from hpc_hsdp.plan.address import pick_port, port_candidates, port_is_free
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.rundir.lifecycle.job_state import load_job_state, save_job_state
from hpc_hsdp.scheduler.backends import resolve_cluster, slurm_command
from hpc_hsdp.scheduler.backends.slurm import parse_sacct_rows, parse_squeue_rows
from hpc_hsdp.scheduler.backends.slurm_command import Ping, SchedulerTimeout, run_slurm, slurm_timeout_s
from hpc_hsdp.submit_host.handle import job_statuses

pytestmark = pytest.mark.timeout(120)


def fake_commands(folder: Path, **scripts: str) -> Path:
    """Executable stand-ins (``sbatch``, ``scontrol``, ...) in ``folder``; each call is logged to ``calls``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in scripts.items():
        path = folder / name
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {folder / "calls"}\n{body}\n')
        path.chmod(0o755)
    return folder


@pytest.fixture
def no_system_config(monkeypatch, tmp_path):
    """This machine's own /etc/slurm stays out of the rule under test."""
    monkeypatch.setattr(slurm_command, "CONFIG_PATHS", (str(tmp_path / "absent.conf"),))
    monkeypatch.delenv("SLURM_CONF", raising=False)


# ----------------------------------------------------------------------------- where --cluster auto goes


def test_auto_runs_locally_only_without_a_slurm_client(tmp_path, monkeypatch):
    target, reason = resolve_cluster("auto", which=lambda name: None)
    assert target == "local" and "sbatch not found" in reason
    with pytest.raises(SchedulerError, match="sbatch is not on PATH"):
        resolve_cluster("slurm", which=lambda name: None)


def test_auto_runs_locally_where_slurm_is_installed_but_not_configured(tmp_path, monkeypatch, no_system_config):
    said = "scontrol: error: fetch_config: DNS SRV lookup failed\nscontrol: fatal: Could not establish a configuration source"
    bin_dir = fake_commands(tmp_path / "bin", sbatch="exit 0", scontrol=f"echo '{said}' >&2; exit 1")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    target, reason = resolve_cluster("auto")
    assert target == "local" and "not configured" in reason and "\n" not in reason
    assert reason.endswith("(no slurm.conf and no SLURM_CONF here, and DNS names no SLURM controller)"), reason
    assert "DNS SRV" not in reason and "fetch_config" not in reason  # scontrol's look-up errors are not the reason
    with pytest.raises(SchedulerError, match="not configured"):
        resolve_cluster("slurm")


def test_a_configured_slurm_whose_controller_is_silent_refuses_at_once(tmp_path, monkeypatch):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\nSlurmctldHost=ctld-7(10.0.0.7)\n")
    bin_dir = fake_commands(tmp_path / "bin", sbatch="exit 0", scontrol="sleep 30")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    monkeypatch.setenv("HPC_HSDP_SLURM_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(SchedulerTimeout) as raised:
        resolve_cluster("auto")
    assert time.monotonic() - start < 4
    message = str(raised.value)
    assert message.startswith("the SLURM controller ctld-7 did not answer within 1 s;"), message
    assert "--cluster local" in message and "\n" not in message


def test_a_controller_that_says_down_refuses_in_one_line(tmp_path, monkeypatch):
    said = (
        "slurm_load_ctl_conf error: Unable to contact slurm controller (connect failure) at "
        "ctld.example.org:6817 after 3 attempts; check SlurmctldHost and that slurmctld is running on it"
    )
    conf = tmp_path / "slurm.conf"
    conf.write_text("SlurmctldHost=ctld\n")
    bin_dir = fake_commands(
        tmp_path / "bin", sbatch="exit 0", scontrol=f"echo '{said}' >&2\necho second line >&2\nexit 1"
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(SchedulerError) as raised:
        resolve_cluster("auto")
    assert f"({said} second line)" in str(raised.value) and "\n" not in str(raised.value)


def test_a_slurm_conf_that_does_not_exist_is_no_reason_to_train_here(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "typo.conf"))
    with pytest.raises(SchedulerError, match="typo.conf does not exist"):
        resolve_cluster("auto", which=lambda name: "/usr/bin/sbatch")


def test_a_controller_that_answers_gets_the_job():
    up = Ping(answered=True, host="c1", config=None, configured=True, said="", timeout_s=10)
    target, reason = resolve_cluster("auto", ping=lambda: up, which=lambda name: "/usr/bin/sbatch")
    assert target == "slurm" and "the SLURM controller c1 answers" in reason


def test_submit_refuses_in_one_line_and_writes_nothing_when_the_controller_is_silent(tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("SlurmctldHost=ctld-9\n")
    bin_dir = fake_commands(tmp_path / "bin", sbatch="exit 0", scontrol="sleep 30")
    state = tmp_path / "state"
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_CONF": str(conf),
        "HPC_HSDP_SLURM_TIMEOUT": "1.5",
        "XDG_STATE_HOME": str(state),
    }
    run = tmp_path / "run"
    start = time.monotonic()
    out = hpc("submit", "--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--run-dir", str(run), env=env)
    took = time.monotonic() - start
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines() == [
        "hpc-hsdp: error: the SLURM controller ctld-9 did not answer within 1.5 s; nothing submitted: try again, "
        "or --cluster local to run on this machine"
    ]
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert not run.exists() and not state.exists()
    assert took < 8, took
    script = "import hpc_hsdp\nhpc_hsdp.submit(nodes=1, gpus_per_node=2, shard=2, run_dir=" + repr(str(run)) + ")"
    api = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("SLURM")}, **env},
    )
    assert api.returncode != 0 and "SchedulerTimeout: the SLURM controller ctld-9 did not answer" in api.stderr
    assert not run.exists()


# ----------------------------------------------------------------------------- the bounded runner


def test_the_runner_kills_a_command_and_its_children_past_the_timeout(tmp_path):
    child = tmp_path / "child.pid"
    start = time.monotonic()
    with pytest.raises(SchedulerTimeout, match=r"the SLURM controller( \S+)? did not answer sh within 0.5 s"):
        run_slurm(["sh", "-c", f"sleep 30 & echo $! > {child}; wait"], timeout_s=0.5)
    assert time.monotonic() - start < 3
    pid = int(child.read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the command's child {pid} outlived the timeout")


def test_the_runner_names_the_accounting_for_sacct_and_returns_failures(tmp_path, monkeypatch):
    conf = tmp_path / "slurm.conf"
    conf.write_text("SlurmctldHost=c1\nAccountingStorageHost=dbd-1\n")
    bin_dir = fake_commands(tmp_path / "bin", sacct="sleep 30", squeue="echo nope >&2; exit 1")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(SchedulerTimeout, match=r"^the SLURM accounting \(slurmdbd on dbd-1\) did not answer sacct"):
        run_slurm(["sacct", "-j", "1"], timeout_s=0.3)
    done = run_slurm(["squeue"], timeout_s=5)
    assert done.returncode == 1 and done.stderr.strip() == "nope"
    with pytest.raises(SchedulerError, match="could not be run"):
        run_slurm([str(tmp_path / "no-such-command")])


def test_the_timeout_comes_from_one_variable():
    assert slurm_timeout_s({}) == 10.0
    assert slurm_timeout_s({"HPC_HSDP_SLURM_TIMEOUT": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "1e9"):
        with pytest.raises(SpecError, match="HPC_HSDP_SLURM_TIMEOUT"):
            slurm_timeout_s({"HPC_HSDP_SLURM_TIMEOUT": bad})


def test_no_slurm_command_runs_outside_the_runner():
    """Every SLURM command of the package goes through run_slurm (or bounded_command for submitit's sbatch)."""
    package = Path(__file__).resolve().parents[2] / "hpc_hsdp"
    offenders = []
    for path in package.rglob("*.py"):
        if path.name == "slurm_command.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "subprocess." in line and any(
                call in line for call in ("run(", "check_output(", "check_call(", "Popen(", "call(")
            ):
                head = "\n".join(path.read_text().splitlines()[number - 1 : number + 3])
                if any(f'"{name}"' in head for name in ("sbatch", "squeue", "scontrol", "sacct", "scancel", "sinfo")):
                    offenders.append(f"{path.relative_to(package)}:{number}")
    assert not offenders, offenders


# ----------------------------------------------------------------------------- one query for many runs


def test_parsers_of_the_batched_answers():
    squeue = "101|RUNNING|None\n102|PENDING|Resources\n\ngarbage\n103|COMPLETING|\n"
    assert parse_squeue_rows(squeue) == {
        "101": ("RUNNING", None),
        "102": ("PENDING", "Resources"),
        "103": ("COMPLETING", None),
    }
    sacct = "201|COMPLETED|0:0\n202|CANCELLED by 0|0:15\n203|REQUEUED|0:0\n203|RUNNING|0:0\n|x|y\n"
    assert parse_sacct_rows(sacct) == {
        "201": ("COMPLETED", "0:0"),
        "202": ("CANCELLED", "0:15"),
        "203": ("RUNNING", "0:0"),
    }


def _slurm_run_dirs(root: Path, count: int, *, first_id: int = 1000) -> list[JobRecord]:
    records = []
    for k in range(count):
        run = root / f"run-{k:04d}"
        run.mkdir(parents=True)
        record = JobRecord(
            job_id=str(first_id + k),
            cluster="slurm",
            run_dir=str(run),
            logs_dir=str(run / "logs"),
            job_name="t",
            ntasks=2,
            launcher="srun",
            submitted_at=0.0,
        )
        (run / "job.json").write_text(json.dumps(record.__dict__))
        records.append(record)
    return records


def test_one_squeue_and_one_sacct_for_every_job(tmp_path, monkeypatch):
    records = _slurm_run_dirs(tmp_path / "runs", 5)
    bin_dir = fake_commands(
        tmp_path / "bin",
        squeue="echo '1000|RUNNING|None'; echo '1001|PENDING|Priority'",
        sacct="echo '1002|COMPLETED|0:0'; echo '1003|FAILED|1:0'",
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    statuses = job_statuses(records)
    calls = (bin_dir / "calls").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["squeue", "sacct"], calls
    assert "1000,1001,1002,1003,1004" in calls[0] and "1002,1003,1004" in calls[1]
    states = [statuses[r.run_dir].state for r in records]
    assert states == ["RUNNING", "PENDING", "COMPLETED", "FAILED", "UNKNOWN"]
    assert statuses[records[1].run_dir].reason == "Priority"
    assert all(statuses[r.run_dir].controller_answered for r in records)
    assert load_job_state(records[0].run_dir, "1000")["state"] == "RUNNING"


def test_a_silent_controller_gives_the_last_known_state_with_its_age(tmp_path, monkeypatch):
    records = _slurm_run_dirs(tmp_path / "runs", 3)
    save_job_state(records[0].run_dir, "1000", state="RUNNING", now=time.time() - 125)
    bin_dir = fake_commands(
        tmp_path / "bin", squeue="sleep 30", sacct="echo '1000|RUNNING|0:0'; echo '1001|COMPLETED|0:0'"
    )
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("HPC_HSDP_SLURM_TIMEOUT", "0.5")
    start = time.monotonic()
    statuses = job_statuses(records)
    assert time.monotonic() - start < 3
    running, done, never = (statuses[r.run_dir] for r in records)
    assert running.state == "RUNNING" and not running.current and running.controller_answered is False
    assert running.last_known_state == "RUNNING" and 120 < running.last_known_age_s() < 140
    assert "did not answer squeue within 0.5 s" in running.note and "last known state RUNNING, 2m" in running.note
    assert done.state == "COMPLETED" and done.finished  # the accounting holds its end: final
    assert never.state == "UNKNOWN" and "no state recorded before" in never.note
    assert load_job_state(records[0].run_dir, "1000")["at"] < time.time() - 100  # a stale answer is not recorded


def test_runs_over_a_thousand_run_directories_asks_once(tmp_path):
    records = _slurm_run_dirs(tmp_path / "runs", 1000)
    rows = "\n".join(f"{r.job_id}|RUNNING|None" for r in records[:500])
    (tmp_path / "squeue.out").write_text(rows + "\n")
    bin_dir = fake_commands(
        tmp_path / "bin", squeue=f"cat {tmp_path / 'squeue.out'}", sacct="echo '1500|COMPLETED|0:0'"
    )
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    start = time.monotonic()
    out = hpc("runs", str(tmp_path / "runs"), env=env)
    took = time.monotonic() - start
    assert out.returncode == 0, out.stderr
    calls = (bin_dir / "calls").read_text().splitlines()
    assert [c.split()[0] for c in calls] == ["squeue", "sacct"]
    lines = out.stdout.splitlines()
    assert len(lines) == 1001 and sum("RUNNING" in line for line in lines) == 500
    print(f"runs over 1,000 SLURM run directories (stand-in squeue/sacct): {took:.2f} s, one squeue + one sacct")
    assert took < 10, took


def test_status_json_says_the_controller_did_not_answer(tmp_path):
    (record,) = _slurm_run_dirs(tmp_path / "runs", 1)
    save_job_state(record.run_dir, record.job_id, state="RUNNING", restarts=1, now=time.time() - 30)
    conf = tmp_path / "slurm.conf"
    conf.write_text("SlurmctldHost=ctl-3\n")
    bin_dir = fake_commands(tmp_path / "bin", squeue="sleep 30", scontrol="sleep 30", sacct="echo '1000|RUNNING|0:0'")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HPC_HSDP_SLURM_TIMEOUT": "1", "SLURM_CONF": str(conf)}
    start = time.monotonic()
    out = hpc("status", record.run_dir, "--json", env=env)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - start < 8
    data = json.loads(out.stdout)
    assert data["controller_answered"] is False and data["accounting_answered"] is True
    assert data["state"] == "RUNNING" and data["last_known_state"] == "RUNNING" and data["restarts"] == 1
    assert 25 < data["last_known_age_s"] < 60
    assert data["scheduler_note"].startswith("the SLURM controller ctl-3 did not answer squeue within 1 s")
    calls = [c.split()[0] for c in (bin_dir / "calls").read_text().splitlines()]
    assert calls == ["squeue", "sacct"], calls  # no scontrol, no second squeue for the time left
    human = hpc("status", record.run_dir, env=env)
    assert (
        "RUNNING (not current: see below)" in human.stdout and "scheduler: the SLURM controller ctl-3" in human.stdout
    )
    cancel = hpc("cancel", record.run_dir, env=env)
    assert cancel.returncode == 2 and "not cancelled; try again" in cancel.stderr
    assert "scancel" not in (bin_dir / "calls").read_text()


# ----------------------------------------------------------------------------- the rendezvous port


def test_port_candidates_are_the_derived_port_then_ports_no_job_derives():
    assert port_candidates(25731, 3) == [25731, 15731, 15732]
    assert port_candidates(29999, 3) == [29999, 19999, 10000]
    assert port_candidates(65534, 5) == [65534, 65535]


def test_a_port_in_time_wait_is_free_for_the_store_and_a_listened_one_is_not():
    """A requeued job's previous run leaves its store's connections in TIME_WAIT: the store
    binds it again (SO_REUSEADDR), so the probe must call it free."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's listener (libuv) does
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the server side closes first: its end lingers in TIME_WAIT
    client.close()
    server.close()
    assert port_is_free(port)


def test_the_picker_skips_ports_in_use_and_held(tmp_path):
    assert pick_port(21000, is_free=lambda port: port not in (21000, 11000)) == 11001
    assert pick_port(21000, taken={21000}, is_free=lambda port: True) == 11000
    with pytest.raises(SlurmEnvError, match="no free port among the 4 from 21000 on node n1"):
        pick_port(21000, tries=4, is_free=lambda port: False, where="node n1")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not port_is_free(port)
        assert pick_port(port) != port


def test_layout_hands_the_first_free_port_to_the_batch_script(tmp_path):
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {
            "SLURM_JOB_ID": "77",
            "SLURM_JOB_NODELIST": "n1",
            "SLURMD_NODENAME": "n1",
            "HPC_HSDP_RENDEZVOUS_PORT": str(port),
        }
        out = hpc("layout", "--field", "rendezvous", env=env)
    assert out.returncode == 0, out.stderr
    address, picked = out.stdout.split()
    assert address == "127.0.0.1" and int(picked) == port + 1  # not a derived port: the ones after it
    with socket.socket() as held:
        held.bind(("0.0.0.0", 20077))
        held.listen()
        derived = hpc("layout", "--field", "rendezvous", env={**env, "HPC_HSDP_RENDEZVOUS_PORT": ""})
    assert derived.returncode == 0, derived.stderr
    assert derived.stdout.split()[1] == "10077"  # 20077 held: 10077, a port no job derives


_RESERVE = """
import json, sys, time
from pathlib import Path
from hpc_hsdp.scheduler.emulator.ports import reserve_port
state = Path(sys.argv[1])
state.write_text(json.dumps({"state": "PENDING", "supervisor_pid": None}))
while time.time() < float(sys.argv[3]):
    pass
print(reserve_port(sys.argv[2], state, is_free=lambda port: True))
"""


def test_emulated_jobs_started_at_once_never_share_a_port(tmp_path):
    """Eight emulated jobs whose ids give the same derived port reserve theirs at the same instant."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    start_at = time.time() + 1.5
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                _RESERVE,
                str(tmp_path / f"{k}_local.json"),
                str(10_000_731 + 10_000 * k),
                str(start_at),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for k in range(8)
    ]
    ports = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert sorted(ports) == [*range(10731, 10738), 20731], ports
    held = json.loads((tmp_path / "state" / "hpc-hsdp" / "emulator" / "ports.json").read_text())
    assert sorted(int(p) for p in held) == sorted(ports)
    # a job that ended gives its port back
    (tmp_path / "0_local.json").write_text(json.dumps({"state": "COMPLETED"}))
    again = subprocess.run(
        [sys.executable, "-c", _RESERVE, str(tmp_path / "9_local.json"), "10000731", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert int(again.stdout) == ports[0]
