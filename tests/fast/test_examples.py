"""The rendered examples in sbatch/ are up to date (regenerate: python -m hpc_hsdp.cli.examples)."""

from __future__ import annotations

from hpc_hsdp.cli.examples import REGENERATE, REPO, generated_files, stale_files


def test_examples_are_current() -> None:
    stale = [str(p.relative_to(REPO)) for p in stale_files()]
    assert not stale, f"stale rendered examples {stale}; regenerate with: {REGENERATE}"


def test_examples_cover_the_acceptance_cases() -> None:
    names = {p.name for p in generated_files()}
    assert {
        "thread-2x8-shard4.sbatch",
        "cross-node-4x8-shard16.sbatch",
        "torchrun-2x8-shard4.sbatch",
        "profile-h100-2x8-shard8.sbatch",
        "README.md",
    } <= names
    thread = (REPO / "sbatch" / "thread-2x8-shard4.sbatch").read_text()
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=8\n#SBATCH --gpus-per-node=8\n" in thread
    assert "mesh (replicate=4, shard=4)" in thread
