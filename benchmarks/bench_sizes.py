"""Cost of plan and render against the job size: the curve must be linear at most, and the
command at 4,096 nodes x 8 GPUs must answer in well under a second.

    python benchmarks/bench_sizes.py [--runs N]

In process (median of N runs each), for nodes = 1, 16, 64, ..., 65,536 x 8 GPUs:
  plan    TopologyPlan + the text table (what `hpc-hsdp plan` prints)
  json    TopologyPlan + to_dict + json.dumps (`plan --json`, every rank listed)
  render  JobSpec + render_sbatch (`hpc-hsdp render`)
each as milliseconds, ratio to the same work at 16 nodes, and that ratio divided by the size
ratio (<= 1 means linear or better). Then the commands themselves, interleaved with the
1-node command as baseline: `hpc-hsdp plan|render --nodes 4096` wall time and ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

from bench_cli import byte_compile_package, hpc_hsdp_command

SIZES = (1, 16, 64, 256, 1024, 4096, 16384, 65536)
BASE = 16
GPUS = 8


def work(kind: str, nodes: int) -> None:
    from hpc_hsdp.job.spec import JobSpec, RunSpec
    from hpc_hsdp.plan.topology import plan_for
    from hpc_hsdp.plan.view import plan_text
    from hpc_hsdp.submit_host.render import render_sbatch

    if kind == "plan":
        plan_text(plan_for(nodes=nodes, gpus_per_node=GPUS, shard_size=8))
    elif kind == "json":
        json.dumps(plan_for(nodes=nodes, gpus_per_node=GPUS, shard_size=8).to_dict())
    else:
        render_sbatch(JobSpec(nodes=nodes, gpus_per_node=GPUS, run=RunSpec(shard_size=8, run_dir="/tmp/bench-sizes")))


def curve(runs: int) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for kind in ("plan", "json", "render"):
        out[kind] = {}
        for nodes in SIZES:
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                work(kind, nodes)
                times.append(time.perf_counter() - start)
            out[kind][nodes] = statistics.median(times)
    return out


def commands(runs: int) -> dict[str, float]:
    cli = hpc_hsdp_command()
    cmds = {
        "plan --nodes 1": [*cli, "plan", "--nodes", "1", "--shard", "8"],
        "plan --nodes 4096": [*cli, "plan", "--nodes", "4096", "--shard", "8"],
        "plan --nodes 4096 --json": [*cli, "plan", "--nodes", "4096", "--shard", "8", "--json"],
        "render --nodes 1": [*cli, "render", "--nodes", "1", "--shard", "8", "--venv", "none", "--run-dir", "/tmp/b"],
        "render --nodes 4096": [
            *cli,
            "render",
            "--nodes",
            "4096",
            "--shard",
            "8",
            "--venv",
            "none",
            "--run-dir",
            "/tmp/b",
        ],
        "plan --nodes 99999999 (refused)": [*cli, "plan", "--nodes", "99999999", "--shard", "8"],
    }
    times: dict[str, list[float]] = {name: [] for name in cmds}
    for _ in range(runs):
        for name, cmd in cmds.items():
            start = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    byte_compile_package()
    measured = curve(args.runs)
    print(f"in process, median of {args.runs}; ratio to {BASE} nodes; per-size = ratio / (nodes / {BASE})")
    print(f"{'nodes x 8':>12} " + " ".join(f"{k + ' ms':>10} {'ratio':>8} {'per-size':>8}" for k in measured))
    for nodes in SIZES:
        cells = []
        for by_size in measured.values():
            ratio = by_size[nodes] / by_size[BASE]
            cells.append(f"{by_size[nodes] * 1000:>10.2f} {ratio:>8.2f} {ratio / (nodes / BASE):>8.2f}")
        print(f"{nodes:>12,} " + " ".join(cells))
    walls = commands(args.runs)
    print(f"\ncommands, median wall of {args.runs} interleaved runs")
    for name, wall in walls.items():
        base = walls["render --nodes 1"] if name.startswith("render") else walls["plan --nodes 1"]
        print(f"  {name:<34} {wall * 1000:8.0f} ms  ratio {wall / base:5.2f}")


if __name__ == "__main__":
    main()
