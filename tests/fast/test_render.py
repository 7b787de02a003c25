"""hpc-hsdp render: quoting proven by running the script, #SBATCH parsing, -o, rejections, no torch."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hpc_hsdp.cli import main
from hpc_hsdp.cli.examples import REPO, spec_from_argv
from hpc_hsdp.cli.job_options import job_spec_from_options
from hpc_hsdp.cli.render_cmd import render
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import JobSpec, LaunchSpec, RunSpec, SchedulerSpec
from hpc_hsdp.plan.slurm_facts import time_limit_seconds
from hpc_hsdp.submit_host.render import default_launch_command, render_sbatch, sbatch_quote
from tests.render_helpers import HOSTILE

# ----------------------------------------------------------------------------- helpers


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the real entry point (``hpc_hsdp.cli.main``) in-process; (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def parse_sbatch_directive(line: str) -> list[str]:
    """Split the text after ``#SBATCH`` as sbatch 22.05 does (src/sbatch/opt.c, _get_argument):
    whitespace separates arguments, ' and " quote, a backslash escapes the next character,
    an unquoted # starts a comment."""
    args, i, n = [], 0, len(line)
    while True:
        while i < n and line[i].isspace():
            i += 1
        if i >= n:
            return args
        arg, quote, escape = "", None, False
        while i < n and (quote or not line[i].isspace()):
            c = line[i]
            if escape:
                escape = False
            elif c == "\\":
                escape, i = True, i + 1
                continue
            elif quote:
                if c == quote:
                    quote, i = None, i + 1
                    continue
            elif c in "\"'":
                quote, i = c, i + 1
                continue
            elif c == "#":
                return args + ([arg] if arg else [])
            arg += c
            i += 1
        args.append(arg)


def sbatch_arguments(script: str) -> list[str]:
    args = []
    for line in script.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            args += parse_sbatch_directive(line[len("#SBATCH") :])
        elif line.strip() and not line.startswith("#"):
            break
    return args


# ----------------------------------------------------------------------------- #SBATCH quoting

SBATCH_VALUES = [
    "plain",
    "a b",
    'x"; touch /tmp/pwned #',
    "it's",
    "$(id) `id`",
    "back\\slash",
    "#hash",
    "100%",
    "h100&ib|a100",
    "tab\there",
    "trailing\\",
    '"',
    "'",
    "",
]


@pytest.mark.parametrize("value", SBATCH_VALUES)
def test_sbatch_quote_reads_back_unchanged(value: str) -> None:
    assert parse_sbatch_directive(f" --comment={sbatch_quote(value)}") == [f"--comment={value}"]


