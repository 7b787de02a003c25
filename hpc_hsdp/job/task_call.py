"""What a submitted task runs, named by its import path: the job layer never imports the runtime.

submitit pickles the callable it is given; a :class:`TaskCall` pickles as its path, and
the runtime (and torch) load on the task when it is called, as ``torchrun`` names its
entry point by module.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskCall:
    """A runtime function named ``"module:function"``, called on the task."""

    target: str

    def resolve(self):
        module, _, name = self.target.partition(":")
        return getattr(importlib.import_module(module), name)

    def __call__(self, *args, **kwargs):
        return self.resolve()(*args, **kwargs)


RUN_TASK = TaskCall("hpc_hsdp.task.entry:task_main")
"""``hpc-hsdp run`` on one task: its layout, process group, mesh and payload."""
RUN_TORCHRUN = TaskCall("hpc_hsdp.task.torchrun:launch_torchrun")
"""One task per node that starts torchrun's workers."""
