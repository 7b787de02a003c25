"""The nodes' switches on the real dev cluster (topology/tree: n1, n2 under leaf1, n3 under leaf2,
both under spine): SLURM itself gives each task its SLURM_TOPOLOGY_ADDR and the batch script its
``scontrol show topology``; layout.json names each rank's switch; ``--switches 1`` reaches sbatch
and keeps a shard group spanning nodes under one leaf; ``--topology strict`` refuses a job whose
shard group must cross leaves, in its batch shell, before training."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cluster_helpers import hpc as cluster_hpc

from tests.job_helpers import tiny_job

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

TINY = tiny_job(width=16, heads=2, batch_size=1, vocab_size=None, device="cpu")
PROBE = '''
import json, os
from pathlib import Path

def main(ctx):
    """Each rank: what SLURM told its task, and where its layout put it."""
    record = {
        "addr": os.environ.get("SLURM_TOPOLOGY_ADDR"),
        "pattern": os.environ.get("SLURM_TOPOLOGY_ADDR_PATTERN"),
        "node": ctx.layout.node,
        "node_switch": ctx.layout.node_switch,
        "exported": os.environ.get("HPC_HSDP_NODE_SWITCHES"),
    }
    Path(os.environ["PROBE_DIR"], f"rank{ctx.rank}.json").write_text(json.dumps(record))
'''


def hpc(*args: str, tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    (tmp_path / "switch_probe.py").write_text(PROBE)
    (tmp_path / "probe").mkdir(exist_ok=True)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "PROBE_DIR": str(tmp_path / "probe"), "OMP_NUM_THREADS": "1"}
    return cluster_hpc("submit", "--cluster", "slurm", "--wait", *args, env=env, timeout=timeout)


def _job_id(out: subprocess.CompletedProcess) -> str:
    return next(w for line in out.stdout.splitlines() if "submitted job" in line for w in line.split() if w.isdigit())


def _batch_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs").glob("*_0_log.*")))


def _probes(tmp_path: Path) -> list[dict]:
    files = sorted((tmp_path / "probe").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


def test_a_job_over_two_leaves_names_each_ranks_switch(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    argv = ["--nodes", "3", "--gpus-per-node", "2", "--shard", "2", "--run-dir", str(run), "--steps", "1"]
    out = hpc(*argv, *TINY, "--entry", "switch_probe:main", tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr + _batch_log(run)
    assert "hpc-hsdp: node switches: spine.leaf1:n[1-2];spine.leaf2:n3" in _batch_log(run)
    layout = json.loads((run / "layout.json").read_text())
    plan = layout["plan"]
    assert plan["node_names"] == ["n1", "n2", "n3"] and plan["node_switches"] == ["leaf1", "leaf1", "leaf2"]
    assert plan["shard_groups_cross_switches"] is False and plan["replicate_groups"] == [[0, 2, 4], [1, 3, 5]]
    ranks = sorted(layout["ranks"], key=lambda r: r["rank"])
    assert [(r["node"], r["node_switch"]) for r in ranks] == [
        ("n1", "leaf1"),
        ("n1", "leaf1"),
        ("n2", "leaf1"),
        ("n2", "leaf1"),
        ("n3", "leaf2"),
        ("n3", "leaf2"),
    ]
    probes = _probes(tmp_path)
    assert len(probes) == 6
    for probe in probes:  # SLURM's own word on each task agrees with scontrol's, as the layout used it
        assert probe["pattern"] == "switch.switch.node"
        assert probe["addr"] == f"spine.{probe['node_switch']}.{probe['node']}"
        assert probe["exported"] == "spine.leaf1:n[1-2];spine.leaf2:n3"


def test_switches_1_reaches_sbatch_and_keeps_a_cross_node_shard_group_under_one_leaf(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    argv = ["--nodes", "2", "--gpus-per-node", "2", "--shard", "4", "--run-dir", str(run), "--steps", "1"]
    out = hpc(*argv, *TINY, "--switches", "1@2:00", "--topology", "strict", tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr + _batch_log(run)
    script = next((run / "logs").glob("*_submission.sh"), None) or next((run / "logs").glob("*.sh"))
    assert "#SBATCH --switches=1@2:00\n" in script.read_text()
    shown = subprocess.run(["scontrol", "-o", "show", "job", _job_id(out)], capture_output=True, text=True).stdout
    assert "Switches=1@00:02:00" in shown, shown  # what SLURM took from the script
    layout = json.loads((run / "layout.json").read_text())
    assert layout["plan"]["shard_groups"] == [[0, 1, 2, 3]]
    assert layout["plan"]["node_switches"] == ["leaf1", "leaf1"]  # n1, n2: the one leaf with two nodes
    assert layout["plan"]["shard_groups_cross_switches"] is False
    assert {r["node_switch"] for r in layout["ranks"]} == {"leaf1"}


def test_strict_refuses_a_shard_group_across_leaves_before_training(slurm_cluster, tmp_path):
    run = tmp_path / "run"
    argv = ["--nodes", "3", "--gpus-per-node", "2", "--shard", "6", "--run-dir", str(run), "--steps", "1"]
    out = hpc(*argv, *TINY, "--topology", "strict", tmp_path=tmp_path)
    assert out.returncode != 0 and "FAILED" in out.stderr, out.stdout + out.stderr
    log = _batch_log(run)
    refusals = [line for line in log.splitlines() if "--topology strict" in line]
    assert len(refusals) == 1, log
    assert "shard group 0 (ranks 0-5 on n1,n2,n3 under leaf1,leaf2) must cross leaf switches" in refusals[0]
    assert "(--switches 1)" in refusals[0]
    assert not (run / "layout.json").exists() and not (run / "metrics.jsonl").exists()
