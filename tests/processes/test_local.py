"""The local emulator behind `hpc-hsdp submit --cluster local`: the same script, tasks with
SLURM's variables, real gloo processes; status, logs and cancel from a new process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import assert_cli_imports_no_torch, hpc

from hpc_hsdp.scheduler.emulator.slurm_patterns import expand_pattern
from tests.emulator_helpers import TEARDOWN_PROBE
from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

TINY = tiny_job()


def test_submit_local_runs_the_job_with_node_local_groups(tmp_path, local_submit):
    run = tmp_path / "run"
    out = hpc(
        *local_submit(
            run, "--distribution", "cyclic", "--steps", "3", "--wait", *TINY, nodes=2, gpus_per_node=4, device=None
        )
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "running on the local emulator" in out.stderr and "COMPLETED" in out.stderr
    assert "step 3/3" in out.stderr
    layout = json.loads((run / "layout.json").read_text())
    ranks = {r["rank"]: r for r in layout["ranks"]}
    assert layout["plan"]["shard_groups"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [ranks[r]["node"] for r in range(8)] == ["n1"] * 4 + ["n2"] * 4
    assert ranks[1]["slurm_procid"] == 2 and ranks[4]["slurm_procid"] == 1  # cyclic, as srun deals them
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    status = json.loads(hpc("status", str(run), "--json").stdout)
    assert status["state"] == "COMPLETED" and status["cluster"] == "local" and status["failure"] is None
    # the script the emulator ran is the one `submit --dry-run` prints
    job_id = status["job_id"]
    dry = hpc(
        "submit",
        "--dry-run",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--shard",
        "2",
        "--distribution",
        "cyclic",
        "--steps",
        "3",
        "--run-dir",
        str(run),
        *TINY,
    )
    assert (run / "logs" / f"{job_id}_submission.sh").read_text() == dry.stdout


def test_failing_rank_is_reported_and_the_job_fails_fast(tmp_path, local_submit):
    module = tmp_path / "boom_entry.py"
    module.write_text(
        "def main(ctx):\n    if ctx.rank == 3:\n        raise RuntimeError('boom on rank 3')\n"
        "    import time\n    time.sleep(120)\n"
    )
    run = tmp_path / "run"
    start = time.monotonic()
    out = hpc(
        *local_submit(run, "--wait", "--entry", "boom_entry:main", nodes=2, device=None),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert time.monotonic() - start < 90  # srun --kill-on-bad-exit ends the step, not the sleep
    assert "FAILED" in out.stderr and "boom on rank 3" in out.stderr and "task 3" in out.stderr
    shown = hpc("status", str(run))  # later, from another process: the same cause
    assert shown.returncode == 0 and "\nfailure: rank 3 (task 3) failed first: " in shown.stdout, shown.stdout
    assert "RuntimeError: boom on rank 3" in shown.stdout
    assert "boom on rank 3" in json.loads(hpc("status", str(run), "--json").stdout)["failure"]


def test_an_error_of_hpc_hsdp_on_the_tasks_is_its_message_and_exit_2(tmp_path, local_submit):
    """What only the tasks can find wrong (here raised by an --entry function) ends each task
    as `hpc-hsdp run` does on srun: the message on one line, exit 2, no traceback."""
    (tmp_path / "refusing_entry.py").write_text(
        "from hpc_hsdp.errors import SpecError\n"
        "def main(ctx):\n    raise SpecError(f'rank {ctx.rank} refuses; give it another value')\n"
    )
    run = tmp_path / "run"
    out = hpc(
        *local_submit(run, "--wait", "--entry", "refusing_entry:main", device=None),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 1, out.stdout + out.stderr
    assert "failed first: exited with code 2" in out.stderr, out.stderr
    logs = {p.name: p.read_text() for p in (run / "logs").glob("*_log.err")}
    refused = [name for name, text in logs.items() if "hpc-hsdp: error: rank " in text]
    assert refused and all("refuses; give it another value" in logs[name] for name in refused)
    assert not any("Traceback" in text for text in logs.values()), logs


def test_a_finished_task_runs_its_exit_handlers_and_skips_the_teardown(tmp_path, local_submit):
    """Submitted tasks end through hpc_hsdp.task.entry.end_task: exit handlers run, the
    interpreter's teardown (where gloo's worker threads can abort the process) does not."""
    (tmp_path / "teardown_probe.py").write_text(TEARDOWN_PROBE)
    run = tmp_path / "run"
    out = hpc(
        *local_submit(run, "--wait", "--entry", "teardown_probe:main", device=None),
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in run.glob("rank*")) == ["rank0.atexit", "rank1.atexit"]


def test_status_logs_cancel_from_a_new_process(tmp_path, local_submit):
    run = tmp_path / "run"
    sub = hpc(*local_submit(run, "--steps", "100000", *TINY, device=None))
    assert sub.returncode == 0, sub.stderr
    deadline = time.monotonic() + 120
    while not (run / "metrics.jsonl").exists():
        assert time.monotonic() < deadline, hpc("logs", str(run)).stdout
        time.sleep(0.5)
    status = json.loads(hpc("status", str(run), "--json").stdout)
    assert status["state"] == "RUNNING" and status["last_step"]["step"] >= 1
    logs = hpc("logs", str(run), "--rank", "1")
    assert logs.returncode == 0 and '"rank": 1' not in logs.stdout and "rank 1" in logs.stdout
    by_id = hpc("status", status["job_id"])
    assert by_id.returncode == 0 and "RUNNING" in by_id.stdout
    cancelled = hpc("cancel", str(run))  # as scancel: every rank stops after its step, saves, ends
    assert cancelled.returncode == 0, cancelled.stderr
    status = json.loads(hpc("status", str(run), "--json").stdout)
    assert status["state"] == "CANCELLED" and status["failure"] is None  # asked for, not a failure
    last = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step-"))[-1] == (
        f"step-{last:06d}"
    )
    assert (
        cancelled.stdout
        == f"cancelled job {status['job_id']} (CANCELLED): step {last} saved: a submit with the same --run-dir resumes from it\n"
    )


def test_python_api_on_the_emulator(tmp_path):
    code = f"""
