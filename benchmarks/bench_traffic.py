"""Inter-node bytes per step per rank on an emulated 2 x 8 job, measured with --comm-stats,
next to the analytic values of `hpc-hsdp plan` (hpc_hsdp.plan.estimates).

    python benchmarks/bench_traffic.py [--shards 1,4,16]

Each shard size is one job step of 16 processes (`hpc-hsdp run --comm-stats`, 2 steps,
gloo on CPU); the numbers are rank 0's step-2 record in metrics.jsonl. "model" is the
shard + replicate traffic that the estimate predicts; the payload's loss all-reduce (one
fp32 over all 16 ranks) is shown separately in "total".
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import hpc_hsdp_command, job_step  # noqa: E402

from hpc_hsdp.plan.estimates import estimate  # noqa: E402
from hpc_hsdp.plan.shapes import parameter_counts  # noqa: E402
from hpc_hsdp.plan.topology import plan_for  # noqa: E402

MODEL = {"layers": 2, "width": 64, "heads": 4, "seq_len": 32, "vocab_size": 256}
NAMES = {1: "DDP-like", 4: "HSDP", 8: "HSDP, node-sized", 16: "full FSDP"}


def measure_one(shard: int, work: Path) -> dict:
    run_dir = work / f"shard{shard}"
    argv = [
        *hpc_hsdp_command(),
        "run",
        "--shard",
        str(shard),
        "--device",
        "cpu",
        "--run-dir",
        str(run_dir),
        "--steps",
        "2",
        "--comm-stats",
        "--reshard-after-forward",
        "always",
        *[a for k, v in MODEL.items() for a in (f"--{k.replace('_', '-')}", str(v))],
    ]
    job_step(argv, tasks_per_node=(8, 8), log_dir=work / f"logs{shard}")
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["comm"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="1,4,16")
    args = parser.parse_args(argv)
    shards = [int(s) for s in args.shards.split(",")]
    counts_p = parameter_counts(**MODEL)
    print(f"2 nodes x 8 ranks, built-in model {counts_p.unpadded_params:,} parameters (fp32); bytes per step per rank")
    print(
        f"{'shard':>5} {'layout':<17} {'inter measured':>15} {'inter analytic':>15} {'intra measured':>15} "
        f"{'intra analytic':>15} {'total inter':>12} {'equal?':>7}"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="hpc-hsdp-traffic-") as tmp:
        for s in shards:
            comm = measure_one(s, Path(tmp))
            counts = parameter_counts(**MODEL, shard_size=s)
            est = estimate(
                plan_for(nodes=2, gpus_per_node=8, shard_size=s),
                model_params=counts.params,
                root_params=counts.root_params,
            )
            model_inter = sum(
                comm[a][k]["wire_bytes"]
                for a in ("shard", "replicate")
                if a in comm and comm[a]["inter_node"]
                for k in ("all_gather", "reduce_scatter", "all_reduce")
                if k in comm[a]
            )
            model_intra = sum(
                comm[a][k]["wire_bytes"]
                for a in ("shard", "replicate")
                if a in comm and not comm[a]["inter_node"]
                for k in ("all_gather", "reduce_scatter", "all_reduce")
                if k in comm[a]
            )
            same = model_inter == est.inter_node_wire_bytes and model_intra == est.intra_node_wire_bytes
            rows.append((s, model_inter, est.inter_node_wire_bytes, same))
            print(
                f"{s:>5} {NAMES.get(s, ''):<17} {model_inter:>15,} {est.inter_node_wire_bytes:>15,} {model_intra:>15,} "
                f"{est.intra_node_wire_bytes:>15,} {comm['inter_node_wire_bytes']:>12,} {'yes' if same else 'NO':>7}"
            )
    base = rows[0][1] or 1
    print(
        "inter-node bytes relative to shard "
        + f"{rows[0][0]}: "
        + ", ".join(f"shard {s}: {m / base:.2f}" for s, m, _, _ in rows)
    )
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
