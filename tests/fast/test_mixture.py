"""Data mixtures (``--data web=DIR:0.7,code=DIR:0.3``): parsing, the apportionment of every
step's rows, the sample stream per source (pure, fast), and the option on every surface."""

from __future__ import annotations

import shlex
from fractions import Fraction

import numpy as np
import pytest

from hpc_hsdp.data.sampler import BatchLayout, MixtureOrder
from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.plan.mixture import (
    check_batch,
    map_data_paths,
    min_global_batch,
    parse_mixture,
    rows_after,
    rows_of_step,
    steps_until_used_once,
    used_once_text,
)


def test_parse_normalises_and_keeps_the_text():
    mixture = parse_mixture("web=/d/web:0.7,code=rel/code:0.3")
    assert mixture.names == ("web", "code")
    assert mixture.shares == (Fraction(7, 10), Fraction(3, 10))
    assert parse_mixture("a=x:3,b=y:1").shares == (Fraction(3, 4), Fraction(1, 4))  # sums normalised
    assert parse_mixture("a=C:/x:y:2,b=z:1").sources[0].path == "C:/x:y"  # the weight after the last colon
    assert map_data_paths("web=w:0.7,code=c:0.3", lambda p: f"/abs/{p}") == "web=/abs/w:0.7,code=/abs/c:0.3"
    assert map_data_paths("plain/dir", lambda p: f"/abs/{p}") == "/abs/plain/dir"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("web=w:0.7,web=c:0.3", "names source 'web' twice"),
        ("web=w:0,code=c:1", "must be positive"),
        ("web=w:-1,code=c:1", "must be positive"),
        ("web=w:lots,code=c:1", "is not a number"),
        ("web=w,code=c:1", "is not NAME=PATH:WEIGHT"),
        ("web=w:1,,code=c:1", "has an empty item"),
        ("web=:1", "is not NAME=PATH:WEIGHT"),
    ],
)
def test_bad_mixtures_are_one_clear_line(value, message):
    with pytest.raises(SpecError, match=message) as raised:
        TrainingSpec.of(data=value)
    assert "\n" not in str(raised.value)


def test_val_data_with_a_mixture_is_refused():
    with pytest.raises(SpecError, match="each source is evaluated on its own val split"):
        TrainingSpec.of(data="a=x:1,b=y:1", val_data="v")


@pytest.mark.parametrize(
    ("value", "batch"), [("web=w:0.7,code=c:0.3", 8), ("a=x:0.5,b=y:0.3,c=z:0.2", 12), ("a=x:0.9,b=y:0.1", 4)]
)
def test_rows_over_200_steps_follow_the_weights_within_2_percent(value, batch):
    mixture = parse_mixture(value)
    check_batch(mixture, batch)
    per_step = np.array([rows_of_step(mixture, k, batch) for k in range(1, 201)])
    assert (per_step >= 0).all() and (per_step.sum(axis=1) == batch).all()
    # the sample stream itself: count the source of every row that every rank reads
    layout = BatchLayout(global_batch=batch, world_size=2, grad_accum=2)
    order = MixtureOrder(mixture, num_samples=(37, 11, 5)[: len(mixture.sources)], seed=3, global_batch=batch)
    counts = np.zeros(len(mixture.sources))
    for step in range(1, 201):
        for micro in range(2):
            for rank in range(2):
                ids = order.sample_ids(layout.positions(step, micro, rank))
                counts += np.bincount(order.source_of(ids), minlength=len(counts))
    shares = np.array([float(s) for s in mixture.shares])
    assert np.abs(counts / counts.sum() - shares).max() < 0.02
    assert (counts == per_step.sum(axis=0)).all()
    assert np.abs(per_step.sum(axis=0) - 200 * batch * shares).max() <= len(shares)  # in fact within rows


