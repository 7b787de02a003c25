"""Training on CPU: keep freed host memory in the process instead of handing it back to the kernel.

glibc's malloc serves a large block (above its mmap threshold: 128 KiB, rising to at most
32 MiB as blocks are freed) with a fresh ``mmap`` and returns it with ``munmap`` when it is
freed, and gives the top of its heap back above the trim threshold. A training step on CPU
allocates and frees the same large tensors every step (FSDP2's all-gather and
reduce-scatter buffers, the unsharded parameters and gradients of each block), so each
step the kernel maps them again and zeroes every page on first touch: measured on
bench_hf.py's 55.6M-parameter Llama (benchmarks/probe_hf.py, 2 x 2 ranks, shard 2), 322,000
minor page faults per step and rank, 0.99 s of the step's 1.94 s of CPU spent in the kernel.

:func:`keep_freed_memory` raises both thresholds (``mallopt``), so that freed blocks up to
1 GiB are reused from the heap and the heap is never trimmed: the same step then makes a
handful of page faults and takes 1.27 s of CPU. The process keeps its high-water mark of
memory instead of shrinking between steps; the high-water mark itself does not grow.

Only on CPU (GPU training's large buffers are the CUDA caching allocator's), only with
glibc, and never when the job chose malloc's settings itself (glibc's ``MALLOC_*_``
variables or a ``glibc.malloc`` tunable): those win.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Mapping

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30
"""Blocks below this come from the heap (and are reused); larger ones are still mapped."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""mallopt takes an int: the largest one, i.e. the heap is in effect never trimmed."""
JOB_MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def job_sets_malloc(env: Mapping[str, str]) -> bool:
    """True when the environment sets glibc malloc's thresholds itself (pure)."""
    return any(name in env for name in JOB_MALLOC_VARIABLES) or "glibc.malloc." in env.get("GLIBC_TUNABLES", "")


def keep_freed_memory(env: Mapping[str, str]) -> bool:
    """Set glibc malloc's mmap and trim thresholds for this process (see the module
    docstring); True when they were set, False where the job set its own or this is not
    glibc on Linux."""
    if not sys.platform.startswith("linux") or job_sets_malloc(env):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt, gnu_get_libc_version = libc.mallopt, libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return False
    del gnu_get_libc_version
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
