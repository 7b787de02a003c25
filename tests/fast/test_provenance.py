"""What produced a run (hpc_hsdp.rundir.lifecycle.provenance_record, hpc_hsdp.submit_host.provenance): the record's
readers and words, the code a job runs, --snapshot-code's copy, its script lines, `runs`' CODE
column. The git parts (a process each) are in tests/processes/test_snapshot_code.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpc_hsdp.cli import cli
from hpc_hsdp.cli.examples import spec_from_argv
from hpc_hsdp.errors import SpecError
from hpc_hsdp.rundir.lifecycle.provenance_record import (
    code_words,
    commit_id,
    differences,
    read_provenance,
    read_task_provenance,
    task_words,
    write_provenance,
)
from hpc_hsdp.submit_host import provenance as gather
from hpc_hsdp.submit_host.render import render_sbatch

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def record(commit=COMMIT, *, dirty=False, diff_sha="abcd" * 16, packages=None, snapshot=None) -> dict:
    entry = {"name": "hpc_hsdp", "path": "/src/hpc-hsdp/hpc_hsdp", "checkout": "/src/hpc-hsdp", "commit": commit}
    if dirty:
        entry |= {"dirty": True, "diff": "diff --git a/x b/x\n", "diff_sha256": diff_sha}
    return {
        "job_id": "7",
        "python": {"version": "3.11.7"},
        "code": [entry, {"name": "mymodel", "path": "/elsewhere/mymodel.py"}],
        "packages": packages if packages is not None else {"torch": "2.5.1", "numpy": "2.1.0"},
        "snapshot": snapshot,
    }


def spec(*argv: str):
    return spec_from_argv(["--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--run-dir", "/runs/a", *argv])


# ----------------------------------------------------------------------------- the record's words


def test_status_and_report_name_the_commit_and_say_uncommitted_changes():
    assert code_words(record()) == f"{COMMIT[:10]} (/src/hpc-hsdp: hpc_hsdp); not in a git checkout: mymodel"
    words = code_words(record(dirty=True, snapshot={"dir": "code"}))
    assert words.startswith(f"{COMMIT[:10]} + uncommitted changes (/src/hpc-hsdp: hpc_hsdp)")
    assert words.endswith("runs the snapshot in code/ taken at submit")
    assert code_words(None) is None


def test_the_user_checkout_comes_first_and_modules_of_one_checkout_are_one_commit():
    rec = record()
    rec["code"] = [
        rec["code"][0],
        {"name": "mymodel", "path": "/p/mymodel", "checkout": "/p", "commit": OTHER},
        {"name": "mydata", "path": "/p/mydata", "checkout": "/p", "commit": OTHER},
    ]
    assert code_words(rec) == f"{OTHER[:10]} (/p: mymodel, mydata); {COMMIT[:10]} (/src/hpc-hsdp: hpc_hsdp)"
    assert commit_id(rec) == f"{OTHER[:10]},{COMMIT[:10]}"


def test_commit_id_tells_apart_two_dirty_trees_of_one_commit():
    clean, dirty_a, dirty_b = record(), record(dirty=True, diff_sha="a" * 64), record(dirty=True, diff_sha="b" * 64)
    assert commit_id(clean) == COMMIT[:10]
    assert commit_id(dirty_a) == COMMIT[:10] + "+aaaa" != commit_id(dirty_b)
    assert commit_id(None) is None


def test_differences_name_code_python_and_packages_that_differ():
    a = record(packages={"torch": "2.5.1", "numpy": "2.1.0"})
    b = record(OTHER, packages={"torch": "2.4.0", "numpy": "2.1.0", "extra": "1.0"})
    found = differences([a, b, None])
    assert found[0] == f"code (2 versions: {COMMIT[:10]}, {OTHER[:10]})"
    assert "torch (2.4.0, 2.5.1)" in found and "extra (1.0, none)" in found
    assert not any(f.startswith("numpy") for f in found)
    assert differences([a, record(packages=dict(a["packages"]))]) == []
    assert differences([a]) == []


def test_task_words():
    assert task_words({"torch": "2.5.1", "cuda": "12.4", "nccl": "2.21.5", "python": "3.11.7"}) == (
        "torch 2.5.1, CUDA 12.4, NCCL 2.21.5, Python 3.11.7"
    )
    assert task_words({"torch": "2.5.1+cpu", "cuda": None, "nccl": None}) == "torch 2.5.1+cpu"


# ----------------------------------------------------------------------------- reading: hostile files


def test_the_records_are_read_as_regular_files_only(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(record()))
    (run / "provenance.json").symlink_to(secret)
    (run / "task_provenance.json").symlink_to(secret)
    assert read_provenance(run) is None and read_task_provenance(run) is None
    (run / "provenance.json").unlink()
    os.mkfifo(run / "provenance.json")
    assert read_provenance(run) is None  # a FIFO does not block the reader


def test_damaged_records_are_no_answer_and_wrong_types_are_dropped(tmp_path):
    for text in ("{", "[1, 2]", '{"code": 1e999}', "\xff"):
        (tmp_path / "provenance.json").write_text(text, errors="surrogateescape")
        assert read_provenance(tmp_path) is None, text
    bad = {
        "code": [{"name": 1}, "x", {"name": "ok", "commit": 5, "dirty": "yes"}],
        "packages": {"torch": 2, "numpy": "2.1"},
    }
    (tmp_path / "provenance.json").write_text(json.dumps(bad))
    got = read_provenance(tmp_path)
    assert got["code"] == [{"name": "ok", "dirty": False, "diff_truncated": False, "untracked": []}]
    assert got["packages"] == {"numpy": "2.1"}
    assert code_words(got) == "not in a git checkout: ok"


def test_written_and_read_back(tmp_path):
    write_provenance(tmp_path, record(dirty=True))
    assert commit_id(read_provenance(tmp_path)) == COMMIT[:10] + "+abcd"


# ----------------------------------------------------------------------------- which code a job runs


def test_user_modules_come_from_entry_model_and_the_api_function():
    assert gather.user_modules(spec()) == []
    assert gather.user_modules(spec("--model", "hf:/models/gpt2")) == []
    assert gather.user_modules(spec("--entry", "mypkg.train:main", "--model", "models.zoo:build")) == [
        "mypkg",
        "models",
    ]
    assert gather.user_modules(spec("--entry", "hpc_hsdp.task.training.loop:main")) == []

    def fn(ctx):
        return ctx

    fn.__module__ = "project.jobs"
    assert gather.user_modules(spec("--entry", "project.x:main"), fn) == ["project"]
    fn.__module__ = "__main__"  # pickled by value: nothing to find
    assert gather.user_modules(spec(), fn) == []


def test_code_outside_a_checkout_costs_no_process(tmp_path, monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "run", no_process)
    (tmp_path / "mymodel.py").write_text("X = 1\n")
    assert gather.checkout_of(tmp_path / "mymodel.py") is None
    assert gather.code_record("mymodel", [tmp_path / "mymodel.py"], {}) == {
        "name": "mymodel",
        "path": str(tmp_path / "mymodel.py"),
    }
    installed = tmp_path / "repo" / ".venv" / "lib" / "site-packages" / "pkg"
    installed.mkdir(parents=True)
    (tmp_path / "repo" / ".git").mkdir()
    assert gather.checkout_of(installed) is None  # an installed copy inside a checkout is not its code
    assert gather.checkout_of(tmp_path / "repo") == tmp_path / "repo"


def test_installed_packages_are_read_off_the_metadata_directories(tmp_path, monkeypatch):
    first, later = tmp_path / "first", tmp_path / "later"
    (first / "Foo_Bar-1.2.3.dist-info").mkdir(parents=True)
    (first / "old-0.9-py3.11.egg-info").mkdir()
    (later / "foo_bar-9.9.dist-info").mkdir(parents=True)  # the first on sys.path wins, as imports do
    monkeypatch.setattr(sys, "path", [str(tmp_path / "missing"), str(first), str(later)])
    assert gather.installed_packages() == {"foo-bar": "1.2.3", "old": "0.9"}


def test_installed_packages_of_this_interpreter_are_quick_and_hold_click():
    import time

    started = time.perf_counter()
    found = gather.installed_packages()
    assert time.perf_counter() - started < 0.5
    assert "click" in found and "jinja2" in found


# ----------------------------------------------------------------------------- --snapshot-code


def test_snapshot_copies_the_package_and_the_user_module_without_caches(tmp_path, monkeypatch):
    src = tmp_path / "src"
    (src / "mypkg" / "__pycache__").mkdir(parents=True)
    (src / "mypkg" / "__init__.py").write_text("")
    (src / "mypkg" / "train.py").write_text("def main(ctx):\n    return 1\n")
    (src / "mypkg" / "__pycache__" / "train.cpython-311.pyc").write_bytes(b"x")
    (src / "models.py").write_text("def build():\n    pass\n")
    monkeypatch.syspath_prepend(str(src))
    run = tmp_path / "run"
    got = gather.snapshot_code(run, spec("--entry", "mypkg.train:main", "--model", "models:build"))
    assert got["modules"] == ["hpc_hsdp", "mypkg", "models"] and got["dir"] == "code"
    code = run / "code"
    assert (code / "mypkg" / "train.py").read_text() == "def main(ctx):\n    return 1\n"
    assert (code / "models.py").is_file()
    assert (code / "hpc_hsdp" / "submit_host" / "templates" / "job.sbatch.j2").is_file()
    assert (code / "hpc_hsdp" / "submit_host" / "provenance.py").is_file()
    assert not list(code.rglob("__pycache__")) and not list(code.rglob("*.pyc"))
    # a new submission replaces the copy: what is on disk then
    (src / "mypkg" / "train.py").write_text("def main(ctx):\n    return 2\n")
    gather.snapshot_code(run, spec("--entry", "mypkg.train:main"))
    assert "return 2" in (code / "mypkg" / "train.py").read_text()
    assert not (code / "models.py").exists()
    assert sorted(p.name for p in run.iterdir()) == ["code"]  # no staging left behind


def test_snapshot_refuses_a_module_it_cannot_find_and_code_too_large(tmp_path, monkeypatch):
    with pytest.raises(SpecError, match=r"--snapshot-code: module 'no_such_mod_xyz' cannot be found here"):
        gather.snapshot_code(tmp_path / "run", spec("--entry", "no_such_mod_xyz:main"))
    monkeypatch.setattr(gather, "MAX_SNAPSHOT_BYTES", 1000)
    with pytest.raises(SpecError, match=r"the code to copy passed 0 MiB; keep data out of the package"):
        gather.snapshot_code(tmp_path / "run", spec())
    assert not (tmp_path / "run" / "code").exists()


def test_the_script_runs_the_copy_first_on_every_attempt():
    plain = render_sbatch(spec())
    assert "PYTHONPATH" not in plain and "PYTHONSAFEPATH" not in plain
    script = render_sbatch(spec("--snapshot-code"), snapshot_sha256="ab" * 32)
    # checked by the installed hpc-hsdp (from /, not the working directory) into a private copy, which is imported
    check = f"HPC_HSDP_CODE_SNAPSHOT=$(cd / && python -m hpc_hsdp.batch_shell.code_snapshot /runs/a/code {'ab' * 32})"
    line = 'export PYTHONPATH="$HPC_HSDP_CODE_SNAPSHOT${PYTHONPATH:+:$PYTHONPATH}:$PWD"'
    assert check in script and line in script and "export PYTHONSAFEPATH=1" in script
    assert script.index(check) < script.index(line)
    # before the batch shell's first python (the rendezvous) and the launch
    assert script.index(line) < script.index("rendezvous=") < script.index("srun \\")


def test_snapshot_code_is_an_option_of_render_submit_config_and_the_api():
    from hpc_hsdp.job.options import OPTION_BY_KEY, options_of

    declared = OPTION_BY_KEY["snapshot_code"]
    assert declared.kind == "bool" and declared.default is False
    assert declared in options_of("render") and declared in options_of("submit")
    got = CliRunner().invoke(cli, ["render", "--nodes", "1", "--shard", "8", "--run-dir", "/r", "--snapshot-code"])
    # render copies no code: its script names code/ with no SHA-256, which the job refuses to import
    assert got.exit_code == 0 and "python -m hpc_hsdp.batch_shell.code_snapshot /r/code ''" in got.output, got.output


# ----------------------------------------------------------------------------- runs: where runs differ


def _run(path: Path, rec: dict | None) -> None:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    if rec is not None:
        write_provenance(path, rec)


def test_runs_shows_the_code_of_each_run_and_marks_where_they_differ(tmp_path):
    root = tmp_path / "runs"
    _run(root / "a", record())
    _run(root / "b", record())
    _run(root / "c", record(dirty=True, packages={"torch": "2.4.0", "numpy": "2.1.0"}))
    _run(root / "d", None)
    got = CliRunner().invoke(cli, ["runs", str(root)])
    assert got.exit_code == 0, got.output
    rows = {line.split()[0]: line for line in got.output.splitlines()[1:5]}
    assert got.output.splitlines()[0].split()[-1] == "CODE"
    assert rows["a"].endswith(COMMIT[:10]) and rows["b"].endswith(COMMIT[:10])
    assert rows["c"].endswith(f"{COMMIT[:10]}+abcd *") and rows["d"].endswith(" -")
    assert (
        f"the runs differ in: code (2 versions: {COMMIT[:10]}, {COMMIT[:10]}+abcd); torch (2.4.0, 2.5.1)" in got.output
    )


def test_runs_of_one_code_say_nothing_more(tmp_path):
    root = tmp_path / "runs"
    _run(root / "a", record())
    _run(root / "b", record())
    got = CliRunner().invoke(cli, ["runs", str(root)])
    assert got.exit_code == 0 and "differ" not in got.output and " *" not in got.output, got.output


def test_report_names_the_commit_in_its_table_heading_and_output(tmp_path):
    from hpc_hsdp.report.data import load_run
    from hpc_hsdp.report.figure import _heading
    from hpc_hsdp.report.html import render_html

    run = tmp_path / "run"
    _run(run, record(dirty=True))
    (run / "provenance.json").write_text((run / "provenance.json").read_text().replace("mymodel", "<b>x</b>"))
    loaded = load_run(run)
    html = render_html([loaded])
    assert (
        f"<td>{COMMIT[:10]} + uncommitted changes (/src/hpc-hsdp: hpc_hsdp); not in a git checkout: &lt;b&gt;x" in html
    )
    assert _heading([loaded]).endswith(f"; code {COMMIT[:10]}+abcd")
    got = CliRunner().invoke(cli, ["report", str(run), "-o", str(tmp_path / "r.html")])
    assert got.exit_code == 0 and f"run: code {COMMIT[:10]} + uncommitted changes" in got.output, got.output


def test_a_resubmission_keeps_what_the_earlier_submissions_ran(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    first = record()
    gather.record_submission(
        tmp_path, {**first, "submitted_at": 1.0e9}, job_id="7", script="#!/bin/bash\n", logs_dir=logs
    )
    assert read_provenance(tmp_path)["earlier"] == []
    assert (logs / "7_submission.sh").read_text() == "#!/bin/bash\n"  # written where the scheduler kept none
    same = read_provenance(tmp_path)
    assert code_words(same) == code_words(first)
    gather.record_submission(tmp_path, record(OTHER), job_id="8", script="#!/bin/bash\n", logs_dir=logs)
    again = read_provenance(tmp_path)
    assert again["job_id"] == "8" and again["script"] == "logs/8_submission.sh"
    assert again["earlier"] == [{"job_id": "7", "submitted_at": 1.0e9, "commit": COMMIT[:10]}]
    assert code_words(again).endswith(f"; earlier submissions of this run ran other code (job 7: {COMMIT[:10]})")
    gather.record_submission(tmp_path, record(OTHER), job_id="9", script="#!/bin/bash\n", logs_dir=logs)
    assert [e["job_id"] for e in read_provenance(tmp_path)["earlier"]] == ["7", "8"]
