"""--comm-stats without a job: the built model's parameter counts, the wrapping only while active,
the option reaching the run's arguments."""

from __future__ import annotations

from dist_helpers import in_child

from hpc_hsdp.job.spec import RunSpec
from hpc_hsdp.plan.shapes import builtin_shapes, parameter_counts
from tests.comm_stats_helpers import MODEL

# ----------------------------------------------------------------------------- the shared run


def _built_model_shapes():
    import torch

    from hpc_hsdp.models.builtin import ModelConfig, Transformer
    from hpc_hsdp.models.builtin import parameter_counts as model_counts

    with torch.device("meta"):
        model = Transformer(ModelConfig.from_training(MODEL))
    counts = model_counts(ModelConfig.from_training(MODEL))
    return {
        "shapes": [(name, tuple(p.shape)) for name, p in model.named_parameters()],
        "numel": sum(p.numel() for p in model.parameters()),
        "root": sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks.")),
        "counts": (counts.params, counts.root_params, counts.unpadded_params),
    }


def test_parameter_counts_match_the_built_model():
    built = in_child(_built_model_shapes)  # torch work stays out of the forking parent
    assert built["shapes"] == [(n, s) for n, s, _ in builtin_shapes(vocab_size=64, seq_len=12, width=32, layers=2)]
    assert built["counts"] == (built["numel"], built["root"], built["numel"])
    # padding: seq_len 12 over 8 ranks -> pos_emb holds 16 rows
    assert parameter_counts(**MODEL.options(), shard_size=8).params == built["numel"] + 4 * 32


def test_comm_stats_wraps_only_while_active():
    """The recorder replaces the torch.distributed functions while active and puts the
    originals back on exit (a run without --comm-stats never wraps them: test_runtime's
    test_collectives_are_not_wrapped_without_comm_stats)."""
    import torch.distributed as dist

    from hpc_hsdp.task.observation.comm_stats import CommStats

    originals = {n: getattr(dist, n) for n in ("all_gather_single", "reduce_scatter_single", "all_reduce")}
    recorder = CommStats(node_of_rank=[])
    with recorder:
        assert recorder.active and all(getattr(dist, n) is not f for n, f in originals.items())
    assert not recorder.active and all(getattr(dist, n) is f for n, f in originals.items())


def test_comm_stats_option_reaches_the_run_args():
    spec = RunSpec(shard_size=4, run_dir="/r", comm_stats=True)
    assert spec.to_args()[-1] == "--comm-stats"
    assert "--comm-stats" not in RunSpec(shard_size=4, run_dir="/r").to_args()
