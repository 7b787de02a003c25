"""This task's device and numeric precision, resolved in one place.

:func:`pick_device` (which torch device a task of the job trains on, or why it cannot),
:func:`resolve_precision` (``--precision auto``), :func:`configure_device` (TF32 on CUDA) and
the per-step peak-memory reading of that device.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping

import torch

from hpc_hsdp.errors import HsdpError, SpecError
from hpc_hsdp.job.training_sections import ComputeSection
from hpc_hsdp.plan.float8_support import fp8_refusal
from hpc_hsdp.plan.topology import RankLayout
from hpc_hsdp.task.parallelism.compile import check_compile


def pick_device(
    requested: str, layout: RankLayout, env: Mapping[str, str] | None = None
) -> tuple[torch.device, str | None]:
    """The torch device of this task and an optional one-line note."""
    env = os.environ if env is None else env
    if requested == "cpu":
        return torch.device("cpu"), None
    available = torch.cuda.is_available()
    if not available:
        visible = env.get("CUDA_VISIBLE_DEVICES", "<unset>")
        if requested == "cuda":
            raise HsdpError(
                f"--device cuda but CUDA is not usable on node {layout.node} ({cuda_unusable_reason()}, "
                f"CUDA_VISIBLE_DEVICES={visible}); ask SLURM for GPUs (--gpus-per-node) or run with --device cpu"
            )
        if layout.device.startswith("cuda"):
            # SLURM gave this task GPUs: a CPU fallback would "succeed", slowly
            raise HsdpError(
                f"rank {layout.rank} on node {layout.node} was given GPUs (CUDA_VISIBLE_DEVICES={visible}) but CUDA "
                f"is not usable: {cuda_unusable_reason()}; install a CUDA build of torch for this node's driver, "
                f"or run on CPU on purpose with --device cpu"
            )
        # said once per node, by its first task: every task of a node without GPUs would say the same
        said = (
            f"note: node {layout.node}: no GPU given, its ranks run on CPU with gloo" if layout.local_rank == 0 else ""
        )
        return torch.device("cpu"), said
    index = int(layout.device.split(":")[1]) if layout.device.startswith("cuda") else layout.local_rank
    count = torch.cuda.device_count()
    if index >= count:
        raise HsdpError(
            f"rank {layout.rank} (local rank {layout.local_rank}) wants cuda:{index} but only {count} GPU(s) are "
            f"visible on node {layout.node}; start one task per GPU (--ntasks-per-node equal to --gpus-per-node)"
        )
    note = None
    if layout.local_world_size < count and layout.launch_mode == "task-per-gpu":
        note = (
            f"note: rank {layout.rank}: node {layout.node} runs {layout.local_world_size} task(s) but {count} GPUs "
            f"are visible; this rank uses cuda:{index} only (one task per GPU: --ntasks-per-node {count}, or "
            f"--launcher torchrun)"
        )
    return torch.device("cuda", index), note


def cuda_unusable_reason() -> str:
    """Why ``torch.cuda.is_available()`` is False, in words."""
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"this torch ({torch.__version__}) is a CPU-only build"
    try:
        torch.cuda.init()
    except Exception as exc:  # the driver's or the runtime's own reason
        reason = " ".join(str(exc).split())
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) cannot initialise CUDA: {reason}"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` on CUDA, ``fp32`` elsewhere."""
    if precision == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return precision


def compute_precision(precision: str) -> str:
    """The dtype FSDP2 gathers and computes in: ``fp8`` is bf16 around its Float8 Linears."""
    return "bf16" if precision == "fp8" else precision


def check_training_device(compute: ComputeSection, device: torch.device, env: Mapping[str, str] | None = None) -> None:
    """Refuse (SpecError: one line, exit 2) what this device cannot train, before a rank writes
    anything: ``--compile`` on CPU without a C++ compiler, ``--precision fp8`` without a GPU of
    compute capability 8.9 or newer."""
    check_compile(compute.compile, device, env)
    if compute.precision == "fp8":
        cuda = device.type == "cuda"
        refusal = fp8_refusal(
            device.type,
            torch.cuda.get_device_capability(device) if cuda else None,
            torch.cuda.get_device_name(device) if cuda else None,
        )
        if refusal is not None:
            raise SpecError(refusal)
        from hpc_hsdp.task.parallelism.float8 import require_torchao  # noqa: PLC0415 - torchao only for an able GPU

        require_torchao()


def configure_device(device: torch.device) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA (what training wants; torch's default is off)."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def peak_memory(device: torch.device) -> dict:
    """This step's peak memory (CUDA: since the last :func:`reset_peak_memory`)."""
    if device.type == "cuda":
        return {
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device),
            "peak_mem_kind": "cuda_max_allocated",
            "peak_mem_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    return {"peak_mem_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak_mem_kind": "ru_maxrss"}


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
