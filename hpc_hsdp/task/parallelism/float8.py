"""``--precision fp8``: the Linear layers :func:`~hpc_hsdp.plan.float8_support.choose_float8_linears`
picks become torchao's ``Float8Linear`` (tensorwise dynamic scaling) on the meta model,
before ``fully_shard``, with FSDP2's float8 all-gather (the sharded weights are cast to
float8 before they are gathered: half the all-gather bytes of bf16); after every optimizer
step one all-reduce precomputes the next step's weight scales
(``precompute_float8_dynamic_scale_for_fsdp``, an optimizer step post-hook, so that own loops
get it too). Everything else computes in bf16 (FSDP2's mixed precision, as ``--precision
bf16``). torchao is the optional extra ``hpc-hsdp[fp8]``; it is imported only here, after
the device was found able (:func:`hpc_hsdp.task.parallelism.device.check_training_device`).
"""

from __future__ import annotations

import torch
from torch import nn

from hpc_hsdp.errors import SpecError
from hpc_hsdp.models.third_party_noise import quiet_library_imports
from hpc_hsdp.plan.float8_support import LinearChoice, choose_float8_linears


def _torchao_float8():
    quiet_library_imports()
    try:
        import torchao.float8 as float8  # noqa: PLC0415 - the optional extra, only for --precision fp8
    except ImportError:
        raise SpecError(
            "--precision fp8 needs torchao on the nodes: pip install 'hpc-hsdp[fp8]' (torchao==0.18.0)"
        ) from None
    return float8


def require_torchao() -> None:
    _torchao_float8()


def linear_choices(model: nn.Module) -> list[LinearChoice]:
    """Every ``nn.Linear`` of ``model`` and whether it converts (works on the meta device)."""
    return choose_float8_linears(
        (name, m.out_features, m.in_features) for name, m in model.named_modules() if isinstance(m, nn.Linear)
    )


def convert_linears(model: nn.Module) -> list[LinearChoice]:
    """Swap the chosen Linears for ``Float8Linear`` in place (FSDP2 float8 all-gather on);
    returns every Linear's choice."""
    float8 = _torchao_float8()
    choices = linear_choices(model)
    chosen = {c.name for c in choices if c.convert}
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen)
    return choices


def float8_tp_plan(model: nn.Module, plan: dict) -> dict:
    """A tensor-parallel plan for a model whose Linears :func:`convert_linears` converted: the
    column- and row-wise styles of each ``Float8Linear`` become torchao's float8 ones (the same
    layouts; the split matmuls in float8), every other entry stays as it is."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # noqa: PLC0415 - only under --tp
    from torchao.float8.float8_linear import Float8Linear  # noqa: PLC0415 - the optional extra
    from torchao.float8.float8_tensor_parallel import (  # noqa: PLC0415 - the optional extra
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )

    float8_styles = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}
    converted = {name for name, module in model.named_modules() if isinstance(module, Float8Linear)}
    out = {}
    for name, style in plan.items():
        kind = float8_styles.get(type(style))
        if name in converted and kind is not None:
            style = kind(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        out[name] = style
    return out


def precompute_scales_after_each_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After every ``optimizer.step()``: the float8 weights' scales for the next all-gather
    (one all-reduce of the amaxes), as torchao's FSDP2 recipe asks."""
    precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    optimizer.register_step_post_hook(lambda *_: precompute(model))
