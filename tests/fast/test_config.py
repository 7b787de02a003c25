"""Config files and profiles: precedence command line > config top level > profile > default."""

from __future__ import annotations

import dataclasses
import textwrap
from operator import attrgetter
from pathlib import Path

import pytest

from hpc_hsdp.cli import main
from hpc_hsdp.cli.job_options import job_spec_from_options
from hpc_hsdp.cli.render_cmd import render
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.config import OPTION_KINDS, load_config, merge_options
from hpc_hsdp.job.options import TRAINING_OPTIONS
from hpc_hsdp.job.spec import SchedulerSpec, TrainingSpec
from hpc_hsdp.submit_host.api import api_job_spec, api_options

CONFIG = textwrap.dedent("""\
    nodes = 2
    shard = 4
    partition = "top"
    env = { SHARED = "top", TOP_ONLY = "1" }
    sbatch = { mail-type = "END" }
    setup = ["echo top"]

    [profiles.dev]
    partition = "dev"
    account = "dev-acct"
    qos = "dev-qos"
    gpus-per-node = 4
    time = "30"
    env = { SHARED = "dev", DEV_ONLY = "1" }
    sbatch = { mail-type = "FAIL", overcommit = true }
    setup = ["module load cuda"]
    venv = "venvs/dev"

    [profiles.prod]
    partition = "prod"
    account = "prod-acct"
    """)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(CONFIG)
    return path


def spec(argv: list[str], *, environ: dict | None = None, cwd: Path):
    params = render.make_context("render", ["--run-dir", "/r", *argv]).params
    return job_spec_from_options(params, environ=environ or {}, cwd=cwd, default_venv=None)


PRECEDENCE = [
    # (argv, environ, field getter, expected)
    ([], {}, lambda s: s.scheduler.partition, "top"),  # config top level over nothing
    (["--profile", "dev"], {}, lambda s: s.scheduler.partition, "top"),  # top level over profile
    (["--profile", "dev", "--partition", "cli"], {}, lambda s: s.scheduler.partition, "cli"),  # cli over all
    (["--profile", "dev"], {}, lambda s: s.scheduler.account, "dev-acct"),  # profile over default
    ([], {"HPC_HSDP_PROFILE": "prod"}, lambda s: s.scheduler.account, "prod-acct"),  # profile by env var
    (["--profile", "dev"], {"HPC_HSDP_PROFILE": "prod"}, lambda s: s.scheduler.account, "dev-acct"),  # flag over env
    ([], {}, lambda s: s.scheduler.account, None),  # default
    (["--profile", "dev"], {}, lambda s: s.gpus_per_node, 4),
    (["--profile", "dev", "--gpus-per-node", "8"], {}, lambda s: s.gpus_per_node, 8),
    ([], {}, lambda s: s.gpus_per_node, 8),
    (["--profile", "dev"], {}, lambda s: s.scheduler.time, "30"),
    (["--profile", "dev"], {}, lambda s: dict(s.environment.env), {"SHARED": "top", "TOP_ONLY": "1", "DEV_ONLY": "1"}),
    (["--profile", "dev", "--env", "SHARED=cli"], {}, lambda s: dict(s.environment.env)["SHARED"], "cli"),
    (["--profile", "dev"], {}, lambda s: dict(s.scheduler.extra), {"mail-type": "END", "overcommit": None}),
    (["--profile", "dev", "--sbatch", "mail-type=ALL"], {}, lambda s: dict(s.scheduler.extra)["mail-type"], "ALL"),
    (
        ["--profile", "dev", "--setup", "echo cli"],
        {},
        lambda s: s.environment.setup,
        ("module load cuda", "echo top", "echo cli"),
    ),
    (["--nodes", "4"], {}, lambda s: s.nodes, 4),
    ([], {}, lambda s: s.run.shard_size, 4),
]


@pytest.mark.parametrize("argv, environ, get, expected", PRECEDENCE)
def test_precedence(argv, environ, get, expected, config_file: Path, tmp_path: Path) -> None:
    assert get(spec(["--config", str(config_file), *argv], environ=environ, cwd=tmp_path)) == expected


def test_config_by_env_var(config_file: Path, tmp_path: Path) -> None:
    s = spec([], environ={"HPC_HSDP_CONFIG": str(config_file), "HPC_HSDP_PROFILE": "dev"}, cwd=tmp_path)
    assert (s.scheduler.partition, s.scheduler.account) == ("top", "dev-acct")


