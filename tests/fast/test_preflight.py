"""Before submitting: the files and modules the tasks will open (hpc_hsdp.submit_host.preflight), and
``submit`` refusing a job that would fail on them before it waits in the queue."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import hpc
from hf_helpers import TINY_LLAMA, write_config

from hpc_hsdp.cli.examples import spec_from_argv
from hpc_hsdp.data.sampler import num_samples
from hpc_hsdp.data.synthetic import NUM_SAMPLES
from hpc_hsdp.data.tokens import open_dataset, write_token_file
from hpc_hsdp.errors import SpecError
from hpc_hsdp.rundir.checkpointing.state import COMPLETE, TRAIN_STATE, checkpoint_root
from hpc_hsdp.submit_host.preflight import check_job_inputs
from tests.data_helpers import documents, make_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """A dataset directory of vocabulary 100 (train and val splits), 2,500-odd tokens of train."""
    root = tmp_path_factory.mktemp("preflight") / "data"
    return make_dataset(root, shards={"train": [documents(1, 120)], "val": [documents(2, 20)]})


def _files(tmp_path: Path, data: Path) -> dict[str, str]:
    one_file = tmp_path / "one.bin"
    write_token_file(one_file, np.arange(500) % 90, vocab_size=100)
    write_token_file(tmp_path / "tiny.bin", np.arange(10), vocab_size=100)
    return {
        "DATA": str(data),
        "MISSING": str(tmp_path / "nowhere"),
        "ONE_FILE": str(one_file),
        "TINY": str(tmp_path / "tiny.bin"),
        "SMALL_VOCAB_MODEL": "hf:" + str(write_config(tmp_path / "small", {**TINY_LLAMA, "vocab_size": 64})),
        "MODEL": "hf:" + str(write_config(tmp_path / "llama", {**TINY_LLAMA, "vocab_size": 128})),
        "NO_MODEL": "hf:" + str(tmp_path / "no-model"),
        "NOT_JSON_MODEL": "hf:" + str(_write(tmp_path / "broken" / "config.json", "{vocab_size: 96")),
        "LIST_MODEL": "hf:" + str(_write(tmp_path / "list" / "config.json", "[96]")),
    }


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True)
    path.write_text(text)
    return path


def _spec(argv: list[str], files: dict[str, str]):
    return spec_from_argv(
        ["--nodes", "2", "--gpus-per-node", "4", "--shard", "4", *(files.get(arg, arg) for arg in argv)]
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "MISSING"], "token data {MISSING} does not exist"),
        (
            ["--data", "DATA", "--seq-len", "64", "--batch-size", "8"],
            "fewer than one global batch of 64",
        ),  # 8 ranks x 8
        (["--data", "DATA", "--seq-len", "16", "--global-batch-size", "512"], "fewer than one global batch of 512"),
        (
            ["--data", "ONE_FILE", "--eval-every", "5", "--seq-len", "16", "--batch-size", "2"],
            "is one token file with no held-out split",
        ),
        (["--data", "DATA", "--val-data", "MISSING", "--eval-every", "5"], "token data {MISSING} does not exist"),
        (
            ["--data", "DATA", "--val-data", "TINY", "--eval-every", "5", "--seq-len", "16", "--batch-size", "2"],
            "the held-out data (10 tokens) holds no sample of --seq-len 16 + 1 tokens",
        ),
        (
            ["--data", "DATA", "--model", "SMALL_VOCAB_MODEL"],
            "has a vocabulary of 64 tokens but the data's tokenizer has 100: token ids would fall outside the embedding",
        ),
        (["--model", "NO_MODEL"], "does not exist; give a directory written by save_pretrained"),
        (["--model", "NO_MODEL"], "(hf: reads local paths only; a hub id is not downloaded: huggingface-cli download"),
        (["--model", "NOT_JSON_MODEL"], "config.json' as JSON (it is not JSON (Expecting property name"),
        (["--model", "LIST_MODEL"], "config.json' is not a JSON object; give a config.json"),
        (["--model", "hpc_hsdp_no_such_module:build"], "module 'hpc_hsdp_no_such_module' cannot be imported here"),
    ],
)
def test_inputs_the_tasks_could_not_use_are_refused_in_one_line(tmp_path, data, argv, message):
    files = _files(tmp_path, data)
    with pytest.raises(SpecError) as info:
        check_job_inputs(_spec(argv, files))
    text = str(info.value)
    assert message.format(**files) in text and "\n" not in text
    not_here = any(
        w in message for w in ("does not exist", "cannot be imported", "hf: reads local")
    )  # the nodes' files?
    assert text.endswith("render the script and sbatch it)") == not_here
    assert ("submit looks for the job's files on this machine" in text) == not_here


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--data", "DATA", "--seq-len", "16", "--batch-size", "2", "--eval-every", "5"],
        ["--data", "ONE_FILE", "--seq-len", "16", "--batch-size", "2"],
        ["--data", "DATA", "--model", "MODEL", "--seq-len", "16", "--batch-size", "2"],
        ["--model", "MODEL"],
        ["--model", "json:loads"],
        ["--data", "MISSING", "--entry", "json:loads"],  # the function decides what it opens
    ],
)
def test_inputs_the_tasks_can_use_pass(tmp_path, data, argv):
    check_job_inputs(_spec(argv, _files(tmp_path, data)))


def test_a_missing_entry_module_is_refused(tmp_path, data):
    with pytest.raises(
        SpecError,
        match="--entry 'hpc_hsdp_no_such_module:main': module 'hpc_hsdp_no_such_module' cannot be imported here",
    ):
        check_job_inputs(_spec(["--entry", "hpc_hsdp_no_such_module:main"], _files(tmp_path, data)))


def _checkpoint(run_dir: Path, *, step: int, data: dict | None) -> None:
    """A complete checkpoint as the loop leaves it, as far as submit reads it (no tensors)."""
    path = checkpoint_root(run_dir) / f"step-{step:06d}"
    path.mkdir(parents=True)
    (path / TRAIN_STATE).write_text(json.dumps({"step": step, "seed": 0, "data": data}))
    (path / COMPLETE).write_text("")


RESUME = [
    "--nodes",
    "1",
    "--gpus-per-node",
    "2",
    "--shard",
    "2",
    "--steps",
    "10",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
]


@pytest.mark.parametrize(
    ("saved", "argv", "message"),
    [
        (
            {"global_batch": 8, "seed": 0, "num_samples": "DATA"},
            [],
            "checkpoint step-000004 (step 4) was trained with a global batch of 8 samples, this run has 4; resuming would "
            "repeat or skip samples: resume with --global-batch-size 8",
        ),
        (
            {"global_batch": 4, "seed": 0, "num_samples": "DATA"},
            ["--seed", "7"],
            "was trained with --seed 0, this run has --seed 7; the data order follows the seed: resume with --seed 0",
        ),
        (
            {"global_batch": 4, "seed": 0, "num_samples": 12345, "source": "other"},
            [],
            "was trained on 12345 samples (other), this run's data has {samples}; resume on the same data and --seq-len",
        ),
        ({"global_batch": 4, "seed": 0, "num_samples": "DATA"}, ["--seq-len", "8"], "this run's data has"),
    ],
)
def test_a_checkpoint_the_job_could_not_continue_is_refused(tmp_path, data, saved, argv, message):
    samples = num_samples(open_dataset(data).num_tokens, 16)
    _checkpoint(tmp_path / "run", step=4, data={k: samples if v == "DATA" else v for k, v in saved.items()})
    spec = spec_from_argv([*RESUME, "--data", str(data), "--run-dir", str(tmp_path / "run"), *argv])
    with pytest.raises(SpecError) as info:
        check_job_inputs(spec)
    assert message.format(samples=samples) in str(info.value)
    assert "looks for the job's files on this machine" not in str(info.value)  # a mismatch, not a missing file


@pytest.mark.parametrize("synthetic", [False, True])
def test_a_checkpoint_the_job_continues_passes(tmp_path, data, synthetic):
    samples = NUM_SAMPLES if synthetic else num_samples(open_dataset(data).num_tokens, 16)
    _checkpoint(tmp_path / "run", step=4, data={"global_batch": 4, "seed": 0, "num_samples": samples, "source": "x"})
    check_job_inputs(
        spec_from_argv([*RESUME, *([] if synthetic else ["--data", str(data)]), "--run-dir", str(tmp_path / "run")])
    )
    _checkpoint(tmp_path / "own", step=4, data=None)  # written by a function of the user's: no data position
    check_job_inputs(spec_from_argv([*RESUME, "--run-dir", str(tmp_path / "own")]))


def test_submit_with_missing_data_exits_2_and_submits_nothing(tmp_path, local_submit):
    run_dir = tmp_path / "run"
    done = hpc(*local_submit(run_dir, "--data", str(tmp_path / "nowhere")), timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"hpc-hsdp: error: token data {tmp_path / 'nowhere'} does not exist")
    assert "nothing submitted" in lines[0] and done.stdout == ""
    assert not run_dir.exists()


# ----------------------------------------------------------------------------- the scheduler's partition


def _slurm_without_the_partition(monkeypatch, *modules) -> list[list[str]]:
    """SLURM stand-ins for ``modules``' submission: a controller that answers and has the
    partitions gpu and cpu only; every command asked is recorded."""
    from hpc_hsdp.scheduler.backends.slurm import SlurmBackend  # noqa: PLC0415

    asked: list[list[str]] = []

    def runner(argv, **kwargs):
        asked.append(list(argv))
        if argv[:3] == ["scontrol", "show", "partition"]:
            return subprocess.CompletedProcess(argv, 1, "", f"Partition {argv[3]} not found\n")
        if argv[0] == "sinfo" and "%R" in argv:
            return subprocess.CompletedProcess(argv, 0, "gpu\ncpu\n", "")
        return subprocess.CompletedProcess(argv, 0, "", "")

    for module in modules:
        monkeypatch.setattr(module, "resolve_cluster", lambda cluster: ("slurm", "submitting to SLURM"))
        monkeypatch.setattr(module, "backend", lambda name: SlurmBackend(runner=runner))
    return asked


def test_a_partition_the_cluster_lacks_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """The partition is a submit-time check of preflight, asked of the backend before the run
    directory is claimed: it was asked by the backend's submit, after the claim, the logs
    directory and the provenance, and left a run directory with logs/ in it."""
    from hpc_hsdp.cli.job_options import job_spec_resolver  # noqa: PLC0415
    from hpc_hsdp.errors import SchedulerError  # noqa: PLC0415
    from hpc_hsdp.submit_host import submission, sweep_submission  # noqa: PLC0415
    from hpc_hsdp.submit_host.sweep_submission import plan_sweep, submit_sweep  # noqa: PLC0415

    asked = _slurm_without_the_partition(monkeypatch, submission, sweep_submission)
    resolve = job_spec_resolver(environ={}, cwd=str(tmp_path), default_venv=None)
    options = {"config": None, "profile": None, "shard": 1, "partition": "gpux", "snapshot_code": True}
    spec = resolve({**options, "run_dir": str(tmp_path / "run")}, True)
    with pytest.raises(
        SchedulerError, match="^--partition 'gpux' does not exist on this cluster; choose one of cpu, gpu$"
    ):
        submission.submit_spec(spec, cluster="slurm")
    assert not (tmp_path / "run").exists()
    assert ["scontrol", "show", "partition", "gpux"] in asked
    sweep = plan_sweep({**options, "run_dir": str(tmp_path / "sweep"), "sweep": ("lr=0.1,0.2",)}, resolve=resolve)
    with pytest.raises(SchedulerError, match="^--partition 'gpux' does not exist on this cluster"):
        submit_sweep(sweep, cluster="slurm")
    assert not (tmp_path / "sweep").exists()
