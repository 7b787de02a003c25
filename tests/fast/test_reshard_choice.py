"""--reshard-after-forward auto|always|never, decided before wrapping (one process, no
collective: the four-process agreement is in tests/processes/test_step_settings.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hpc_hsdp.job.spec import TrainingSpec
from hpc_hsdp.models import resolve_model
from hpc_hsdp.plan.shapes import parameter_counts
from hpc_hsdp.plan.topology import TopologyPlan
from hpc_hsdp.task.parallelism import reshard

MODEL = TrainingSpec.of(layers=2, width=32, heads=4, seq_len=12, vocab_size=64)
PARAMS = parameter_counts(**MODEL.options()).params
STATE = 16 * PARAMS // 2  # fp32 parameters, gradients and two AdamW states, shard 2
RESERVE = 0.2
resolve_model(
    MODEL
).build_meta()  # at import: torch's first meta build sets TORCHINDUCTOR_CACHE_DIR, not a test's doing


def fake_ctx(shard_size: int) -> SimpleNamespace:
    plan = TopologyPlan(tasks_per_node=(2, 2), shard_size=shard_size, node_names=("n1", "n2"))
    return SimpleNamespace(plan=plan, device=torch.device("cpu"), layout=SimpleNamespace(local_world_size=2))


def choose(setting: str, *, shard_size: int = 2, memory: int = 1 << 40, precision: str = "fp32"):
    adapter = resolve_model(MODEL)
    model = adapter.build_meta()
    original = reshard.device_memory_bytes
    reshard.device_memory_bytes = lambda device, local_world_size: memory
    try:
        return reshard.choose_reshard(
            fake_ctx(shard_size), model, tuple(adapter.shard_units(model)), setting=setting, precision=precision
        )
    finally:
        reshard.device_memory_bytes = original


fits_fp32 = int((STATE + 4 * PARAMS) / (1 - RESERVE)) + 8
fits_bf16_only = int((STATE + 2 * PARAMS) / (1 - RESERVE)) + 8


@pytest.mark.parametrize(
    ("setting", "shard_size", "memory", "precision", "expected", "words"),
    [
        ("always", 2, 1 << 40, "fp32", True, "always"),
        ("never", 2, 1 << 10, "fp32", False, "never"),
        ("auto", 1, 1 << 40, "fp32", True, "shard size 1"),
        ("auto", 2, 1 << 40, "fp32", False, "fits"),
        ("auto", 2, fits_fp32, "fp32", False, "fits"),
        ("auto", 2, fits_fp32 - 64, "fp32", True, "does not fit"),
        ("auto", 2, fits_bf16_only, "bf16", False, "fits"),  # bf16 parameters are gathered: half the bytes
        ("auto", 2, fits_bf16_only, "fp32", True, "does not fit"),
    ],
)
def test_the_choice_follows_the_setting_and_the_memory(setting, shard_size, memory, precision, expected, words):
    choice = choose(setting, shard_size=shard_size, memory=memory, precision=precision)
    assert choice.reshard is expected
    assert words in choice.reason


def test_the_root_is_what_no_shard_unit_holds():
    adapter = resolve_model(MODEL)
    model = adapter.build_meta()
    counts = parameter_counts(**MODEL.options())
    assert reshard.parameter_counts(model, tuple(adapter.shard_units(model))) == (counts.params, counts.root_params)


def test_the_host_memory_is_shared_by_the_nodes_ranks():
    one = reshard.device_memory_bytes(torch.device("cpu"), local_world_size=1)
    four = reshard.device_memory_bytes(torch.device("cpu"), local_world_size=4)
    assert one > 0 and four == one // 4
