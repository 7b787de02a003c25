"""Start-up cost of the CLI commands against the floor they cannot beat: importing click and jinja2.

    python benchmarks/bench_cli.py [--runs N]

Runs, interleaved so that machine noise hits all alike, N times each:
  baseline  python -c "import click, jinja2"
  render    hpc-hsdp render --nodes 2 --shard 4 --venv none --run-dir /tmp/bench-run
  plan      hpc-hsdp plan --nodes 2 --shard 4
and prints the medians and each command's ratio to the baseline (target: render <= 1.3).
The package is byte-compiled first (as an installed wheel is), since click and jinja2 are:
under PYTHONDONTWRITEBYTECODE=1 an editable checkout would otherwise recompile every run.
Diagnose a high ratio with:  python -X importtime -m hpc_hsdp render --nodes 2 --shard 4 2>&1 | sort -t'|' -k2 -n
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET = 1.3


def hpc_hsdp_command() -> list[str]:
    script = Path(sys.executable).with_name("hpc-hsdp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hpc_hsdp"]


def commands() -> dict[str, list[str]]:
    cli = hpc_hsdp_command()
    return {
        "baseline": [sys.executable, "-c", "import click, jinja2"],
        "render": [*cli, "render", "--nodes", "2", "--shard", "4", "--venv", "none", "--run-dir", "/tmp/bench-run"],
        "plan": [*cli, "plan", "--nodes", "2", "--shard", "4"],
    }


def byte_compile_package() -> None:
    import compileall

    import hpc_hsdp

    compileall.compile_dir(str(Path(hpc_hsdp.__file__).parent), quiet=1)


def measure(runs: int) -> dict[str, list[float]]:
    byte_compile_package()
    cmds = commands()
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for cmd in cmds.values():  # warm the file cache once
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    for _ in range(runs):
        for name, cmd in cmds.items():
            start = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    times = measure(args.runs)
    base = statistics.median(times["baseline"])
    print(f"{'command':<10} {'median ms':>10} {'ratio':>7}   (n={args.runs}, interleaved)")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<10} {median * 1000:>10.1f} {median / base:>7.2f}")
    ratio = statistics.median(times["render"]) / base
    verdict = "ok" if ratio <= TARGET else "ABOVE TARGET"
    print(f"render / baseline = {ratio:.2f} (target <= {TARGET}): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
