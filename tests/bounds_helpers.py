"""Helpers shared by tests (moved out of tests/fast/test_bounds_and_resubmit.py: no test module imports another)."""

from __future__ import annotations

import resource

MEMORY_LIMIT = 1 << 30  # 1 GiB of address space: more than a 4,096-node plan needs, far less than a runaway one


def limit_memory() -> None:
    """A child's address space limited to :data:`MEMORY_LIMIT` (``preexec_fn`` of :func:`cli_helpers.hpc`)."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
