"""``--compile``: ``torch.compile`` of each shard unit before ``fully_shard``, its cache in the
run directory, and the time the compiler took.

What the field does (torchtitan's per-block compile): each transformer block is compiled on
its own, before FSDP2 wraps it, so that FSDP2's hooks (all-gather before the block,
reduce-scatter after its backward) stay outside the graphs and the blocks' graphs are the
same graph (one compile for every block of a model: parameters are graph inputs). Here the
block's ``forward`` is what gets compiled (:func:`compile_units`): the module tree does not
change, so the state dict keys are the eager ones (no ``_orig_mod.``) and a checkpoint moves
between eager and compiled runs in both directions.

The compiler's caches (inductor's FX graph cache, AOTAutograd's, triton's kernels) live in
``<run_dir>/compile-cache/rank<N>`` (:func:`use_run_cache`), so that a resumed or requeued
attempt loads the compiled graphs instead of compiling again; :class:`CompileClock` measures
the seconds the compiler took inside each step and the cache's hits and misses, which the
step's record reports (``compile_s``, ``compile_cache``) apart from the step time.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from hpc_hsdp.errors import SpecError

CACHE_DIR = "compile-cache"
"""``<run_dir>/compile-cache/rank<N>``: this rank's inductor and triton caches."""
CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def cxx_compiler(env: Mapping[str, str] | None = None) -> str | None:
    """The C++ compiler inductor's CPU code generation would run (``$CXX``, else ``g++``, as
    torch's ``_inductor.config.cpp.cxx``), as a path; None when there is none."""
    env = os.environ if env is None else env
    return shutil.which(env.get("CXX") or "g++", path=env.get("PATH"))


def check_compile(compile_units_on: bool, device: torch.device, env: Mapping[str, str] | None = None) -> None:
    """Refuse ``--compile`` on CPU without a C++ compiler (inductor's CPU kernels are C++)."""
    if compile_units_on and device.type == "cpu" and cxx_compiler(env) is None:
        env = os.environ if env is None else env
        raise SpecError(
            f"--compile on CPU needs a C++ compiler for inductor, and {env.get('CXX') or 'g++'} is not on PATH; "
            "install g++ (apt-get install g++) or set CXX, or leave out --compile"
        )


def unit_modules(model: nn.Module, units: tuple[type, ...]) -> list[nn.Module]:
    """The modules of ``model`` that are instances of ``units`` and hold no other one: the
    innermost units, the ones ``fully_shard`` wraps first (compiling an outer unit would put
    the inner units' FSDP2 hooks inside its graph)."""
    if not units:
        return []
    matched = [m for m in model.modules() if m is not model and isinstance(m, units)]
    return [m for m in matched if not any(o is not m and isinstance(o, units) for o in m.modules())]


def compile_units(model: nn.Module, units: tuple[type, ...]) -> int:
    """``torch.compile`` the forward of each innermost shard unit in place (before
    ``fully_shard``: its pre/post-forward hooks run outside the graph); returns how many.
    Parameter names do not change. An activation-checkpointed forward compiles with its
    recomputation (the checkpoint is a higher-order op dynamo traces)."""
    compiled = 0
    for module in unit_modules(model, units):
        module.forward = torch.compile(module.forward)
        compiled += 1
    return compiled


def use_run_cache(run_dir: str | os.PathLike | None, rank: int, env: Mapping[str, str] | None = None) -> Path | None:
    """Point inductor's cache (and triton's, under it) at ``<run_dir>/compile-cache/rank<rank>``
    before the first compile; the directory, or None where the job set
    ``TORCHINDUCTOR_CACHE_DIR`` itself or there is no run directory. Per rank: the ranks of
    one node would otherwise race on the same entries of a shared file system."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: PLC0415 - only for --compile

    env = os.environ if env is None else env
    if run_dir is None or _chosen_by_the_job(env.get(CACHE_VARIABLE), default_cache_dir()):
        return None
    directory = Path(run_dir) / CACHE_DIR / f"rank{rank}"
    directory.mkdir(parents=True, exist_ok=True)
    os.environ[CACHE_VARIABLE] = _ours[CACHE_VARIABLE] = str(directory)
    if not os.environ.get("TRITON_CACHE_DIR") or os.environ["TRITON_CACHE_DIR"] == _ours.get("TRITON_CACHE_DIR"):
        os.environ["TRITON_CACHE_DIR"] = _ours["TRITON_CACHE_DIR"] = str(directory / "triton")
    return directory


def _chosen_by_the_job(value: str | None, torch_default: str) -> bool:
    """A cache directory the job set itself: not unset, not one this process set, not torch's
    default (``cache_dir()`` writes that into the environment when anything asks for it first,
    an ``import torchao`` for one)."""
    if not value:
        return False
    return value != _ours.get(CACHE_VARIABLE) and os.path.abspath(value) != os.path.abspath(torch_default)


_ours: dict[str, str] = {}
"""The cache variables this process set itself (a later run in the same process moves them)."""


def _cache_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters  # noqa: PLC0415 - dynamo loads only for --compile

    return {
        "fx_graph_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fx_graph_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
        "aot_autograd_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "aot_autograd_misses": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }


class CompileClock:
    """The seconds torch's compiler ran (dynamo's compile start/end callbacks: every frame
    compiled, the lazy backward compile included) and the cache's counters, since the last
    :meth:`take`."""

    def __init__(self) -> None:
        import torch._dynamo.callback as callback  # noqa: PLC0415 - dynamo loads only for --compile

        self._lock = threading.Lock()
        self._started: float | None = None
        self._seconds = 0.0
        self._counts = _cache_counts()
        self._handler = callback.callback_handler
        self._handler.register_start_callback(self._start)
        self._handler.register_end_callback(self._end)

    def _start(self, _args) -> None:
        with self._lock:
            self._started = time.perf_counter()

    def _end(self, _args) -> None:
        with self._lock:
            if self._started is not None:
                self._seconds += time.perf_counter() - self._started
                self._started = None

    def compiling(self) -> bool:
        """Whether the compiler is running now (the hang watchdog waits meanwhile)."""
        return self._started is not None

    def take(self) -> dict:
        """``{"compile_s": seconds, "compile_cache": {...hits and misses...}}`` since the last
        take; empty when the compiler did not run."""
        with self._lock:
            seconds, self._seconds = self._seconds, 0.0
        counts = _cache_counts()
        delta = {name: counts[name] - self._counts.get(name, 0) for name in counts}
        self._counts = counts
        if seconds == 0.0 and not any(delta.values()):
            return {}
        return {"compile_s": seconds, "compile_cache": delta}

    def close(self) -> None:
        for remove, callback in (
            (self._handler.remove_start_callback, self._start),
            (self._handler.remove_end_callback, self._end),
        ):
            try:
                remove(callback)
            except ValueError:  # torch._dynamo.reset() cleared the handler
                pass
