"""``--precision fp8`` on the real dev cluster's partitions: untyped GPUs are unknown and go on, a
partition of older GPUs is refused with no job, a constraint picks the nodes whose GPUs count."""

from __future__ import annotations

import os
import subprocess

import pytest
from cluster_helpers import hpc

from hpc_hsdp.plan.float8_support import fp8_slurm_refusal
from hpc_hsdp.scheduler.backends.slurm import slurm_gpu_nodes
from hpc_hsdp.submit_host.api import api_job_spec

# ----------------------------------------------------------------------------- the real dev cluster


def _jobs_named(name: str) -> set[str]:
    """Every job of the last hour named ``name``, queued or ended (squeue and sacct)."""
    queued = subprocess.run(["squeue", "-h", "-n", name, "-o", "%i"], capture_output=True, text=True, timeout=30)
    shown = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-a", "-S", "now-1hours", "--name", name, "-o", "JobID"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert queued.returncode == 0 and shown.returncode == 0, queued.stderr + shown.stderr
    return set(queued.stdout.split()) | set(shown.stdout.split())


def _set_features(nodes: str, features: str) -> None:
    for args in (["AvailableFeatures=" + features, "ActiveFeatures=" + features],):
        done = subprocess.run(["scontrol", "update", f"NodeName={nodes}", *args], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


@pytest.fixture
def site_gpu_features(slurm_cluster):
    """The 'site' partition's nodes named by their GPUs as many sites do (untyped ``gpu:8``
    GRES and the type a node feature): site1 an A100 node, site2 another; put back after."""
    before = subprocess.run(["sinfo", "-h", "-N", "-p", "site", "-o", "%N|%f"], capture_output=True, text=True).stdout
    assert before and all(line.endswith("|(null)") for line in before.split()), before  # the shape this test restores
    try:
        yield _set_features
    finally:
        _set_features("site[1-2]", "")


@pytest.mark.slurm
def test_the_dev_clusters_untyped_gpus_are_unknown_and_go_on(slurm_cluster, tmp_path):
    found = slurm_gpu_nodes(api_job_spec({"shard": 1, "precision": "fp8"}, environ={}, cwd=tmp_path, default_venv=None))
    nodes, where = found
    assert where == "the default partition 'debug'" and {n.node for n in nodes} == {"n1", "n2", "n3"}
    assert all(n.gpus == ((None, 8),) for n in nodes)
    assert fp8_slurm_refusal(nodes, where=where) is None  # unknown type: each task decides at its start


@pytest.mark.slurm
@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_submit_to_a_partition_of_older_gpus_refuses_fp8_with_no_job(site_gpu_features, tmp_path, device):
    site_gpu_features("site[1-2]", "a100,ib")
    run_dir = tmp_path / "run"
    name = f"fp8-refused-{device}-{os.getpid()}"  # other tests submit meanwhile: look for this job only
    argv = ["submit", "--cluster", "slurm", "--partition", "site", "--shard", "1", "--precision", "fp8"]
    argv += ["--job-name", name]
    out = hpc(*argv, "--device", device, "--run-dir", str(run_dir), timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "partition 'site' has only a100 (8.0): use --precision bf16" in out.stderr, out.stderr
    assert not run_dir.exists()
    assert _jobs_named(name) == set()


@pytest.mark.slurm
def test_a_constraint_picks_the_nodes_whose_gpus_count(site_gpu_features, tmp_path):
    site_gpu_features("site1", "a100")
    site_gpu_features("site2", "h100")

    def verdict(**options):
        spec = api_job_spec(
            {"shard": 1, "precision": "fp8", "partition": "site", **options},
            environ={},
            cwd=tmp_path,
            default_venv=None,
        )
        nodes, where = slurm_gpu_nodes(spec)
        return fp8_slurm_refusal(nodes, where=where)

    assert verdict() is None  # site2's H100 may run it
    assert "partition 'site' with --constraint 'a100' has only a100 (8.0)" in verdict(constraint="a100")
    assert verdict(constraint="h100") is None
    assert "(exclude site2) has only a100" in verdict(sbatch={"exclude": "site2"})
    assert verdict(sbatch={"nodelist": "site2"}) is None
