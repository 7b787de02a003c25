"""What the run directory's claim (issue 27: one writer per run directory) adds to a submission.

A submission into a run directory that holds an ended emulated job (job.json, its state file,
a released claim): the check it did before (the job.json's job asked about, then the
directory read for the resume) against the same with the claim taken (flock of claim.lock,
claim.json read, the claim's job asked about, ``submitting`` then ``claimed`` written
atomically, the lock let go). Medians of interleaved repeats, ratio to the check without it.

    python benchmarks/bench_claim.py [--runs 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from hpc_hsdp.rundir.checkpointing.state import run_dir_state
from hpc_hsdp.rundir.lifecycle.claim import write_claim
from hpc_hsdp.rundir.lifecycle.job_record import JobRecord
from hpc_hsdp.submit_host.claims import claimed
from hpc_hsdp.submit_host.handle import JobHandle


def ended_run(root: Path) -> Path:
    run = root / "run"
    logs = run / "logs"
    logs.mkdir(parents=True)
    (logs / "12345_local.json").write_text(
        json.dumps({"state": "COMPLETED", "exit_code": 0, "supervisor_pid": 1, "logs_dir": str(logs)})
    )
    JobRecord(
        job_id="12345",
        cluster="local",
        run_dir=str(run),
        logs_dir=str(logs),
        job_name="bench",
        ntasks=1,
        launcher="srun",
        submitted_at=time.time(),
    ).save()
    write_claim(run, "released", job_id="12345", cluster="local", logs_dir="logs", ended="COMPLETED")
    return run


def before(run: Path) -> None:
    JobHandle.find(str(run)).status()
    run_dir_state(str(run))


def after(run: Path) -> None:
    with claimed(run, cluster="local") as (_, record):
        run_dir_state(str(run))
        record(JobRecord.load(str(run)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=200)
    runs = parser.parse_args().runs
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("XDG_STATE_HOME", str(Path(tmp) / "state"))
        run = ended_run(Path(tmp))
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(runs):
            for name, fn in (("before", before), ("after", after)):
                start = time.perf_counter()
                fn(run)
                times[name].append(time.perf_counter() - start)
        base, claim = statistics.median(times["before"]), statistics.median(times["after"])
        print(f"check without the claim: {base * 1e3:.3f} ms (median of {runs})")
        print(f"check with the claim:    {claim * 1e3:.3f} ms ({claim / base:.2f}x, +{(claim - base) * 1e3:.3f} ms)")


if __name__ == "__main__":
    main()