@pytest.mark.parametrize("value", ["a\nb", "a\rb", "a\0b"])
def test_sbatch_quote_refuses_line_breaks(value: str) -> None:
    with pytest.raises(SpecError):
        sbatch_quote(value)


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed")
def test_real_sbatch_parses_the_hostile_header(tmp_path: Path) -> None:
    """sbatch 22.05 itself (-vvv prints each directive; a dummy config on a dead port; --test-only)."""
    script = tmp_path / "job.sbatch"
    text = render_sbatch(spec_from_argv(HOSTILE))
    script.write_text(text)
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=parse\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=1\nAuthType=auth/none\n"
        "NodeName=n1 CPUs=1\nPartitionName=debug Nodes=ALL Default=YES\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    proc = subprocess.Popen(
        ["sbatch", "-vvv", "--test-only", str(script)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    found = []
    try:
        for line in proc.stderr:
            marker = 'Found in script, argument "'
            if marker in line:
                found.append(line.split(marker, 1)[1].rstrip("\n")[:-1])
            if "end of defined options" in line or "fatal" in line:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if not found:
        pytest.skip("this sbatch does not print the directives it reads")
    assert found == sbatch_arguments(text)
    assert '--job-name=x"; touch /tmp/pwned #' in found
    assert '--comment=a "b" #c $(d) \\e' in found


# ----------------------------------------------------------------------------- running the script

STUB_PYTHON = r"""#!/bin/bash
if [ "$1" = -m ] && [ "$2" = hpc_hsdp ] && [ "$3" = layout ]; then
    case " $* " in
        *" rendezvous "*) echo "n1 29999" ;;
        *" master_addr "*) echo n1 ;;
        *" master_port "*) echo 29999 ;;
        *" node_rank "*) echo 0 ;;
        *" node_switches "*) echo "spine.leaf1:n[1-2]" ;;
        *) echo "stub python: unexpected layout call: $*" >&2; exit 3 ;;
    esac
    exit 0
fi
printf '%s\0' "$@" > "$(mktemp "$STUB_LOG/python.XXXXXX")"
env -0 > "$(mktemp "$STUB_LOG/python-env.XXXXXX")"
"""
STUB_SRUN = r"""#!/bin/bash
printf '%s\0' "$@" > "$(mktemp "$STUB_LOG/srun.XXXXXX")"
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done
exec "$@"
"""
STUB_TORCHRUN = r"""#!/bin/bash
printf '%s\0' "$@" > "$(mktemp "$STUB_LOG/torchrun.XXXXXX")"
"""


def _calls(log: Path, name: str) -> list[list[str]]:
    return [p.read_bytes().decode().split("\0")[:-1] for p in sorted(log.glob(f"{name}.*"))]


def _hostile_argv(tmp: Path, launcher: str) -> tuple[list[str], Path, Path]:
    pwned = tmp / "pwned"
    venv = tmp / "my venvs" / "it's $(touch pwned)"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("export FAKE_VENV_ACTIVE=yes\n")
    run_dir = tmp / f"run dir 'q' \"dq\" $(touch {pwned}) `touch {pwned}`; *"
    argv = [
        "--nodes",
        "2",
        "--shard",
        "4",
        "--launcher",
        launcher,
        "--job-name",
        f'x"; touch {pwned} #',
        "--run-dir",
        str(run_dir),
        "--venv",
        str(venv),
        "--env",
        f"A=$(touch {pwned})",
        "--env",
        f"B=`touch {pwned}`; echo *",
        "--env",
        'C=it\'s "quoted" \\ ;|&<>',
        "--env",
        "EMPTY=",
        "--pass-env",
        "PASSED_SECRET",
        "--partition",
        f"gpu; touch {pwned}",
        "--sbatch",
        f"comment=$(touch {pwned})",
        "--setup",
        'echo "setup ran" > "$STUB_LOG/setup"',
        "--entry",
        "my_pkg.train_hsdp:main",
        "--steps",
        "7",
        "--container-image",
        f"img; touch {pwned}",
        "--container-mounts",
        f"{tmp}:{tmp}",
    ]
    return argv, pwned, run_dir


def install_stubs(tmp_path, **programs: str):
    """Executable stand-ins (name=body) in tmp_path/stubs, and the empty tmp_path/log they write
    to: (stubs, log)."""
    stubs, log = tmp_path / "stubs", tmp_path / "log"
    stubs.mkdir()
    log.mkdir()
    for name, body in programs.items():
        (stubs / name).write_text(body)
        (stubs / name).chmod(0o755)
    return stubs, log


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_hostile_values_arrive_intact_and_nothing_injected_runs(launcher: str, tmp_path: Path) -> None:
    argv, pwned, run_dir = _hostile_argv(tmp_path, launcher)
    spec = spec_from_argv(argv)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    stubs, log = install_stubs(tmp_path, python=STUB_PYTHON, srun=STUB_SRUN, torchrun=STUB_TORCHRUN)
    env = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "STUB_LOG": str(log),
        "PASSED_SECRET": "s3cr3t value",
        "HOME": str(tmp_path),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": "1",
        "HPC_HSDP_NODE_SWITCHES": "stale.leaf9:n[1-2]",
    }  # a dotfile's stale values: they must not win
    result = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert not pwned.exists(), "an injected command ran"
    assert "hpc-hsdp: node switches: spine.leaf1:n[1-2]" in result.stdout
    assert (log / "setup").read_text() == "setup ran\n"
    assert "rendezvous at n1:29999" in result.stdout

    run_args = [
        "-m",
        "hpc_hsdp",
        "run",
        "--shard",
        "4",
        "--run-dir",
        str(run_dir),
        "--entry",
        "my_pkg.train_hsdp:main",
        "--steps",
        "7",
    ]
    *layout_steps, srun = sorted(_calls(log, "srun"), key=lambda call: any(a.startswith("--output=") for a in call))
    layout_args = sorted(step[step.index("hpc_hsdp") :] for step in layout_steps)
    assert [args[:4] for args in layout_args] == [  # in the image, not on the host
        ["hpc_hsdp", "layout", "--field", "node_switches"],
        ["hpc_hsdp", "layout", "--field", "rendezvous"],
    ]
    assert layout_args[0][4] == "--scontrol-topology" and len(layout_args[0]) == 6  # the host's answer, one word
    assert all(f"--container-image=img; touch {pwned}" in step for step in layout_steps)
    options = [a for a in srun if a.startswith("--")][:9]
    assert f"--output={run_dir}/logs/%j_%t_log.out" in options
    assert f"--container-image=img; touch {pwned}" in options
    if launcher == "srun":
        assert srun[-len(run_args) - 1 :] == ["python", *run_args]
        (python,) = _calls(log, "python")
        assert python == run_args
    else:
        assert srun[-3:-1] == ["bash", "-c"]
        (torchrun,) = _calls(log, "torchrun")
        assert torchrun == [
            "--nnodes=2",
            "--nproc-per-node=8",
            "--node-rank=0",
            "--master-addr=n1",
            "--master-port=29999",
            "--rdzv-backend=static",
            *run_args,
        ]
        return
    (env_dump,) = log.glob("python-env.*")
    seen = dict(item.split("=", 1) for item in env_dump.read_bytes().decode().split("\0") if "=" in item)
    assert seen["A"] == f"$(touch {pwned})"
    assert seen["B"] == f"`touch {pwned}`; echo *"
    assert seen["C"] == 'it\'s "quoted" \\ ;|&<>'
    assert seen["EMPTY"] == ""
    assert seen["HPC_HSDP_NODE_SWITCHES"] == "spine.leaf1:n[1-2]"  # the job's own, not the submitting shell's
    assert seen["PASSED_SECRET"] == "s3cr3t value"
    assert seen["FAKE_VENV_ACTIVE"] == "yes"
    assert seen["MASTER_ADDR"] == "n1" and seen["MASTER_PORT"] == "29999"
    assert seen["SUBMITIT_EXECUTOR"] == "slurm"
    assert "s3cr3t" not in script.read_text()

    parsed = sbatch_arguments(script.read_text())
    assert f'--job-name=x"; touch {pwned} #' in parsed
    assert f"--partition=gpu; touch {pwned}" in parsed
    assert f"--output={run_dir}/logs/%j_0_log.out" in parsed


