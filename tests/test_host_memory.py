"""On CPU a task keeps freed host memory (hpc_hsdp.runtime.host_memory): a large tensor freed
and allocated again every step is not mapped and zero-filled by the kernel again. Counted
in page faults (the kernel's own count, not a timing): a task started by ``run_task`` on CPU
against a plain forked process, both allocating and freeing the same 64 MiB tensor (above
glibc's largest automatic mmap threshold, 32 MiB) a dozen times."""

from __future__ import annotations

import pytest

from dist_helpers import in_child, launch
from hpc_hsdp.runtime.host_memory import job_sets_malloc, keep_freed_memory
from hpc_hsdp.spec import RunSpec

MIB_64 = 16 * 2**20  # float32 elements
PAGES_64_MIB = 64 * 2**20 // 4096


def faults_per_allocation(rounds: int = 12) -> float:
    """The median of the minor page faults of each allocate-fill-free of a 64 MiB tensor
    (the heap settles into place within the first few)."""
    import resource
    import statistics

    import torch

    counts = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(MIB_64).fill_(1.0)
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return statistics.median(counts)


def task_faults(ctx):
    """fn for run_task: the same count inside a task after hpc-hsdp's init on CPU."""
    return faults_per_allocation()


@pytest.mark.dist
def test_a_cpu_task_reuses_freed_memory_instead_of_faulting_it_in_again(tmp_path):
    plain = in_child(faults_per_allocation)
    outcomes = launch(RunSpec(shard_size=1, device="cpu", run_dir=str(tmp_path)), tasks_per_node=(1,), fn=task_faults)
    in_task = outcomes[0].value
    assert plain > PAGES_64_MIB / 2, f"a plain process should map the tensor afresh each time ({plain} faults)"
    assert in_task < PAGES_64_MIB / 100, f"a task faulted {in_task} pages per 64 MiB allocation (plain: {plain})"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, False),
        ({"MALLOC_TRIM_THRESHOLD_": "0"}, True),
        ({"MALLOC_MMAP_THRESHOLD_": "131072"}, True),
        ({"MALLOC_TOP_PAD_": "0"}, True),
        ({"MALLOC_MMAP_MAX_": "0"}, True),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True),
        ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"}, False),
        ({"MALLOC_ARENA_MAX": "2"}, False),
    ],
)
def test_the_jobs_own_malloc_settings_win(env, expected):
    assert job_sets_malloc(env) is expected
    if expected:
        assert keep_freed_memory(env) is False
