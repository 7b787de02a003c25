"""``--compile`` without a job: the units compiled, the refusal without a C++ compiler (one line,
exit 2, nothing written), the cache's place, the hang watchdog waiting while the compiler runs."""

from __future__ import annotations

import os
import subprocess
import sys

from dist_helpers import job_envs
from torch import nn

from hpc_hsdp.task.parallelism.compile import unit_modules


def test_unit_modules_are_the_innermost_units():
    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Inner(), nn.Linear(2, 2)

    model = nn.Sequential(Outer(), Inner(), nn.Sequential(Outer()))
    found = unit_modules(model, (Outer, Inner))
    assert [type(m).__name__ for m in found] == ["Inner", "Inner", "Inner"]
    assert unit_modules(model, (Outer,)) == [model[0], model[2][0]]
    assert unit_modules(model, ()) == []


def test_compile_on_cpu_without_a_cxx_compiler_is_one_line_and_writes_nothing(tmp_path):
    env = dict(job_envs(tasks_per_node=[1])[0], CXX=str(tmp_path / "no-such-c++"))
    env["PATH"] = os.environ["PATH"]
    run = tmp_path / "run"
    args = [sys.executable, "-m", "hpc_hsdp", "run", "--device", "cpu", "--run-dir", str(run), "--compile"]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    errors = [x for x in out.stderr.splitlines() if "error" in x]
    assert len(errors) == 1 and "--compile on CPU needs a C++ compiler" in errors[0], out.stderr
    assert not run.exists() or not any(run.iterdir()), list(run.rglob("*"))


def test_the_cache_stays_where_the_job_put_it_but_not_where_torch_defaulted_it():
    from hpc_hsdp.task.parallelism.compile import _chosen_by_the_job

    assert not _chosen_by_the_job(None, "/tmp/torchinductor_me")
    assert not _chosen_by_the_job("/tmp/torchinductor_me", "/tmp/torchinductor_me")  # torch's, set by an import
    assert _chosen_by_the_job("/scratch/cache", "/tmp/torchinductor_me")


def test_the_hang_watchdog_waits_while_the_compiler_runs():
    import time
    from types import SimpleNamespace

    from hpc_hsdp.task.resilience.watchdog import Watchdog

    compiling = [True]
    watchdog = Watchdog(SimpleNamespace(rank=0, world_size=1, run_dir=None), timeout_s=0.3, exit_fn=lambda code: None)
    hung = []
    watchdog._hung = lambda: hung.append(time.monotonic())
    watchdog.busy = lambda: compiling[0]
    watchdog.start(step=1)
    watchdog.step_times = [0.01]  # past step 1: the configured timeout, not the start-up floor (a recompile)
    try:
        time.sleep(1.2)  # four timeouts of compiling: no hang
        assert not hung
        compiling[0] = False
        ended = time.monotonic()
        time.sleep(1.5)
        assert hung and hung[0] - ended >= 0.25, hung  # a full timeout after the compile, not before
    finally:
        watchdog.stop()