def test_relative_config_paths_are_relative_to_the_file(config_file: Path, tmp_path: Path) -> None:
    s = spec(["--config", str(config_file), "--profile", "dev"], cwd=Path("/"))
    assert s.environment.venv == str(config_file.parent / "venvs" / "dev")


def test_profile_named_in_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('profile = "a"\nshard = 8\n[profiles.a]\nqos = "from-a"\n[profiles.b]\nqos = "from-b"\n')
    assert spec(["--config", str(path)], cwd=tmp_path).scheduler.qos == "from-a"
    assert spec(["--config", str(path)], environ={"HPC_HSDP_PROFILE": "b"}, cwd=tmp_path).scheduler.qos == "from-b"


def test_sbatch_false_removes_a_profile_key() -> None:
    merged = merge_options({"sbatch": {"a": "1", "b": None}}, {"sbatch": {"a": False}})
    assert merged["sbatch"] == {"b": None}


BAD_CONFIGS = [
    ("nodez = 2\n", ["unknown key 'nodez'", "job.toml", "did you mean nodes or"]),
    (
        '[profiles.dev]\nparition = "x"\n',
        ["unknown key 'parition'", "[profiles.dev]", "job.toml", "did you mean partition or"],
    ),
    ("wibble = 2\n", ["unknown key 'wibble'", "the keys are the job options' names with _"]),
    ('nodes = "two"\n', ["nodes", "integer", "MIN-MAX"]),
    ('setup = "module load x"\n', ["setup", "list of strings"]),
    ("env = { A = true }\n", ["env.A", "string"]),
    ('exclusive = "yes"\n', ["exclusive", "true or false"]),
    ("nodes = [\n", ["not valid TOML"]),
    ("profiles = 3\n", ["profiles"]),
    ("gpus_per_node = 8\ngpus-per-node = 8\n", ["twice"]),
]