FLEXIBLE_STUB_SCONTROL = r"""#!/bin/bash
printf '%s\n' "$*" >> "$STUB_LOG/scontrol"
if [ "$1 $2 $3" = "-o show job" ]; then echo "JobId=$4 JobName=x JobState=PENDING Restarts=$STUB_RESTARTS Requeue=1"; fi
"""
FLEXIBLE_STUB_PYTHON = r"""#!/bin/bash
if [ "$3" = layout ]; then echo "n1 29999"; exit 0; fi
case $STUB_DO in
  requeue-file) echo "$SLURM_JOB_ID" > "$HPC_HSDP_REQUEUE_FILE" ;;   # rank 0 in the image, on the warning
  slurm-requeue) kill -TERM "$STUB_BATCH_SHELL" ;;                   # SLURM requeued the job (a node died)
esac
"""


@pytest.mark.parametrize(
    "case, restarts, expected",
    [
        # rank 0 asked for a requeue from inside the image: held, range restored, released (on a real
        # cluster SLURM's SIGTERM to the batch shell follows, and puts the range back once more, harmlessly)
        ("requeue-file", 1, ["requeuehold 77", "update JobId=77 NumNodes=1-2 NumTasks=8", "release 77"]),
        # SLURM requeued the job itself (node failure) and pinned it to its nodes: the SIGTERM restores the range
        ("slurm-requeue", 1, ["-o show job 77", "update JobId=77 NumNodes=1-2 NumTasks=8"]),
        # a SIGTERM that is no requeue (scancel, time limit: Restarts unchanged): nothing is updated
        ("slurm-requeue", 0, ["-o show job 77"]),
    ],
)
def test_a_flexible_container_jobs_batch_shell_restores_the_node_range(
    case, restarts, expected, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    spec = spec_from_argv(
        [
            "--nodes",
            "1-2",
            "--shard",
            "8",
            "--venv",
            "none",
            "--run-dir",
            str(run_dir),
            "--container-image",
            "img",
            "--container-mounts",
            f"{tmp_path}:{tmp_path}",
        ]
    )
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    (run_dir / "logs").mkdir(parents=True)
    stubs, log = install_stubs(tmp_path, python=FLEXIBLE_STUB_PYTHON, srun=STUB_SRUN, scontrol=FLEXIBLE_STUB_SCONTROL)
    shell = subprocess.Popen(
        ["bash", "-c", 'STUB_BATCH_SHELL=$$ exec bash "$0"', str(script)],
        cwd=tmp_path,
        env={
            "PATH": f"{stubs}:/usr/bin:/bin",
            "STUB_LOG": str(log),
            "STUB_DO": case,
            "STUB_RESTARTS": str(restarts),
            "SLURM_JOB_ID": "77",
            "SLURM_RESTART_COUNT": "0",
            "HOME": str(tmp_path),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = shell.communicate(timeout=60)
    assert shell.returncode == 0, err
    asked = (log / "scontrol").read_text().splitlines()
    assert asked[0] == "show topology", err  # for the switches, on the host: the image has no scontrol
    assert asked[1:] == expected, err
    assert not list((run_dir / "logs").glob("requeue.*"))
    assert ("node range restored (NumNodes=1-2 NumTasks=8)" in err) == (case == "slurm-requeue" and restarts == 1), err


def test_pass_env_missing_stops_the_job_before_launch(tmp_path: Path) -> None:
    spec = spec_from_argv(["--shard", "8", "--pass-env", "NEEDED_TOKEN", "--venv", "none", "--run-dir", str(tmp_path)])
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(spec))
    result = subprocess.run(["bash", str(script)], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
    assert result.returncode != 0
    assert "NEEDED_TOKEN: is not set" in result.stderr


# ----------------------------------------------------------------------------- the command


def test_render_prints_the_script(capsys) -> None:
    code, out, err = run_main(["render", "--nodes", "2", "--shard", "4", "--venv", "none", "--run-dir", "/r"], capsys)
    assert (code, err) == (0, "")
    assert out == render_sbatch(spec_from_argv(["--nodes", "2", "--shard", "4", "--venv", "none", "--run-dir", "/r"]))


def test_output_file_is_written_atomically_executable_and_log_dir_made(tmp_path: Path, capsys) -> None:
    target = tmp_path / "job.sbatch"
    run_dir = tmp_path / "run"
    code, out, err = run_main(
        ["render", "--shard", "8", "--venv", "none", "--run-dir", str(run_dir), "-o", str(target)], capsys
    )
    assert (code, out, err) == (0, "", "")
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert (run_dir / "logs").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch", "run"]  # no temp file left


def test_nothing_is_written_when_an_option_is_rejected(tmp_path: Path, capsys) -> None:
    target = tmp_path / "job.sbatch"
    target.write_text("old\n")
    code, _, err = run_main(["render", "--shard", "3", "--run-dir", str(tmp_path / "run"), "-o", str(target)], capsys)
    assert code == 2 and err.count("\n") == 1
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch"]


def test_run_dir_is_made_absolute_and_defaults_under_cwd(tmp_path: Path) -> None:
    spec = spec_from_argv(["--shard", "8", "--run-dir", "runs/a"], cwd=tmp_path)
    assert spec.run.run_dir == str(tmp_path / "runs" / "a")
    spec = spec_from_argv(["--shard", "8", "--job-name", "my job/1"], cwd=tmp_path)
    assert spec.run.run_dir == str(tmp_path / "hpc-hsdp-runs" / "my_job_1")


def test_default_venv_is_the_running_one(tmp_path: Path) -> None:
    params = render.make_context("render", ["--shard", "8"]).params
    spec = job_spec_from_options(params, environ={}, cwd=tmp_path)
    expected = os.path.abspath(sys.prefix) if sys.prefix != sys.base_prefix else None
    assert spec.environment.venv == expected
    assert job_spec_from_options({**params, "venv": "none"}, environ={}, cwd=tmp_path).environment.venv is None
    assert job_spec_from_options({**params, "conda_env": "x"}, environ={}, cwd=tmp_path).environment.venv is None


REJECTED = [
    # (arguments, words the one-line message must contain)
    (["--shard", "3", "--nodes", "2"], ["shard size 3"]),
    (["--nodes", "2"], ["--shard is required"]),
    (["--shard", "12", "--nodes", "4"], ["multiple of 8"]),
    (["--shard", "4", "--time", "1:2:3:4"], ["--time", "HH:MM:SS"]),
    (["--shard", "4", "--time", "10:75"], ["--time", "seconds"]),
    (["--shard", "4", "--time", "2-25"], ["--time", "hours"]),
    (["--shard", "4", "--time", "0"], ["--time", "zero"]),
    (["--shard", "4", "--sbatch", "nodes=3"], ["--nodes"]),
    (["--shard", "4", "--sbatch", "output=/x"], ["--run-dir"]),
    (["--shard", "4", "--sbatch", "ntasks-per-node=2"], ["--gpus-per-node"]),
    (["--shard", "4", "--sbatch", "Mail-Type=END"], ["not a long sbatch option"]),
    (["--shard", "4", "--sbatch", "--mail-type=END"], ["not a long sbatch option"]),
    (["--shard", "4", "--sbatch", "=x"], ["no KEY"]),
    (["--shard", "4", "--entry", "evil;rm:x"], ["--entry", "module:function"]),
    (["--shard", "4", "--entry", "pkg.mod"], ["--entry", "module:function"]),
    (["--shard", "4", "--job-name", "a\nb"], ["--job-name", "line break"]),
    (["--shard", "4", "--env", "A=x\ny"], ["--env", "A=x", "line break"]),
    (["--shard", "4", "--setup", "echo a\nrm -rf /"], ["--setup", "line break"]),
    (["--shard", "4", "--sbatch", "comment=a\0b"], ["NUL"]),
    (["--shard", "4", "--env", "1BAD=x"], ["not a shell variable name"]),
    (["--shard", "4", "--env", "NOVALUE"], ["not KEY=VALUE", "--pass-env"]),
    (["--shard", "4", "--pass-env", "A-B"], ["not a shell variable name"]),
    (["--shard", "4", "--env", "A=1", "--pass-env", "A"], ["both"]),
    (["--shard", "4", "--signal", "USR3@10"], ["--signal"]),
    (["--shard", "4", "--signal", "USR1@99999"], ["65535"]),
    (
        ["--shard", "4", "--time", "2"],
        ["--signal USR2@120", "120 s before", "--time 2 is only 120 s", "--signal USR2@30"],
    ),
    (["--shard", "4", "--time", "00:01:30", "--signal", "B:USR1@90"], ["90 s before", "--signal B:USR1@22"]),
    (["--shard", "4", "--time", "1", "--signal", "TERM"], ["--signal TERM comes 60 s before", "60 s"]),
    (["--shard", "4", "--time", "0-00:01", "--signal", "USR1@61"], ["61 s before", "only 60 s"]),
    (["--shard", "4", "--mem", "lots"], ["--mem"]),
    (["--shard", "4", "--launcher", "mpirun"], ["--launcher"]),
    (["--shard", "4", "--device", "tpu"], ["--device"]),
    (["--shard", "4", "--nodes", "0"], ["--nodes"]),
    (["--shard", "4", "--nodes", "two"], ["--nodes"]),
    (["--shard", "4", "--run-dir", "/runs/100%"], ["--run-dir", "%"]),
    (["--shard", "4", "--partition", ""], ["--partition", "empty"]),
    (["--shard", "4", "--venv", "/v", "--conda-env", "c"], ["--venv", "--conda-env"]),
    (["--shard", "4", "--container-mounts", "/a:/b"], ["--container-image"]),
    (["--shard", "4", "--nodes", "2", "--ntasks", "20"], ["--ntasks 20", "between 2 and 16"]),
    (["--shard", "8", "--nodes", "2", "--ntasks", "12"], ["8,4", "shard size 8"]),
    (["--shard", "4", "--nodes", "2", "--ntasks", "12", "--launcher", "torchrun"], ["torchrun", "--launcher srun"]),
    (["--shard", "4", "--template", "/nonexistent/t.j2"], ["--template", "does not exist"]),
    (["--shard", "4", "--config", "/nonexistent/job.toml"], ["config file", "does not exist"]),
    (["--shard", "4", "--profile", "dev"], ["profile 'dev'", "--config"]),
    (["--shard", "4", "--bogus"], ["--bogus"]),
    (["--shard", "4", "--mem", "512"], ["--mem '512' has no unit", "512 megabytes", "512G"]),
    (["--shard", "4", "--eval-job", "python e.py {chekpoint}"], ["{chekpoint}", "did you mean {checkpoint}?"]),
    (["--shard", "4", "--eval-job", "e {ckpt} ${HOME}"], ["{ckpt} is not a placeholder", "{run_dir}"]),
    (["--shard", "4", "--array-parallelism", "2"], ["--array-parallelism 2 applies to a sweep", "--sweep"]),
    (["--shard", "4", "--sweep-mode", "zip"], ["--sweep-mode zip applies to a sweep"]),
]


@pytest.mark.parametrize("argv, words", REJECTED, ids=[" ".join(a)[:60] for a, _ in REJECTED])
def test_rejected_inputs_exit_2_with_one_line(argv: list[str], words: list[str], capsys, tmp_path: Path) -> None:
    target = tmp_path / "out.sbatch"
    code, out, err = run_main(["render", "--run-dir", str(tmp_path / "run"), *argv, "-o", str(target)], capsys)
    assert code == 2, (out, err)
    assert err.startswith("hpc-hsdp: error: ") and err.endswith("\n") and err.count("\n") == 1, err
    for word in words:
        assert word in err, err
    assert out == "" and not target.exists() and not (tmp_path / "run").exists()


def test_a_script_that_cannot_be_written_leaves_no_log_directory(capsys, tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "one"
    target = tmp_path / "missing" / "dir" / "x.sbatch"
    code, out, err = run_main(["render", "--shard", "4", "--run-dir", str(run_dir), "-o", str(target)], capsys)
    assert code == 2 and "cannot write" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    (tmp_path / "runs").mkdir()  # a directory that was there before stays
    code, _, _ = run_main(["render", "--shard", "4", "--run-dir", str(run_dir), "-o", str(target)], capsys)
    assert code == 2 and [p.name for p in tmp_path.iterdir()] == ["runs"] and not run_dir.exists()


def test_memory_with_its_unit_or_zero_is_taken(capsys, tmp_path: Path) -> None:
    for mem in ("0", "512G", "4000M", "1T"):
        code, out, err = run_main(["render", "--shard", "4", "--run-dir", str(tmp_path), "--mem", mem], capsys)
        assert code == 0 and f"#SBATCH --mem={mem}\n" in out, err


@pytest.mark.parametrize(
    "argv",
    [["--shard", "3", "--nodes", "2"], ["--shard", "4", "--sbatch", "nodes=3"], ["--shard", "4", "--time", "soon"]],
)
def test_rejected_in_a_real_process(argv: list[str], tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("hpc-hsdp")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "hpc_hsdp"]
    result = subprocess.run(
        [*cmd, "render", *argv, "-o", str(tmp_path / "x")], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stdout == "" and result.stderr.count("\n") == 1 and result.stderr.startswith("hpc-hsdp: error: ")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- templates


def test_custom_template_extends_the_packaged_one(tmp_path: Path) -> None:
    template = tmp_path / "mine.sbatch.j2"
    template.write_text(
        textwrap.dedent("""\
        {% extends "job.sbatch.j2" %}
        {% block footer %}
        # my footer for {{ spec.scheduler.job_name | q }}
        exit "${status}"
        {% endblock %}
        """)
    )
    spec = spec_from_argv(
        ["--shard", "8", "--venv", "none", "--run-dir", "/r", "--template", str(template), "--job-name", "a b"]
    )
    text = render_sbatch(spec)
    assert text.endswith("# my footer for 'a b'\nexit \"${status}\"\n")
    assert '#SBATCH --job-name="a b"' in text and "python -m hpc_hsdp run --shard 8 --run-dir /r" in text


def test_custom_template_with_an_unknown_variable_fails_clearly(tmp_path: Path, capsys) -> None:
    template = tmp_path / "bad.j2"
    template.write_text("#!/bin/bash\necho {{ nope | q }}\n")
    code, _, err = run_main(["render", "--shard", "8", "--template", str(template)], capsys)
    assert code == 2 and "'nope' is undefined" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (b'{% include "missing.j2" %}\n', "includes or extends 'missing.j2'"),
        (b'{% extends "nope.sbatch.j2" %}\n', "includes or extends 'nope.sbatch.j2'"),
        (b"\xff\xfe{{ spec.nodes }}\n", "is not UTF-8 text"),
        (b"{{ spec.nodes | nosuchfilter }}\n", "No filter named 'nosuchfilter'; fix the template"),
    ],
)
def test_broken_custom_template_is_one_line_and_exit_2(tmp_path: Path, capsys, source: bytes, message: str) -> None:
    template = tmp_path / "broken.j2"
    template.write_bytes(source)
    code, _, err = run_main(["render", "--shard", "8", "--template", str(template)], capsys)
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_relative_template_is_found_from_cwd(tmp_path: Path) -> None:
    (tmp_path / "t.j2").write_text("#!/bin/bash\n# {{ spec.nodes }} nodes\n")
    spec = spec_from_argv(["--shard", "8", "--template", "t.j2", "--run-dir", "/r"], cwd=tmp_path)
    assert render_sbatch(spec) == "#!/bin/bash\n# 1 nodes\n"


def test_render_is_deterministic_and_pure() -> None:
    spec = spec_from_argv(
        [
            "--nodes",
            "2",
            "--shard",
            "4",
            "--env",
            "Z=1",
            "--env",
            "A=2",
            "--sbatch",
            "z-opt=1",
            "--sbatch",
            "a-opt=2",
            "--venv",
            "none",
            "--run-dir",
            "/r",
        ]
    )
    first = render_sbatch(spec)
    assert first == render_sbatch(spec)
    assert first.index("export A=2") < first.index("export Z=1")
    assert first.index("--a-opt=2") < first.index("--z-opt=1")


def test_launch_commands() -> None:
    run = RunSpec(shard_size=4, run_dir="/r x")
    assert default_launch_command(JobSpec(nodes=2, run=run)) == "python -m hpc_hsdp run --shard 4 --run-dir '/r x'"
    torchrun = default_launch_command(JobSpec(nodes=2, run=run, launch=LaunchSpec(launcher="torchrun")))
    words = shlex.split(torchrun)
    assert words[:2] == ["bash", "-c"] and len(words) == 3
    inner = words[2]
    assert "--rdzv-backend=static" in inner and "c10d" not in inner
    assert inner.endswith("-m hpc_hsdp run --shard 4 --run-dir '/r x'")


def test_launch_command_override_must_be_one_line() -> None:
    spec = spec_from_argv(["--shard", "8", "--run-dir", "/r"])
    with pytest.raises(SpecError):
        render_sbatch(spec, launch_command="a\nb")
    with pytest.raises(SpecError):
        render_sbatch(spec, launch_command=" ")


# ----------------------------------------------------------------------------- no torch on the CLI path


def test_render_does_not_import_torch(tmp_path: Path) -> None:
    code = textwrap.dedent(f"""\
        import sys
        from click.testing import CliRunner
        from hpc_hsdp.cli import cli
        result = CliRunner().invoke(cli, ["render", "--nodes", "2", "--shard", "4", "--launcher", "torchrun",
                                          "-o", {str(tmp_path / "job.sbatch")!r},
                                          "--run-dir", {str(tmp_path / "run")!r}])
        assert result.exit_code == 0, result.output
        heavy = sorted(m for m in ("torch", "numpy", "submitit", "transformers") if m in sys.modules)
        print(",".join(heavy) or "clean")
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


# what render's start-up loads beyond click and jinja2 is its cost against the floor (benchmarks/bench_cli.py)
NOT_AT_RENDER = (
    "hpc_hsdp.scheduler.backends",  # asked at submit only
    "hostlist",  # a node list is expanded only where one is given
    "statistics",  # the fabric check's medians (with fractions and decimal)
    "hpc_hsdp.rundir.training.evals",  # --eval-job's check, only when it is given
    "hpc_hsdp.plan.fabric_check_rounds",  # --check's verdict and its threshold's variable, only with --check
    "hpc_hsdp.rundir.lifecycle.provenance_record",  # --snapshot-code's copy, only when it is given
    "submitit",
)


def test_render_loads_none_of_what_it_does_not_use(tmp_path: Path) -> None:
    """The command bench_cli measures against ``python -c "import click, jinja2"``."""
    code = textwrap.dedent(f"""\
        import sys
        from click.testing import CliRunner
        from hpc_hsdp.cli import cli
        result = CliRunner().invoke(cli, ["render", "--nodes", "2", "--shard", "4", "--venv", "none",
                                          "--run-dir", {str(tmp_path / "run")!r}])
        assert result.exit_code == 0, result.output
        print(",".join(sorted(m for m in {NOT_AT_RENDER!r} if m in sys.modules)) or "clean")
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "clean"


@pytest.mark.parametrize(
    "time, seconds",
    [("2", 120), ("10:30", 630), ("01:02:03", 3723), ("1-12", 129600), ("1-00:30", 88200), ("2-01:02:03", 176523)],
)
def test_time_limit_seconds(time: str, seconds: int) -> None:
    assert time_limit_seconds(time) == seconds


@pytest.mark.parametrize(
    "time, signal, accepted",
    [
        ("3", "USR2@120", True),
        ("2", "USR2@119", True),
        ("2", "USR2@120", False),
        ("1", "USR1", False),
        ("2", "USR1", True),
        ("1", None, True),
    ],
)
def test_signal_lead_must_be_shorter_than_the_time_limit(time: str, signal: str | None, accepted: bool) -> None:
    if accepted:
        assert SchedulerSpec(time=time, signal=signal).signal == signal
    else:
        with pytest.raises(SpecError, match="before the time limit"):
            SchedulerSpec(time=time, signal=signal)


@pytest.mark.parametrize("device, exported", [("cpu", True), ("cuda", False), ("auto", False)])
def test_cpu_jobs_get_huge_pages_for_malloc_and_gpu_jobs_are_left_alone(device, exported):
    script = render_sbatch(
        spec_from_argv(
            ["--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--device", device, "--run-dir", "/scratch/run"]
        )
    )
    assert ("export GLIBC_TUNABLES=glibc.malloc.hugetlb=1" in script) is exported