def test_each_source_wraps_through_every_sample_once_per_epoch_and_the_stream_is_a_function_of_the_step():
    mixture = parse_mixture("big=b:0.75,small=s:0.25")
    sizes = (50, 7)
    order = MixtureOrder(mixture, num_samples=sizes, seed=11, global_batch=8)
    stream = np.concatenate([order.sample_ids(np.arange((k - 1) * 8, k * 8)) for k in range(1, 41)])
    small = stream[order.source_of(stream) == 1] - 50
    assert len(small) == rows_after(mixture, 40, 8)[1] == 80
    for epoch in range(len(small) // 7):  # every epoch of the small source is a permutation of it
        assert sorted(small[epoch * 7 : (epoch + 1) * 7].tolist()) == list(range(7))
    assert small[:7].tolist() != small[7:14].tolist()  # reshuffled each epoch
    fresh = MixtureOrder(mixture, num_samples=sizes, seed=11, global_batch=8)
    assert fresh.sample_ids(np.arange(30 * 8, 31 * 8)).tolist() == stream[30 * 8 : 31 * 8].tolist()
    state = order.state(40)
    assert state["small"] == {"samples_consumed": 80, "epoch": 11, "num_samples": 7, "weight": "0.25"}
    other_seed = MixtureOrder(mixture, num_samples=sizes, seed=12, global_batch=8)
    assert other_seed.sample_ids(np.arange(8)).tolist() != stream[:8].tolist()


def test_a_batch_too_small_for_the_mixture_is_refused_naming_the_least():
    mixture = parse_mixture("a=x:0.4,b=y:0.3,c=z:0.3")
    least = min_global_batch(mixture)
    check_batch(mixture, least)
    with pytest.raises(SpecError, match=f"use a global batch of at least {least}"):
        check_batch(mixture, least - 1)


def test_steps_until_used_once_is_the_first_step_that_covers_each_source():
    mixture = parse_mixture("web=w:0.7,code=c:0.3")
    sizes, batch = (1000, 150), 16
    got = steps_until_used_once(mixture, sizes, batch)
    for index, steps in enumerate(got):
        assert rows_after(mixture, steps, batch)[index] >= sizes[index] > rows_after(mixture, steps - 1, batch)[index]
    assert got == (90, 32)
    line = used_once_text(mixture, sizes, batch, 100)
    assert "web (70% of each batch, 1,000 samples) once after 90 steps" in line and "code (30%" in line


def _cli(capsys, args: list[str]) -> tuple[int, str, str]:
    from hpc_hsdp.cli import main

    try:
        main(args)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_option_reaches_config_files_render_and_help(tmp_path, capsys):
    config = tmp_path / "job.toml"
    config.write_text('data = "web=data/web:0.7,code=/abs/code:0.3"\n')
    base = ["render", "--nodes", "1", "--gpus-per-node", "1", "--shard", "1", "--run-dir", str(tmp_path / "r")]
    code, out, err = _cli(capsys, [*base, "--config", str(config)])
    assert code == 0, err
    value = f"web={tmp_path}/data/web:0.7,code=/abs/code:0.3"  # made absolute per source
    assert f"--data {shlex.quote(value)} " in out
    code, out, err = _cli(capsys, [*base, "--data", "web=w:0.7,web=c:0.3"])
    assert code == 2 and "names source 'web' twice" in err and len(err.splitlines()) == 1, err
    code, out, err = _cli(capsys, [*base, "--data", "plain/dir"])  # one dataset keeps working
    assert code == 0 and f"--data {tmp_path}" not in out and "/plain/dir" in out, err
    code, out, _ = _cli(capsys, ["run", "--help"])
    assert "NAME=PATH:W" in out and "mixture" in out


# ----------------------------------------------------------------------------- before submitting


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    from tests.data_helpers import documents, make_dataset

    root = tmp_path_factory.mktemp("sources")
    web = make_dataset(root / "web", shards={"train": [documents(1, 120)], "val": [documents(2, 20)]})
    code = make_dataset(root / "code", shards={"train": [documents(3, 30)], "val": [documents(4, 10)]})
    return web, code


def test_preflight_checks_every_source_and_says_when_each_is_used_once(two_sources, tmp_path):
    from hpc_hsdp.cli.examples import spec_from_argv
    from hpc_hsdp.data.sampler import num_samples
    from hpc_hsdp.data.tokens import open_dataset
    from hpc_hsdp.submit_host.preflight import check_job_inputs

    web, code = two_sources
    argv = ["--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--seq-len", "16", "--batch-size", "4"]
    argv += ["--steps", "50", "--run-dir", str(tmp_path / "run")]
    note = check_job_inputs(spec_from_argv([*argv, "--data", f"web={web}:0.7,code={code}:0.3"]))
    sizes = tuple(num_samples(open_dataset(p).num_tokens, 16) for p in (web, code))
    steps = steps_until_used_once(parse_mixture("web=w:0.7,code=c:0.3"), sizes, 8)
    assert f"web (70% of each batch, {sizes[0]:,} samples) once after {steps[0]:,} steps" in note, note
    assert f"code (30% of each batch, {sizes[1]:,} samples) once after {steps[1]:,} steps" in note, note
    with pytest.raises(SpecError, match=r"token data .*nowhere does not exist.*nothing submitted"):
        check_job_inputs(spec_from_argv([*argv, "--data", f"web={web}:0.7,code={tmp_path / 'nowhere'}:0.3"]))
    with pytest.raises(SpecError, match="use a global batch of at least 3"):
        small = [a if a != "4" else "1" for a in argv[:-2]]  # a global batch of 2
        check_job_inputs(spec_from_argv([*small, "--data", f"a={web}:1,b={code}:1,c={code}:1,d={web}:1"]))


def test_a_checkpoint_of_another_mixture_is_refused(two_sources, tmp_path):
    import json

    from hpc_hsdp.cli.examples import spec_from_argv
    from hpc_hsdp.data.sampler import num_samples
    from hpc_hsdp.data.tokens import open_dataset
    from hpc_hsdp.rundir.checkpointing.state import COMPLETE, TRAIN_STATE, checkpoint_root
    from hpc_hsdp.submit_host.preflight import check_job_inputs

    web, code = two_sources
    sizes = [num_samples(open_dataset(p).num_tokens, 16) for p in (web, code)]
    path = checkpoint_root(tmp_path / "run") / "step-000004"
    path.mkdir(parents=True)
    sources = {
        "web": {"samples_consumed": 22, "epoch": 0, "num_samples": sizes[0], "weight": "0.7"},
        "code": {"samples_consumed": 10, "epoch": 0, "num_samples": sizes[1], "weight": "0.3"},
    }
    data = {"global_batch": 8, "seed": 0, "num_samples": sum(sizes), "source": "m", "sources": sources}
    (path / TRAIN_STATE).write_text(json.dumps({"step": 4, "seed": 0, "data": data}))
    (path / COMPLETE).write_text("")
    argv = ["--nodes", "1", "--gpus-per-node", "2", "--shard", "2", "--seq-len", "16", "--batch-size", "4"]
    argv += ["--steps", "50", "--run-dir", str(tmp_path / "run")]
    check_job_inputs(spec_from_argv([*argv, "--data", f"web={web}:0.7,code={code}:0.3"]))  # the same: continues
    with pytest.raises(SpecError, match="was trained on the mixture web:0.7 .*this run has the mixture web:0.6"):
        check_job_inputs(spec_from_argv([*argv, "--data", f"web={web}:0.6,code={code}:0.4"]))
    with pytest.raises(SpecError, match="this run has one dataset"):
        check_job_inputs(spec_from_argv([*argv, "--data", str(web)]))


def test_per_source_fields_reach_tensorboard_tags():
    from hpc_hsdp.rundir.training.scalars import record_scalars

    record = {"step": 3, "loss": 2.0, "loss/web": 1.5, "tokens/web": 64, "epoch/code": 2, "eval_loss/code": 3.0}
    tags = record_scalars(record)
    assert tags["loss/train_web"] == 1.5 and tags["data/tokens_web"] == 64.0
    assert tags["data/epoch_code"] == 2.0 and tags["loss/eval_code"] == 3.0 and tags["loss/train"] == 2.0


def test_the_python_api_takes_a_mixture_and_makes_its_paths_absolute(tmp_path):
    from hpc_hsdp.submit_host.api import api_job_spec

    spec = api_job_spec(
        {"shard": 1, "data": "web=data/web:0.7,code=/abs/code:0.3"}, environ={}, cwd=tmp_path, default_venv=None
    )
    assert spec.run.training.dataset.data == f"web={tmp_path}/data/web:0.7,code=/abs/code:0.3"
    assert spec.run.training.dataset.mixture.names == ("web", "code")
    with pytest.raises(SpecError, match="must be positive"):
        api_job_spec({"shard": 1, "data": "web=w:0,code=c:1"}, environ={}, cwd=tmp_path, default_venv=None)
