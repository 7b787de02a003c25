"""``--precision fp8``: which Linears convert (table-driven, pure), the conversion on a meta
model through the real torchao, and the refusal without a GPU that has Float8: one line,
exit 2, nothing written (``render``/``submit`` with ``--device cpu``; ``run`` on a CPU task)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from dist_helpers import job_envs

from hpc_hsdp.cli import main
from hpc_hsdp.plan.float8_support import choose_float8_linears, fp8_refusal


@pytest.mark.parametrize(
    ("name", "out_features", "in_features", "convert", "why"),
    [
        ("layers.0.attn.qkv", 6144, 2048, True, "converted"),
        ("layers.0.mlp.fc", 8192, 2048, True, "converted"),
        ("layers.0.mlp.proj", 2048, 8192, True, "converted"),
        ("layers.0.attn.proj", 2048, 2048, True, "converted"),  # out > 1024: large enough
        ("layers.0.attn.proj", 1024, 4096, False, "too small"),  # in <= 4096 and out <= 1024
        ("layers.0.attn.proj", 1024, 4112, True, "converted"),  # in > 4096
        ("layers.0.attn.proj", 768, 768, False, "too small"),  # the 169M model's attention
        ("layers.0.mlp.fc", 3072, 768, True, "converted"),
        ("layers.0.mlp.fc", 3000, 2048, False, "multiples of 16"),
        ("layers.0.mlp.fc", 4096, 2056, False, "multiples of 16"),
        ("head", 32000, 2048, False, "output head"),
        ("lm_head", 32000, 2048, False, "output head"),
        ("model.output", 32000, 4096, False, "output head"),
        ("layers.0.head_proj", 4096, 4096, True, "converted"),  # only the leaf name counts
    ],
)
def test_which_linears_convert(name, out_features, in_features, convert, why):
    (choice,) = choose_float8_linears([(name, out_features, in_features)])
    assert (choice.convert, why in choice.reason) == (convert, True), choice


def test_small_layers_convert_when_asked_and_the_order_is_kept():
    shapes = [("a", 768, 768), ("b", 770, 768), ("head", 64, 768)]
    assert [c.convert for c in choose_float8_linears(shapes, min_size=False)] == [True, False, False]
    assert [c.name for c in choose_float8_linears(shapes)] == ["a", "b", "head"]


@pytest.mark.parametrize(
    ("device", "capability", "refused"),
    [("cpu", None, "this task runs on cpu"), ("cuda", (8, 0), "has 8.0"), ("cuda", (8, 6), "has 8.6"),
     ("cuda", (8, 9), None), ("cuda", (9, 0), None), ("cuda", (10, 0), None), ("cuda", None, "has unknown")],
)  # fmt: skip
def test_fp8_needs_compute_capability_8_9(device, capability, refused):
    said = fp8_refusal(device, capability, "NVIDIA A100" if capability == (8, 0) else None)
    assert (said is None) == (refused is None) and (refused is None or refused in said), said
    if said:
        assert "\n" not in said and "--precision bf16" in said


def test_the_built_in_model_converts_its_blocks_on_meta_and_keeps_the_head(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torchao's import sets it
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.task.parallelism.float8 import convert_linears

    training = TrainingSpec.of(layers=2, width=2048, heads=16, vocab_size=32000, seq_len=16)
    adapter = resolve_model(training, data_vocab_size=None)
    model = adapter.build_meta()
    names = {n for n, p in model.named_parameters()}
    choices = convert_linears(model)
    converted = {c.name for c in choices if c.convert}
    assert converted == {
        f"blocks.{i}.{leaf}" for i in (0, 1) for leaf in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
    }
    for name, module in model.named_modules():
        assert isinstance(module, Float8Linear) == (name in converted), name
    assert {n for n, p in model.named_parameters()} == names  # the checkpoint's keys do not change
    assert model.get_submodule("blocks.0.attn.qkv").config.enable_fsdp_float8_all_gather


def test_under_tensor_parallelism_the_converted_layers_split_by_torchaos_float8_styles(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # torchao's import sets it
    pytest.importorskip("torchao")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from hpc_hsdp.job.spec import TrainingSpec
    from hpc_hsdp.models import resolve_model
    from hpc_hsdp.task.parallelism.float8 import convert_linears, float8_tp_plan

    training = TrainingSpec.of(layers=2, width=2048, heads=16, vocab_size=32000, seq_len=16)
    adapter = resolve_model(training, data_vocab_size=None)
    model = adapter.build_meta()
    converted = {c.name for c in convert_linears(model) if c.convert}
    plan = float8_tp_plan(model, adapter.tp_plan(model, 8))
    float8 = {name for name, style in plan.items() if isinstance(style, (Float8ColwiseParallel, Float8RowwiseParallel))}
    assert float8 == converted  # the blocks' four Linears each; the head stays in bf16 and splits as before
    assert type(plan["head"]) is ColwiseParallel and not plan["head"].use_local_output
    assert type(plan["blocks.0.attn.qkv"]) is Float8ColwiseParallel
    assert (
        type(plan["blocks.1.mlp.proj"]) is Float8RowwiseParallel
        and plan["blocks.1.mlp.proj"].output_layouts[0].dim == 1
    )
    assert type(plan["blocks.0.attn_norm"]).__name__ == "SequenceParallel"
    assert not isinstance(plan["tok_emb"], Float8RowwiseParallel) and isinstance(plan["tok_emb"], RowwiseParallel)


def test_render_and_submit_refuse_fp8_on_cpu_before_anything_is_written(tmp_path, capsys):
    script, run_dir = tmp_path / "job.sbatch", tmp_path / "run"
    for argv in (
        ["render", "--shard", "1", "--device", "cpu", "--precision", "fp8", "-o", str(script)],
        ["submit", "--cluster", "local", "--shard", "1", "--device", "cpu", "--precision", "fp8"],
    ):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert exc.value.code == 2, err
        assert err.count("\n") == 1 and "--precision fp8 with --device cpu" in err, err
    assert not script.exists() and not run_dir.exists()


def test_run_on_a_cpu_task_refuses_fp8_in_one_line_and_writes_nothing(tmp_path):
    env = dict(job_envs(tasks_per_node=[1])[0], PATH=os.environ["PATH"])
    run = tmp_path / "run"
    args = [sys.executable, "-m", "hpc_hsdp", "run", "--run-dir", str(run), "--precision", "fp8"]  # --device auto
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [x for x in out.stderr.splitlines() if "error" in x]
    assert len(errors) == 1 and "compute capability >= 8.9" in errors[0] and "runs on cpu" in errors[0], out.stderr
    assert "Failed to load" not in out.stderr  # torchao's import noise: it was not imported
    assert not run.exists() or not any(run.iterdir()), list(run.rglob("*"))
