"""What render and submit can know before the job: the global batch splits over the data-parallel
ranks, numbers are finite and in range (issue 38). Each refused in one line, exit 2, nothing written."""

from __future__ import annotations

import pytest

from hpc_hsdp.cli import main

BASE = ["--nodes", "2", "--gpus-per-node", "8", "--shard", "4", "--venv", "none"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--global-batch-size", "60"], "--global-batch-size 60 is not divisible by 16 data-parallel ranks"),
        (
            ["--tp", "2", "--global-batch-size", "12"],
            "is not divisible by 8 data-parallel ranks (the 16 ranks over --tp 2) x --grad-accum 1 = 8",
        ),
        (["--global-batch-size", "32", "--grad-accum", "4"], "16 data-parallel ranks x --grad-accum 4 = 64"),
        (["--lr", "inf"], "--lr inf must be a finite number"),
        (["--lr", "nan"], "--lr nan must be a finite number"),
        (["--timeout", "9999999999999999999"], "--timeout 9999999999999999999 must be at most 604800"),
        (["--steps", "99999999999999999999"], "--steps 99999999999999999999 is out of range"),
    ],
)
@pytest.mark.parametrize("command", ["render", "submit"])
def test_refused_before_anything_is_written(tmp_path, capsys, command, extra, message):
    run_dir, script = tmp_path / "run", tmp_path / "job.sbatch"
    argv = [command, *BASE, "--run-dir", str(run_dir), *extra]
    argv += ["-o", str(script)] if command == "render" else ["--cluster", "local"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert err.count("\n") == 1 and message in err, err
    assert not run_dir.exists() and not script.exists()


@pytest.mark.parametrize("extra", [["--global-batch-size", "64"], ["--tp", "2", "--global-batch-size", "16"]])
def test_a_global_batch_that_splits_renders(tmp_path, capsys, extra):
    with pytest.raises(SystemExit) as exc:
        main(["render", *BASE, "--run-dir", str(tmp_path / "run"), *extra])
    assert exc.value.code == 0 and "#SBATCH" in capsys.readouterr().out