@pytest.mark.parametrize("text, words", BAD_CONFIGS)
def test_bad_config_files(text: str, words: list[str], tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(SpecError) as exc:
        load_config(path)
    for word in words:
        assert word in str(exc.value)


def test_unknown_profile_lists_the_known_ones(config_file: Path, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"profile 'nope' is not in .*dev, prod"):
        spec(["--config", str(config_file), "--profile", "nope"], cwd=tmp_path)


def test_bad_config_through_the_command_is_one_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "job.toml"
    path.write_text("shard = 4\nbogus = 1\n")
    with pytest.raises(SystemExit) as exc:
        main(["render", "--config", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "bogus" in err and str(path) in err


def test_the_cluster_is_a_config_key_a_profile_may_set_and_the_command_line_overrides(tmp_path: Path) -> None:
    from hpc_hsdp.cli.submit_cmd import submit  # noqa: PLC0415

    path = tmp_path / "job.toml"
    path.write_text('shard = 1\ncluster = "slurm"\n[profiles.laptop]\ncluster = "local"\n')

    def chosen(*argv: str) -> str:
        params = submit.make_context("submit", ["--run-dir", "/r", "--config", str(path), *argv]).params
        return job_spec_from_options(params, environ={}, cwd=tmp_path, default_venv=None).cluster

    assert chosen() == "slurm"
    path.write_text('shard = 1\n[profiles.laptop]\ncluster = "local"\n')
    assert (chosen(), chosen("--profile", "laptop"), chosen("--profile", "laptop", "--cluster", "auto")) == (
        "auto",
        "local",
        "auto",
    )
    path.write_text('shard = 1\ncluster = "mars"\n')
    with pytest.raises(SpecError, match="--cluster 'mars' is unknown; choose auto, slurm, local"):
        chosen()


def test_every_job_option_can_come_from_a_config(tmp_path: Path) -> None:
    """One config setting each option; the result equals the same options on the command line."""
    path = tmp_path / "all.toml"
    path.write_text(
        textwrap.dedent("""\
        nodes = 2
        gpus_per_node = 4
        shard = 2
        tp = 2
        job_name = "all"
        partition = "p"
        account = "a"
        qos = "q"
        time = "1-00"
        constraint = "c"
        switches = "1@5:00"
        segment = 2
        topology = "strict"
        exclusive = true
        mem = "10G"
        cpus_per_task = 4
        signal = "TERM@60"
        requeue = false
        run_dir = "/r"
        template = "/nonexistent/is-checked-at-render.j2"
        ntasks = 8
        setup = ["echo hi"]
        env = { A = "1" }
        pass_env = ["TOKEN"]
        sbatch = { comment = "c" }
        launcher = "srun"
        distribution = "cyclic"
        entry = "pkg.mod:fn"
        device = "cpu"
        timeout = 60
        comm_stats = true
        container_image = "img"
        container_mounts = "/a:/b,/tmp:/tmp,/r:/r"
        check = true
        check_threshold = 0.6
        debug = true
        venv = "/v"
        python = "python3"
        snapshot_code = true
        spare_nodes = 0
        steps = 9
        lr = 0.01
        sweep = ["seed=0,1", "lr=1e-3,3e-3"]
        sweep_mode = "zip"
        array_parallelism = 2
        cluster = "local"
        """)
    )
    missing = set(OPTION_KINDS) - set(load_config(path)) - set(TrainingSpec().options()) - {"conda_env"}
    assert not missing
    from_file = spec(["--config", str(path)], cwd=tmp_path)
    from_cli = spec(
        [
            "--nodes",
            "2",
            "--gpus-per-node",
            "4",
            "--shard",
            "2",
            "--tp",
            "2",
            "--job-name",
            "all",
            "--partition",
            "p",
            "--account",
            "a",
            "--qos",
            "q",
            "--time",
            "1-00",
            "--constraint",
            "c",
            "--switches",
            "1@5:00",
            "--segment",
            "2",
            "--topology",
            "strict",
            "--exclusive",
            "--mem",
            "10G",
            "--cpus-per-task",
            "4",
            "--signal",
            "TERM@60",
            "--no-requeue",
            "--ntasks",
            "8",
            "--template",
            "/nonexistent/is-checked-at-render.j2",
            "--setup",
            "echo hi",
            "--env",
            "A=1",
            "--pass-env",
            "TOKEN",
            "--sbatch",
            "comment=c",
            "--launcher",
            "srun",
            "--distribution",
            "cyclic",
            "--entry",
            "pkg.mod:fn",
            "--device",
            "cpu",
            "--timeout",
            "60",
            "--comm-stats",
            "--container-image",
            "img",
            "--container-mounts",
            "/a:/b,/tmp:/tmp,/r:/r",
            "--check",
            "--check-threshold",
            "0.6",
            "--debug",
            "--venv",
            "/v",
            "--python",
            "python3",
            "--snapshot-code",
            "--steps",
            "9",
            "--lr",
            "0.01",
            "--sweep",
            "seed=0,1",
            "--sweep",
            "lr=1e-3,3e-3",
            "--sweep-mode",
            "zip",
            "--array-parallelism",
            "2",
        ],
        cwd=tmp_path,
    )
    assert from_file.cluster == "local"  # submit's own: render's command line has no --cluster
    assert dataclasses.replace(from_file, cluster="auto") == from_cli


_SAMPLE_BY_KIND = {
    "int": 3,
    "float": 0.25,
    "bool": True,
    "str": "x",
    "path": "/data/tokens",
    "data": "web=/data/web:0.7,code=/data/code:0.3",  # a mixture: the one value of kind data that is no path
}
_SAMPLE = {
    "model": "mypkg.models:build",
    "shard_unit": "Block",
    "heads": 1,
    "width": 68,
    "tracker": "wandb,mlflow",
    "global_batch_size": 16,
    "stage_data": "/local/stage",
    "checkpoint_store": "s3://ckpt/runs/config",
}


@pytest.mark.parametrize("declared", TRAINING_OPTIONS, ids=lambda declared: declared.key)
def test_every_training_option_is_one_field_on_the_command_line_and_in_a_config(tmp_path: Path, declared) -> None:
    """Each TrainingSpec field is an option of its own: the same value from a config file
    (either spelling) and from the command line gives the same spec, and to_args reproduces it."""
    kind = OPTION_KINDS[declared.key]
    value = _SAMPLE.get(declared.key, declared.choices[-1] if declared.choices else _SAMPLE_BY_KIND[kind])
    if kind == "bool":  # the value that is not the default: --flag, or --no-flag for a default-on option
        value = not declared.default
    toml_value = (
        str(value).lower() if isinstance(value, bool) else f'"{value}"' if isinstance(value, str) else repr(value)
    )
    needs_data = declared.key in ("val_data", "stage_data")
    needs_nodes = declared.key == "fault_tolerance"  # replica groups: at least two
    lines = f"shard = 1\n{declared.key.replace('_', '-')} = {toml_value}\n" + (
        'data = "/data/train"\n' if needs_data else ""
    )
    lines += "nodes = 2\n" if needs_nodes else ""
    path = tmp_path / "one.toml"
    path.write_text(lines)
    flag = declared.flag
    cli = [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
    cli = (["--data", "/data/train"] if needs_data else []) + cli
    from_file = spec(["--config", str(path)], cwd=tmp_path)
    from_cli = spec(["--shard", "1", *(["--nodes", "2"] if needs_nodes else []), *cli], cwd=tmp_path)
    assert from_file == from_cli
    assert attrgetter(declared.path)(from_cli) == value
    assert from_cli.run.training.to_args() == cli


@pytest.mark.parametrize(("given", "value"), [("true", "auto"), ("false", None), ('"none"', None)])
def test_an_option_given_alone_on_the_command_line_is_true_in_a_config(tmp_path: Path, given, value) -> None:
    """stage_data = true is --stage-data alone (auto), false its off word, in a config file and in
    submit(), as on the command line."""
    path = tmp_path / "alone.toml"
    path.write_text(f'shard = 1\ndata = "/data/train"\nstage_data = {given}\n')
    from_file = spec(["--config", str(path)], cwd=tmp_path)
    assert from_file.run.training.dataset.stage_data == value
    if given in ("true", "false"):
        from_api = api_job_spec(
            {"shard": 1, "data": "/data/train", "stage_data": given == "true"},
            cwd=tmp_path,
            environ={},
            default_venv=None,
        )
        assert from_api.run.training.dataset.stage_data == value


# ----------------------------------------------------------------------------- the Python API's options


def test_api_options_are_the_config_keys_and_become_the_same_spec(tmp_path: Path) -> None:
    spec = api_job_spec(
        {
            "nodes": 2,
            "shard": 4,
            "time": "30",
            "env": {"A": 1},
            "setup": "module load x",
            "sbatch": {"overcommit": True, "mail-type": "END", "dropped": False},
            "steps": 7,
            "pass_env": ("HOME",),
            "exclusive": True,
            "run_dir": "run",
        },
        cwd=tmp_path,
        environ={},
        default_venv=None,
    )
    assert spec.scheduler.extra == (("mail-type", "END"), ("overcommit", None))
    assert spec.environment.env == (("A", "1"),) and spec.environment.setup == ("module load x",)
    assert spec.environment.pass_env == ("HOME",) and spec.scheduler.exclusive is True
    assert (
        spec.run.training.optimizer.steps == 7
        and spec.scheduler.time == "30"
        and spec.run.run_dir == str(tmp_path / "run")
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"shard_size": 4}, "unknown option 'shard_size'"),  # the click name is not an API keyword
        ({"nodes": "two"}, "nodes = 'two' in submit() must be a node count (an integer) or \"MIN-MAX\""),
        ({"nodes": True}, "nodes = True in submit() must be a node count (an integer)"),
        ({"exclusive": "no"}, "exclusive = 'no' in submit() must be true or false"),  # bool('no') is True
        ({"run_dir": 5}, "run_dir = 5 in submit() must be a path"),
        ({"pass_env": 5}, "pass_env = 5 in submit() must be a list of strings"),
        ({"env": {"A": [1]}}, "env.A = [1] in submit() must be a string or number"),
        ({"time": 60}, "time = 60 in submit() must be a string"),
    ],
)
def test_api_options_reject_wrong_kinds(options: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        api_options({"shard": 4, **options})
    assert message in str(info.value)
    if "unknown option" in message:
        known = str(info.value).split("known options: ")[1].split(", ")
        assert "shard" in known and "env" in known and "shard_size" not in known and "env_vars" not in known


@pytest.mark.parametrize("field", ["exclusive", "requeue"])
def test_scheduler_flags_must_be_bools(field: str) -> None:
    with pytest.raises(SpecError, match=f"--{field} 'yes' must be true or false"):
        SchedulerSpec(**{field: "yes"})
