"""--snapshot-code and provenance on the local emulator (hpc_hsdp.submit_host.provenance,
hpc_hsdp.rundir.lifecycle.provenance_record): code edited on disk after submit changes nothing for the job; the
run records the commit and uncommitted changes of its code. Also git_state against real git."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import hpc

from hpc_hsdp.rundir.lifecycle.provenance_record import read_provenance, read_task_provenance
from hpc_hsdp.submit_host import provenance as gather
from tests.snapshot_code_helpers import git, package

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def wait_done(run: Path, timeout_s: float = 150) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        shown = hpc("status", str(run), "--json")
        if shown.returncode == 0 and json.loads(shown.stdout)["state"].split()[0] in ENDED:
            return json.loads(shown.stdout)
        time.sleep(0.5)
    pytest.fail(f"{run} did not finish: {hpc('status', str(run)).stdout}")


def submit_edit_and_go(tmp_path: Path, src: Path, name: str, *extra: str, local_submit) -> Path:
    """Submit the gated entry, edit the marker on disk, let the entry go; the run directory."""
    run, go = tmp_path / name, tmp_path / f"{name}.go"
    out = hpc(
        *local_submit(run, "--entry", "snapmod.entry:main", *extra, gpus_per_node=1, shard=1, device=None),
        env={"PYTHONPATH": str(src), "SNAP_GO": str(go), "HPC_HSDP_CODE_CACHE": str(tmp_path / "code-cache")},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (src / "snapmod" / "marker.py").write_text('MARKER = "new"\n')  # after submit, before the code is imported
    go.touch()
    assert wait_done(run)["state"] == "COMPLETED", hpc("status", str(run)).stdout
    return run


@pytest.mark.dist
@pytest.mark.timeout(400)
def test_a_snapshot_runs_the_code_of_the_submit_and_the_run_records_it(tmp_path, local_submit):
    src = tmp_path / "src"
    commit = package(src)

    snap = submit_edit_and_go(tmp_path, src, "snap", "--snapshot-code", local_submit=local_submit)
    marker = (snap / "markers.txt").read_text()
    record = read_provenance(snap)
    checked = tmp_path / "code-cache" / record["snapshot"]["sha256"]  # the private copy the job checked code/ into
    assert marker.startswith("MARKER=old restart=0 ") and f"from={checked / 'hpc_hsdp'}" in marker, marker
    assert (snap / "code" / "snapmod" / "marker.py").read_text() == 'MARKER = "old"\n'
    task = read_task_provenance(snap)
    assert task["snapshot_used"] is True and task["torch"] and task["python"]
    mine = next(c for c in record["code"] if c["name"] == "snapmod")
    assert mine["commit"] == commit and mine["dirty"] is False and mine["checkout"] == str(src)
    assert record["snapshot"]["modules"] == ["hpc_hsdp", "snapmod"]
    check = f"python -m hpc_hsdp.batch_shell.code_snapshot {snap / 'code'} {record['snapshot']['sha256']})"
    assert (snap / record["script"]).read_text().count(check) == 1
    shown = hpc("status", str(snap))
    assert f"\ncode: {commit[:10]} ({src}: snapmod)" in shown.stdout, shown.stdout
    assert "runs the snapshot in code/" in shown.stdout and "\nran with: torch " in shown.stdout

    # the same job without --snapshot-code runs what is on disk when it imports it: the edit (now
    # uncommitted, which its record says)
    (src / "snapmod" / "marker.py").write_text('MARKER = "old"\n')
    plain = submit_edit_and_go(tmp_path, src, "plain", local_submit=local_submit)
    assert (plain / "markers.txt").read_text().startswith("MARKER=new restart=0 ")
    assert read_task_provenance(plain)["snapshot_used"] is False and not (plain / "code").exists()
    # `runs` shows that the two runs ran different code (the second one's tree was edited)
    plain_record = read_provenance(plain)
    assert next(c for c in plain_record["code"] if c["name"] == "snapmod")["dirty"] is False
    (src / "snapmod" / "marker.py").write_text('MARKER = "edited"\n')
    dirty = submit_edit_and_go(tmp_path, src, "dirty", local_submit=local_submit)
    mine = next(c for c in read_provenance(dirty)["code"] if c["name"] == "snapmod")
    assert mine["dirty"] is True and '-MARKER = "old"\n+MARKER = "edited"' in mine["diff"]
    assert "+ uncommitted changes" in hpc("status", str(dirty)).stdout
    listing = hpc("runs", str(tmp_path))
    assert "the runs differ in: code (2 versions" in listing.stdout, listing.stdout
    row = next(line for line in listing.stdout.splitlines() if line.startswith("dirty "))
    assert f"{commit[:10]}+" in row


def test_git_state_of_a_clean_a_dirty_and_a_new_checkout(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    commit = package(repo)
    assert gather.git_state(repo) == {"commit": commit, "dirty": False, "untracked": []}
    (repo / "snapmod" / "marker.py").write_text('MARKER = "x" * 3000\n')
    (repo / "notes.txt").write_text("new file\n")
    state = gather.git_state(repo)
    assert state["dirty"] is True and state["untracked"] == ["notes.txt"]
    assert '+MARKER = "x" * 3000' in state["diff"] and state["diff_truncated"] is False
    monkeypatch.setattr(gather, "MAX_DIFF_BYTES", 100)
    cut = gather.git_state(repo)
    assert len(cut["diff"]) == 100 and cut["diff_truncated"] is True and cut["diff_bytes"] > 100
    assert cut["diff_sha256"] == state["diff_sha256"]  # the whole diff's: two cut diffs still differ
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    git(fresh, "init", "-q")
    assert gather.git_state(fresh)["commit"] is None
    broken = tmp_path / "broken"
    (broken / ".git").mkdir(parents=True)  # not a repository git reads
    assert "error" in gather.git_state(broken)


def test_one_git_status_for_a_clean_checkout_and_modules_of_one_checkout_share_it(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    package(repo)
    calls = []
    real = subprocess.run

    def counting(argv, *args, **kwargs):
        calls.append(argv[3])
        return real(argv, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counting)
    states: dict = {}
    a = gather.code_record("snapmod", [repo / "snapmod"], states)
    b = gather.code_record("other", [repo / "snapmod" / "marker.py"], states)
    assert calls == ["status"] and a["commit"] == b["commit"] and a["checkout"] == str(repo)
    (repo / "snapmod" / "marker.py").write_text("X = 2\n")
    calls.clear()
    gather.code_record("snapmod", [repo / "snapmod"], {})
    assert calls == ["status", "diff"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_the_python_api_snapshots_the_module_of_its_function(tmp_path):
    """hpc_hsdp.submit(fn, snapshot_code=True): fn is pickled by reference (module and name), so
    the task imports its module; that module is the copy."""
    src = tmp_path / "src"
    package(src)
    run, go = tmp_path / "api", tmp_path / "api.go"
    script = (
        "import hpc_hsdp\nfrom snapmod.entry import main\n"
        f"hpc_hsdp.submit(main, cluster='local', nodes=1, gpus_per_node=1, shard=1, device='cpu', run_dir={str(run)!r}, "
        "snapshot_code=True)\n"
    )
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "MASTER_"))}
    env = {**base, "PYTHONPATH": os.pathsep.join([str(src), str(Path.cwd())]), "SNAP_GO": str(go)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    (src / "snapmod" / "entry.py").write_text("def main(ctx):\n    raise SystemExit('the code on disk ran')\n")
    (src / "snapmod" / "marker.py").write_text('MARKER = "new"\n')
    go.touch()
    assert wait_done(run)["state"] == "COMPLETED", hpc("status", str(run)).stdout
    assert (run / "markers.txt").read_text().startswith("MARKER=old restart=0 ")
    assert [c["name"] for c in read_provenance(run)["code"]] == ["hpc_hsdp", "snapmod"]


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_snapshot_swapped_before_the_job_starts_fails_the_job_in_one_line_and_is_not_imported(tmp_path, local_submit):
    """Issue 43: code/ was first on PYTHONPATH and nothing checked it; renaming it needs only write
    access to the run directory. The job checks it against the SHA-256 its script carries."""
    src, run, go, marker = tmp_path / "src", tmp_path / "run", tmp_path / "go", tmp_path / "pwned"
    package(src)
    hold = f"while [ ! -e {go} ]; do sleep 0.2; done"  # the job waits here, before its code is checked
    argv = local_submit(run, "--entry", "snapmod.entry:main", "--snapshot-code", "--setup", hold,
                        gpus_per_node=1, shard=1, device=None)  # fmt: skip
    env = {"PYTHONPATH": str(src), "SNAP_GO": str(go), "HPC_HSDP_CODE_CACHE": str(tmp_path / "code-cache")}
    out = hpc(*argv, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert oct((run / "code").stat().st_mode & 0o777) == "0o700"
    (run / "code").rename(run / "code.submitted")  # another user with write access to the run directory
    shutil.copytree(run / "code.submitted", run / "code")
    (run / "code" / "snapmod" / "entry.py").write_text(f"def main(ctx):\n    open({str(marker)!r}, 'w').close()\n")
    go.touch()
    assert wait_done(run)["state"] == "FAILED"
    assert not marker.exists() and not (run / "markers.txt").exists()
    said = [line for p in (run / "logs").glob("*.err") for line in p.read_text().splitlines() if "snapshot" in line]
    assert len(said) == 1 and "is not the code submit copied" in said[0], said
