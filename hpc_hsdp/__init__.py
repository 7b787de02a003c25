"""hpc-hsdp: HSDP training on SLURM, correct by construction.

The pure parts (topology, render) import no torch; ``init`` and ``wrap_hsdp`` load the
on-node runtime (and torch) only when called.
"""

from __future__ import annotations

import importlib

from hpc_hsdp._version import __version__
from hpc_hsdp.errors import HsdpError
from hpc_hsdp.plan.topology import RankLayout, TopologyPlan, plan_for

__all__ = [
    "HsdpError",
    "RankLayout",
    "TopologyPlan",
    "TrainingRun",
    "init",
    "plan_for",
    "submit",
    "submit_sweep",
    "wrap_hsdp",
    "__version__",
]

# name -> module that defines it; loaded on first use so `import hpc_hsdp` stays torch-free
_LAZY = {
    "init": "hpc_hsdp.task.parallelism.dist",
    "wrap_hsdp": "hpc_hsdp.task.parallelism.hsdp",
    "submit": "hpc_hsdp.submit_host.api",
    "submit_sweep": "hpc_hsdp.submit_host.api",
    "TrainingRun": "hpc_hsdp.task.training.own_loop",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpc_hsdp' has no attribute {name!r}")