import json, hpc_hsdp
def fn(ctx):
    return [ctx.rank, ctx.layout.node, list(ctx.layout.replicate_group)]
job = hpc_hsdp.submit(fn, cluster="local", nodes=2, gpus_per_node=2, shard=2, run_dir={str(tmp_path / "api")!r})
print(json.dumps(job.results()))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=200)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results == [[0, "n1", [0, 2]], [1, "n1", [1, 3]], [2, "n2", [0, 2]], [3, "n2", [1, 3]]]


def test_auto_never_trains_here_when_a_configured_controller_does_not_answer(tmp_path):
    """Issue 29: SLURM configured (SLURM_CONF) and its controller refusing connections: submit
    refuses in one line, exit 2, writes nothing; it used to train on this machine instead."""
    (tmp_path / "slurm.conf").write_text("ClusterName=none\nSlurmctldHost=nowhere(127.0.0.1)\nSlurmctldPort=1\n")
    run = tmp_path / "run"
    args = ["submit", "--nodes", "1", "--gpus-per-node", "1", "--shard", "1", "--steps", "1", "--run-dir", str(run)]
    out = hpc(*args, *TINY, env={"SLURM_CONF": str(tmp_path / "slurm.conf")}, timeout=60)
    assert out.returncode == 2, out.stdout + out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("hpc-hsdp: error: the SLURM controller nowhere does not answer (") and line.endswith(
        "nothing submitted: try again, or --cluster local to run on this machine"
    ), line
    assert not run.exists() and "local emulator" not in out.stdout + out.stderr


def test_auto_runs_on_the_emulator_where_slurm_is_not_configured(tmp_path):
    """sbatch may be installed (this machine's Debian packages), but with no configuration at all
    (no SLURM_CONF, no slurm.conf) scontrol finds no controller: the emulator runs the job."""
    from hpc_hsdp.scheduler.backends.slurm_command import slurm_config

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    if slurm_config(env) is not None:
        pytest.skip(f"this machine has a SLURM configuration ({slurm_config(env)})")
    run = tmp_path / "run"
    out = hpc(
        "submit",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--shard",
        "1",
        "--steps",
        "1",
        "--wait",
        "--run-dir",
        str(run),
        *TINY,
    )
    assert out.returncode == 0, out.stderr
    assert "running on the local emulator" in out.stderr.splitlines()[0]


API_TWICE = """
import hpc_hsdp
from hpc_hsdp.errors import HsdpError
import hpc_hsdp.submit_host.submission  # what the CLI imports; hpc_hsdp.submit must stay the API function
for _ in range(2):
    try:
        hpc_hsdp.submit(nodes=2, shard=3)
    except HsdpError as exc:
        print("refused:", exc)
"""


def test_api_submit_stays_callable_after_the_scheduler_module_is_imported():
    out = subprocess.run([sys.executable, "-c", API_TWICE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("refused: shard size 3 does not divide the 8 tasks") == 2, out.stdout


def test_api_rejects_unknown_option():
    out = subprocess.run(
        [sys.executable, "-c", "import hpc_hsdp; hpc_hsdp.submit(nodes=1, shard=1, shards=2)"],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0 and "unknown option 'shards'" in out.stderr


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [("/l/%j_%t_log.out", "/l/42_3_log.out"), ("%N-%n.%%", "n2-1.%"), ("plain", "plain")],
)
def test_expand_pattern(pattern, expected):
    assert expand_pattern(pattern, job_id="42", procid=3, node_id=1, node="n2") == expected


def test_submit_and_status_never_import_torch(tmp_path, local_submit):
    run = tmp_path / "run"
    args = [
        local_submit(run, "--steps", "1", "--wait", gpus_per_node=1, shard=1, device=None),
        ["status", str(run)],
        ["logs", str(run)],
        ["submit", "--dry-run", "--nodes", "2", "--shard", "4", "--run-dir", str(run)],
        ["runs", str(tmp_path)],
        ["report", str(run), "-o", str(tmp_path / "report.html")],
    ]
    assert_cli_imports_no_torch(*args)
    assert Path(run / "layout.json").exists()


def test_ctrl_c_of_submit_wait_says_the_job_goes_on_and_how_to_stop_it(tmp_path, local_submit):
    import signal

    run = tmp_path / "run"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MASTER_"))}
    argv = [sys.executable, "-m", "hpc_hsdp", *local_submit(run, "--wait", "--steps", "100000", *TINY, device=None)]
    follower = subprocess.Popen(  # SIGINT as a terminal's Ctrl-C gives it (pytest-xdist's workers ignore it)
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=base,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").exists():  # training: the job is well under way
            assert follower.poll() is None and time.monotonic() < deadline, follower.communicate()
            time.sleep(0.2)
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=30)
        assert follower.returncode == 130, err
        assert "stopped following; job" in err and "goes on" in err and f"hpc-hsdp cancel {run}" in err, err
        assert "Aborted" not in err and "Traceback" not in err, err
        assert json.loads(hpc("status", str(run), "--json").stdout)["state"] == "RUNNING"
    finally:
        if follower.poll() is None:
            follower.kill()
        hpc("cancel", str(run))
