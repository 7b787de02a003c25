"""Golden outputs of ``hpc-hsdp plan`` without tensor parallelism (text, --json, --svg, estimates,
--recommend): adding ``--tp`` must leave every T = 1 output byte-identical.

Regenerate after an intended change:  HPC_HSDP_REGEN_GOLDEN=1 pytest tests/fast/test_plan_golden.py
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_hsdp.cli import cli

GOLDEN = Path(__file__).parents[1] / "golden" / "plan"
REGEN = os.environ.get("HPC_HSDP_REGEN_GOLDEN") == "1"

CASES = {
    "thread-2x8-shard4.txt": ["--nodes", "2", "--gpus-per-node", "8", "--shard", "4"],
    "thread-2x8-shard4-tp1.txt": ["--nodes", "2", "--gpus-per-node", "8", "--shard", "4", "--tp", "1"],
    "thread-2x8-shard4.json": ["--nodes", "2", "--gpus-per-node", "8", "--shard", "4", "--json"],
    "named-uneven.txt": ["--nodelist", "gpu-a[01-02]", "--tasks-per-node", "8,4", "--shard", "4"],
    "cross-4x8-shard16-7b.txt": [
        "--nodes", "4", "--shard", "16", "--model-params", "7B", "--precision", "bf16", "--gpu-memory", "80GiB",
    ],
    "cross-4x8-shard16-7b.json": [
        "--nodes", "4", "--shard", "16", "--model-params", "7B", "--precision", "bf16", "--gpu-memory", "80GiB",
        "--json",
    ],
    "2x8-shard8-7b-accum4.txt": ["--nodes", "2", "--shard", "8", "--model-params", "7B", "--grad-accum", "4"],
    "builtin-2x8-shard4.txt": ["--nodes", "2", "--shard", "4", "--model-params", "builtin:layers=4,width=128"],
    "recommend-2x8-7b.txt": ["--nodes", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB"],
    "recommend-2x8-7b.json": [
        "--nodes", "2", "--recommend", "--model-params", "7B", "--gpu-memory", "80GiB", "--json",
    ],
    "recommend-4x8-70b.txt": ["--nodes", "4", "--recommend", "--model-params", "70B", "--gpu-memory", "80GiB"],
    "512x8-shard8.txt": ["--nodes", "512", "--shard", "8"],
    "switches-4x8-shard16.txt": [
        "--nodes", "4", "--shard", "16", "--node-switches", "spine.leaf1:n[1,3];spine.leaf2:n[2,4]",
    ],
}  # fmt: skip


def _check(name: str, text: str) -> None:
    path = GOLDEN / name
    if REGEN:
        path.write_text(text)
        return
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), name, "now"))
        pytest.fail(f"plan output {name} changed (HPC_HSDP_REGEN_GOLDEN=1 if intended):\n{diff}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_output_is_unchanged(name):
    result = CliRunner().invoke(cli, ["plan", *CASES[name]])
    assert result.exit_code == 0, result.output
    _check(name, result.output)


def test_plan_svg_is_unchanged(tmp_path):
    path = tmp_path / "layout.svg"
    result = CliRunner().invoke(cli, ["plan", "--nodes", "2", "--shard", "4", "--svg", str(path)])
    assert result.exit_code == 0, result.output
    _check("thread-2x8-shard4.svg", path.read_text())
