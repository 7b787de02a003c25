"""``--model MODULE:FUNCTION``: a user's nn.Module factory under HSDP (examples/my_model.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from dist_helpers import in_child, launch
from hf_helpers import shard_and_report, unsharded_reference

from hpc_hsdp.errors import SpecError
from hpc_hsdp.job.spec import RunSpec, TrainingSpec

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)  # forked ranks inherit it, as PYTHONPATH=examples would give them

SMALL = dict(vocab_size=96, width=64, heads=4, layers=2)
pytestmark = pytest.mark.dist


def test_factory_model_is_sharded_initialised_and_trainable(tmp_path):
    training = TrainingSpec.of(model="my_model:build", seed=4, **SMALL)
    spec = RunSpec(shard_size=2, run_dir=str(tmp_path / "run"), device="cpu", training=training, timeout_s=120)
    by_rank = {o.value["rank"]: o.value for o in launch(spec, tasks_per_node=[2, 2], fn=shard_and_report)}
    total = by_rank[0]["total_numel"]
    assert by_rank[0]["units"] == ["Block"]
    assert by_rank[0]["tied"] == [["embed.weight", "head.weight"]]
    for group in ((0, 1), (2, 3)):
        assert sum(by_rank[r]["local_numel"] for r in group) == total
    ref = in_child(unsharded_reference, "my_model:build", 4, tmp_path / "run" / "full_state.pt", SMALL)
    assert ref["differ"] == [] and ref["n"] > 10
    assert abs(by_rank[0]["loss"] - ref["our_loss"]) < 1e-5
    assert 3.5 < ref["our_loss"] < 5.5  # about ln(96) = 4.56 for a fresh model


class Untouched(__import__("torch").nn.Module):
    def __init__(self):
        import torch

        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))  # no reset_parameters, no init_module
        self.embed = torch.nn.Embedding(8, 3)

    def forward(self, x):
        return self.embed(x) * self.scale


def untouched():
    return Untouched()


def not_a_module():
    return 3


def _factory_errors(cases):
    from hpc_hsdp.models.factory import FactoryAdapter

    out = []
    for model, unit in cases:
        try:
            adapter = FactoryAdapter(TrainingSpec.of(model=model, shard_unit=unit, **SMALL))
            built = adapter.build_meta()
            built.to_empty(device="cpu")
            adapter.init_weights(built, seed=0)
            out.append("no error")
        except SpecError as exc:
            out.append(str(exc))
    return out


def test_factory_errors_name_the_problem():
    cases = {
        ("no_such_module_xyz:build", None): "cannot import module 'no_such_module_xyz'",
        ("my_model:nothing", None): "has no function 'nothing'",
        (f"{__name__}:not_a_module", None): "returned int, not a torch.nn.Module",
        (f"{__name__}:untouched", None): "scale is not initialised by the model's own initialisation",
        ("my_model:build", "Blocks"): "'Blocks', which matches no module of TinyLM",
        ("my_model:build", "Embedding"): "would be in different FSDP units",
    }
    for (case, expected), message in zip(cases.items(), in_child(_factory_errors, list(cases))):
        assert expected in message, (case, message)


def test_the_examples_factory_with_data_is_built_with_the_datas_vocabulary():
    """examples/my_model.py builds from training.model.vocab_size: with --data that is the data's (2048 here,
    the run's own 256), as the vocabulary check's message says, so the example trains on prepared data."""
    assert in_child(_data_vocabulary) == (2048, 2048)


def _data_vocabulary():
    from hpc_hsdp.models import resolve_model

    adapter = resolve_model(
        TrainingSpec.of(model="my_model:build", **{**SMALL, "vocab_size": 256}), data_vocab_size=2048
    )
    return adapter.vocab_size, adapter.build_meta().embed.num_embeddings
