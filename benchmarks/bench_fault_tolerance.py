"""--fault-tolerance replica on the local emulator: step efficiency under failures, against no
failure and against today's path (the job ends, is started again, resumes its checkpoint).

    python benchmarks/bench_fault_tolerance.py [--steps N] [--every N] [--step-delay S]

Every run is an emulated job of 2 nodes x 2 ranks, --shard 2 (2 replica groups of one node),
the built-in model (1 layer, width 16), synthetic data, global batch 8, gloo on CPU, with
HPC_HSDP_FAULT_STEP_DELAY_S added to every step (a step of compute, so that a step is not only
this loaded machine's noise). Three runs of the same ``--steps``:

  none      --fault-tolerance replica, no failure: the baseline step rate
  ft        --fault-tolerance replica --spare-nodes 1: every ``--every`` steps (counted from the
            group's rejoining) every process of replica group 1 is killed (-9); the supervisor
            starts it again on the spare node (the killed one becomes the spare), it heals from
            group 0 and joins; group 0 trains on alone meanwhile
  requeue   no fault tolerance, --checkpoint-every ``--every``: killed the same way once per
            ``--every`` steps (every rank: the job ends), then started again on the same run
            directory (what a requeue does, without SLURM's queue wait), resuming its checkpoint

Efficiency: the baseline's steady step time x steps / the run's time from its first step to its
last. Steps lost per failure: uncommitted step attempts (``retries`` in metrics.jsonl, ft) or
steps trained again after the resume (requeue), per failure. Start-up (the first step) is left
out of every run's time but the requeue's restarts pay it each time, as a requeue does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hpc_hsdp.cli.job_options import job_spec_from_options  # noqa: E402
from hpc_hsdp.cli.render_cmd import render  # noqa: E402
from hpc_hsdp.scheduler.emulator.allocation import allocation_for  # noqa: E402
from hpc_hsdp.scheduler.emulator.launch import launch_local  # noqa: E402
from hpc_hsdp.submit_host.render import render_sbatch  # noqa: E402


def spec(run_dir: Path, steps: int, delay: float, *extra: str):
    argv = [
        *("--nodes", "2", "--gpus-per-node", "2", "--shard", "2", "--steps", str(steps)),
        *("--global-batch-size", "8", "--layers", "1", "--width", "16", "--heads", "2", "--seq-len", "8"),
        *("--straggler-every", "0", "--device", "cpu", "--run-dir", str(run_dir), "--venv", "none"),
        *("--python", sys.executable, "--env", f"HPC_HSDP_FAULT_STEP_DELAY_S={delay}"),
        *extra,
    ]
    params = render.make_context("render", argv).params
    return job_spec_from_options(params, environ={}, cwd=run_dir.parent, default_venv=None)


def launch(job_spec):
    logs = Path(job_spec.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    tasks = job_spec.tasks_per_node + (job_spec.gpus_per_node,) * job_spec.spare_nodes
    alloc = allocation_for(tasks_per_node=tasks, gpus_per_node=2, job_name="bench-ft")
    return launch_local(render_sbatch(job_spec), alloc=alloc, logs_dir=logs)


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def pids_of(job_id: str, replica_id: int | None) -> list[int]:
    wanted = {f"SLURM_JOB_ID={job_id}".encode()}
    if replica_id is not None:
        wanted.add(f"HPC_HSDP_REPLICA_ID={replica_id}".encode())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = set((entry / "environ").read_bytes().split(b"\0"))
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if wanted <= environ and (replica_id is not None or b"hpc_hsdp\x00run" in cmdline):
            found.append(int(entry.name))
    return found


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def span(records: list[dict]) -> float:
    return records[-1]["wall_time"] - records[0]["wall_time"]


def run_none(tmp: Path, steps: int, delay: float) -> dict:
    run = tmp / "none"
    job = launch(spec(run, steps, delay, "--fault-tolerance", "replica"))
    job.wait(timeout_s=900)
    records = metrics(run)
    steady = statistics.median(b["wall_time"] - a["wall_time"] for a, b in zip(records[5:], records[6:], strict=False))
    return {"records": records, "steady_step_s": steady, "span_s": span(records)}


def run_ft(tmp: Path, steps: int, delay: float, every: int) -> dict:
    run = tmp / "ft"
    job = launch(spec(run, steps, delay, "--fault-tolerance", "replica", "--spare-nodes", "1"))
    failures, next_kill = 0, every
    while not job.done():
        records = metrics(run)
        if records and records[-1]["step"] >= next_kill and records[-1].get("replicas") == 2:
            if records[-1]["step"] < steps - 5:
                kill(pids_of(job.job_id, 1))
                failures += 1
            next_kill = records[-1]["step"] + every
        time.sleep(0.1)
    records = metrics(run)
    return {
        "records": records,
        "failures": failures,
        "retries": sum(r.get("retries", 0) for r in records),
        "span_s": span(records),
        "state": job.state,
        "one_group_steps": sum(1 for r in records if r.get("replicas") == 1),
    }


def run_requeue(tmp: Path, steps: int, delay: float, every: int) -> dict:
    run = tmp / "requeue"
    failures, trained, first_step_at, killed_at, lost = 0, 0, None, None, 0
    while True:
        job = launch(spec(run, steps, delay, "--checkpoint-every", str(every), "--max-restarts", "100"))
        start_len = len(metrics(run))
        kill_at = None
        while not job.done():
            records = metrics(run)
            if killed_at is not None and (run / "attempt.json").exists() and len(records) > start_len:
                resumed = json.loads((run / "attempt.json").read_text()).get("start_step") or 0
                lost += killed_at - resumed  # trained again after the resume
                killed_at = None
            if records and first_step_at is None:
                first_step_at = records[0]["wall_time"]
            if records and kill_at is None and len(records) > start_len:
                kill_at = records[-1]["step"] + every  # a failure every N steps of this attempt
            if kill_at is not None and records and records[-1]["step"] >= kill_at and records[-1]["step"] < steps - 5:
                kill(pids_of(job.job_id, None))
                failures += 1
                killed_at = records[-1]["step"]
                break
            time.sleep(0.1)
        job.wait(timeout_s=120)
        records = metrics(run)
        trained += len(records) - start_len if records else 0
        if records and records[-1]["step"] >= steps:
            break
    return {
        "records": records,
        "failures": failures,
        "lost": lost,
        "span_s": records[-1]["wall_time"] - first_step_at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=160)
    parser.add_argument("--every", type=int, default=40)
    parser.add_argument("--step-delay", type=float, default=0.2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ft-") as folder:
        tmp = Path(folder)
        none = run_none(tmp, args.steps, args.step_delay)
        ft = run_ft(tmp, args.steps, args.step_delay, args.every)
        requeue = run_requeue(tmp, args.steps, args.step_delay, args.every)
    ideal = none["steady_step_s"] * (args.steps - 1)
    print(f"steps {args.steps}, a failure every {args.every} steps, step delay {args.step_delay} s")
    print(
        f"baseline (no failure): steady step {none['steady_step_s'] * 1000:.0f} ms, steps 1..N {none['span_s']:.1f} s"
    )
    for name, result in (("none", none), ("ft", ft), ("requeue", requeue)):
        steps_seen = [r["step"] for r in result["records"]]
        every_once = steps_seen == list(range(1, args.steps + 1))
        line = f"{name:8s} span {result['span_s']:7.1f} s  efficiency {ideal / result['span_s']:.2f}"
        line += f" (of the no-failure run's span: {none['span_s'] / result['span_s']:.2f})"
        if result.get("failures"):
            line += f"  a failure every {result['span_s'] / result['failures']:.0f} s"
        line += f"  every step once: {every_once}"
        if name == "ft":
            lost = ft["retries"] / max(1, ft["failures"])
            line += (
                f"  failures {ft['failures']}  steps lost per failure {lost:.2f}"
                f"  steps on one group {ft['one_group_steps']}  ({ft['state']})"
            )
        if name == "requeue":
            line += (
                f"  failures {requeue['failures']}  steps lost per failure "
                f"{requeue['lost'] / max(1, requeue['failures']):.2f} (+ a restart each)"
            )
        print(line)


if __name__ == "__main__":
    main()
