"""``--eval-job``: the placeholders and their quoting, the once-per-step records, the wrapper's
result parsing, and evals files that may be hostile (no traceback from status or report)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from hpc_hsdp.batch_shell import eval_job
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.report.data import load_run
from hpc_hsdp.report.html import render_html
from hpc_hsdp.rundir.training import evals
from hpc_hsdp.rundir.training.evals import claim, last_json_object, read_evals, steps_to_submit, substitute
from hpc_hsdp.scheduler.backends.slurm import SlurmBackend, side_job_sbatch
from hpc_hsdp.scheduler.backends.slurm_command import SchedulerTimeout

HOSTILE = '/runs/it\'s a "run" $(touch /tmp/pwned) `id` ;rm -rf /\n'


def test_placeholders_are_replaced_by_shell_quoted_values_and_other_braces_are_left():
    command = "eval.py --ckpt {checkpoint} --step {step} --out {result} --dir={run_dir} ${HOME} {other} {{step}}"
    got = substitute(command, checkpoint=HOSTILE + "/ckpt", step=12, run_dir=HOSTILE, result="/r/x.json")
    words = shlex.split(got)
    assert words[:7] == ["eval.py", "--ckpt", HOSTILE + "/ckpt", "--step", "12", "--out", "/r/x.json"]
    assert words[7] == f"--dir={HOSTILE}"
    assert "${HOME}" in got and "{other}" in got  # the shell's and unknown names untouched
    assert words[-1] == "{12}"  # braces around a placeholder stay braces


def test_the_wrapper_argv_carries_the_substituted_command_as_one_word(tmp_path):
    run = str(tmp_path / "run $(x)")
    argv = eval_job.wrapper_argv(run, 4, "python ev.py {checkpoint} {step}", python="/py")
    assert argv[:6] == ["/py", "-m", "hpc_hsdp.batch_shell.eval_job", run, "4", "--"]
    assert shlex.split(argv[6]) == ["python", "ev.py", f"{run}/checkpoints/step-000004", "4"]


def test_sbatch_of_an_eval_job_one_node_the_jobs_partition_and_account_output_in_evals(tmp_path):
    run = str(tmp_path / "r 1")
    job_env = {"SLURM_JOB_ID": "7", "SLURM_JOB_PARTITION": "gpu", "SLURM_JOB_ACCOUNT": "proj'x", "PATH": str(tmp_path)}
    sbatch = tmp_path / "sbatch"
    sbatch.write_text("#!/bin/sh\n")
    sbatch.chmod(0o755)
    calls = []

    def runner(argv, env=None):
        calls.append((list(argv), env))
        return subprocess.CompletedProcess(argv, 0, "4242;cluster\n", "")

    monkeypatch_env = {"PATH": "/bin", "PYTHONPATH": "x"}
    argv = eval_job.wrapper_argv(run, 6, "ev {checkpoint}", python="/py")
    answer = SlurmBackend(runner=runner).submit_side_job(
        argv, name="eval-step-6", output=evals.output_path(run, 6), env=monkeypatch_env, job_env=job_env
    )
    assert answer == ("4242", None)
    ((sent, env),) = calls
    assert env == monkeypatch_env
    assert sent[:5] == ["sbatch", "--parsable", "--nodes=1", "--ntasks=1", "--job-name=eval-step-6"]
    assert "--output=/dev/null" in sent  # the wrapper writes evals/step-6.out itself, never through a symlink
    assert "--partition=gpu" in sent and "--account=proj'x" in sent
    wrapped = shlex.split(sent[sent.index("--wrap") + 1])
    assert wrapped[:6] == ["/py", "-m", "hpc_hsdp.batch_shell.eval_job", run, "6", "--"]
    assert shlex.split(wrapped[6]) == ["ev", f"{run}/checkpoints/step-000006"]
    refused = SlurmBackend(runner=lambda argv, env=None: subprocess.CompletedProcess(argv, 1, "", "sbatch: error: x\n"))
    got = refused.submit_side_job(argv, name="e", output=tmp_path / "o", env={}, job_env=job_env)
    assert got == (None, "sbatch failed: sbatch: error: x")

    def timeout(argv, env=None):
        raise SchedulerTimeout("slurmctld did not answer sbatch within 10 s", command="sbatch", timeout_s=10)

    got = SlurmBackend(runner=timeout).submit_side_job(argv, name="e", output=tmp_path / "o", env={}, job_env=job_env)
    assert got == (None, "slurmctld did not answer sbatch within 10 s")
    plain = side_job_sbatch(argv, name="e", job_env={})
    assert not any(a.startswith("--partition") for a in plain)


def test_the_eval_job_gets_no_slurm_or_rank_variables_of_the_training_job():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "8",
        "SLURM_CONF": "/etc/slurm.conf",
        "SBATCH_PARTITION": "x",
        "RANK": "0",
        "MASTER_ADDR": "n1",
        "HPC_HSDP_FAULT_STEP_DELAY_S": "1",
        "HPC_HSDP_SLURM_TIMEOUT": "5",
        "PATH": "/bin",
        "PYTHONPATH": "/a",
    }
    out = eval_job.eval_environment(env)
    assert set(out) == {"SLURM_CONF", "HPC_HSDP_SLURM_TIMEOUT", "PATH", "PYTHONPATH"}
    root = str(Path(eval_job.__file__).resolve().parents[2])
    assert out["PYTHONPATH"].split(os.pathsep) == [root, "/a"]


@pytest.mark.parametrize("command", ["", "   ", "a\0b", "x" * 9000])
def test_an_eval_command_that_cannot_run_is_refused_in_one_line(command):
    with pytest.raises(SpecError) as err:
        TrainingSpec.of(eval_job=command)
    assert "--eval-job" in str(err.value) and "\n" not in str(err.value)


# ----------------------------------------------------------------------------- once per step


@pytest.mark.parametrize(
    ("checkpoints", "recorded", "every", "due"),
    [
        ([2, 4, 6], [], 2, [2, 4, 6]),  # a fresh run
        ([4, 6], [2, 4], 2, [6]),  # resumed: 2 was pruned, 4 submitted before the requeue
        ([6, 2, 4], [6], 2, [2, 4]),  # oldest first
        ([2, 4], [2, 4, 8], 2, []),  # every step has a record (whatever its state): nothing again
        ([], [2], 2, []),
        ([2, 3, 4], [2], 2, [4]),  # 3: saved on a stop signal, off the cadence: no eval
        ([3, 6], [], 0, [6]),  # no periodic checkpoints: the last step's only
        ([5, 10], [], 5, [5, 10]),
    ],
)
def test_the_steps_to_submit_are_the_complete_checkpoints_of_the_cadence_without_a_record(
    checkpoints, recorded, every, due
):
    assert steps_to_submit(checkpoints, recorded, every=every, last=6 if every != 5 else 10) == due


def _checkpoint(run: Path, step: int, complete: bool = True) -> None:
    path = run / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True)
    if complete:
        (path / "COMPLETE").write_text(f"step {step}\n")


@pytest.mark.parametrize(
    ("before", "outcomes", "submitted", "states"),
    [
        # step: the record it had before (None: none) | what a submission answers | submitted | states after
        ({2: None, 4: None}, {2: "11", 4: "12"}, [2, 4], {2: "submitted", 4: "submitted"}),
        ({2: "submitted", 4: None}, {4: "12"}, [4], {2: "submitted", 4: "submitted"}),
        ({2: "submit-failed", 4: "submitting"}, {}, [], {2: "submit-failed", 4: "submitting"}),
        ({2: None, 4: None}, {2: None, 4: "12"}, [2, 4], {2: "submit-failed", 4: "submitted"}),
    ],
)
def test_submit_due_submits_each_step_once_and_records_the_outcome(
    tmp_path, monkeypatch, before, outcomes, submitted, states
):
    run = tmp_path / "run"
    for step, state in before.items():
        _checkpoint(run, step)
        if state is not None:
            (run / "evals").mkdir(exist_ok=True)
            (run / "evals" / f"step-{step}.json").write_text(json.dumps({"step": step, "state": state}))
    _checkpoint(run, 6, complete=False)  # not complete: never
    calls = []

    def fake_submit(run_dir, step, command, env):
        calls.append(step)
        job = outcomes[step]
        return (job, None) if job else (None, "sbatch failed: no partition")

    monkeypatch.setattr(eval_job, "submit_one", fake_submit)
    eval_job.submit_due(run, "ev {checkpoint}", every=2, last=10, env={})
    assert calls == submitted
    assert {e.step: e.state for e in read_evals(run)} == states
    eval_job.submit_due(run, "ev {checkpoint}", every=2, last=10, env={})  # a requeue, a resubmit: nothing twice
    assert calls == submitted
    failed = [e for e in read_evals(run) if e.state == "submit-failed" and e.step in submitted]
    assert all(e.reason == "sbatch failed: no partition" for e in failed)


def test_claim_is_exclusive(tmp_path):
    assert claim(tmp_path, 3) and not claim(tmp_path, 3)
    assert read_evals(tmp_path)[0].state == "submitting"


# ----------------------------------------------------------------------------- the wrapper's result


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ('loading\n{"acc": 0.5}\n', {"acc": 0.5}),
        ('{"acc": 0.1}\nstep 3 done\n{"acc": 0.7, "loss": 2}\nbye\n', {"acc": 0.7, "loss": 2}),
        ('{"acc": 0.7}\n{"acc": NaN}\n', {"acc": 0.7}),  # not a finite number: not a result
        ('{"acc": 0.7}\n[1, 2]\n{broken\n', {"acc": 0.7}),
        ('  {"nested": {"a": [1]}}  \r\n', {"nested": {"a": [1]}}),
        ("no json at all\n", None),
        ("", None),
        ('{"a": 1} trailing\n', None),
        ("[" * 5000 + "]" * 5000 + "\n", None),
    ],
)
def test_the_last_json_object_line_is_the_result(output, expected):
    assert last_json_object(output) == expected


def test_a_result_file_wins_over_the_printed_line_and_must_hold_an_object(tmp_path):
    file = tmp_path / "m.json"
    assert eval_job.result_of('{"a": 1}\n', file) == ({"a": 1}, None)
    assert eval_job.result_of("nothing\n", file) == (None, "it printed no JSON object line")
    file.write_text('{"b": 2}')
    assert eval_job.result_of('{"a": 1}\n', file) == ({"b": 2}, None)
    file.write_text("[1]")
    metrics, why = eval_job.result_of('{"a": 1}\n', file)
    assert metrics is None and "no JSON object" in why
    file.unlink()
    file.symlink_to("/etc/passwd")
    metrics, why = eval_job.result_of('{"a": 1}\n', file)
    assert metrics is None and "symlink" in why


# ----------------------------------------------------------------------------- hostile evals files


def test_hostile_evals_files_give_lines_not_tracebacks(tmp_path):
    run = tmp_path / "run"
    ev = run / "evals"
    ev.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 3.0 - s / 10}) + "\n" for s in (1, 2, 3, 4, 5))
    )
    (ev / "step-1.json").write_text('{"step": 1, "state": "submitted", "job_id": "<script>"}')
    (ev / "step-1.result.json").write_text(
        json.dumps({"state": "done", "exit_code": 0, "metrics": {"acc": 0.5, "flag": True, "txt": "x", "big": 1e308}})
    )
    (ev / "step-2.json").write_text("garbage{")
    (ev / "step-3.json").symlink_to("/etc/passwd")
    (ev / "step-4.json").write_text("x" * (evals.MAX_RECORD_BYTES + 10))
    (ev / "step-5.json").write_text('{"step": 5, "state": "submitted"}')
    (ev / "step-5.result.json").write_text('{"state": "failed", "exit_code": 10000000000000000000, "metrics": [1]}')
    (ev / "step-6.json").write_text('{"state": "submitted"}')
    (ev / "step-6.result.json").write_text("[" * 100000)
    (ev / "step-7.json").write_text('{"state": "exploded"}')
    os.mkfifo(ev / "step-8.json")
    (ev / "step-99999999999999.json").write_text("{}")  # too long a number: not a step record
    (ev / "notes.txt").write_text("hi")
    entries = read_evals(run)
    states = {e.step: e.state for e in entries}
    assert states == {
        1: "done",
        2: "unreadable",
        3: "unreadable",
        4: "unreadable",
        5: "failed",
        6: "submitted",
        7: "unreadable",
        8: "unreadable",
    }
    one = entries[0]
    assert one.metrics == {"acc": 0.5} and one.job_id == "<script>"
    assert entries[4].exit_code is None and entries[4].metrics == {}
    assert all("\n" not in e.words() for e in entries)
    html = render_html([load_run(run)])
    assert "eval jobs" in html and "&lt;script&gt;" in html and "<script>" not in html
    assert "eval job: acc" in html
    assert evals.evals_summary(entries) == "8 eval jobs: 1 done, 5 unreadable, 1 failed, 1 submitted"


def test_a_run_without_evals_has_no_eval_chart(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    run = load_run(tmp_path)
    assert run.evals == [] and "eval jobs" not in render_html([run])


@pytest.mark.parametrize("run", ["/tmp/run", "/tmp/run $(x)", '/tmp/it\'s a "run"', "/tmp/back\\slash dir"])
def test_the_emulator_reads_a_quoted_output_path_as_sbatch_does(run):
    """The emulator's batch output goes where ``#SBATCH --output`` says, a quoted path with spaces
    too (before, it fell back to slurm-JOB.out in the submitting directory)."""
    from hpc_hsdp.scheduler.emulator.slurm_patterns import sbatch_value  # noqa: PLC0415
    from hpc_hsdp.submit_host.render import sbatch_quote  # noqa: PLC0415

    script = f"#!/bin/bash\n#SBATCH --output={sbatch_quote(run + '/logs/%j.out')}\n#SBATCH --nodes=1\n"
    assert sbatch_value(script, "output") == run + "/logs/%j.out"
    assert sbatch_value(script, "nodes") == "1" and sbatch_value(script, "error") is None
