"""What every task runs: ``hpc-hsdp run`` on srun/torchrun, and ``submit`` through submitit.

``run_task`` joins the job (:func:`hpc_hsdp.runtime.dist.init`), runs ``fn(ctx)``, the
``--entry`` function or the built-in payload, and always tears the process group down.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping

from hpc_hsdp.errors import SpecError
from hpc_hsdp.spec import RunSpec


def resolve_entry(entry: str) -> Callable:
    """``module:function`` -> the function (imported now, so a typo fails before training)."""
    module_name, _, attribute = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"--entry {entry!r}: cannot import module {module_name!r} ({exc}); check PYTHONPATH on the nodes") from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise SpecError(f"--entry {entry!r}: module {module_name!r} has no function {attribute!r}")
    return fn


def run_task(spec: RunSpec, *, fn: Callable | None = None, env: Mapping[str, str] | None = None):
    """Run one task of the job; returns ``fn``'s / the entry's result or the payload's summary
    (``{"rank", "world_size", "shard_size", "start_step", "steps", "final_loss", "stopped"}``)."""
    from hpc_hsdp.runtime.dist import init

    if fn is None and spec.entry is not None:
        fn = resolve_entry(spec.entry)
    ctx = init(spec.shard_size, spec.device, spec.run_dir, spec.timeout_s, env=os.environ if env is None else env)
    try:
        ctx.spec = spec
        if fn is None:
            from hpc_hsdp.runtime.train import payload

            return payload(ctx)
        return fn(ctx)
    finally:
        ctx.shutdown()
