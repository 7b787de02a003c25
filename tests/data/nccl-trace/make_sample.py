"""Writes ``nccl-trace-rank<N>.pkl`` here: the flight recorder dumps of a 2 x 2 HSDP job
(replicate 2, shard 2; ranks 0,1 and 2,3 shard groups, 0,2 and 1,3 replicate groups) that hung
in its step 7 because rank 3 never left its data read.

The schema is torch 2.13's (``torch/distributed/flight_recorder/components``: the dump's
``version``, ``pg_config``, ``pg_status``, ``entries`` with ``process_group`` (name, desc),
``collective_seq_id``, ``profiling_name``, ``state``, ...). DeviceMesh's groups come from
``split_group``: every shard group is named "1" and every replicate group "2", told apart by
their ranks. Each step: 3 all-gathers and 2 reduce-scatters in the shard group, 1 all-reduce
in the replicate group, the loop's fused all-reduce in the default group. Steps 1-6 complete
everywhere; in step 7 ranks 0,1 finish their shard-group work and wait in the replicate
all-reduce (with 2 and 3), rank 2 waits in the first all-gather of its shard group (with 3),
rank 3 entered nothing of step 7. Run ``python make_sample.py`` to write them again.
"""

import pickle
from pathlib import Path

SHARD = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
REPLICATE = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
STEP = [("1", "nccl:_allgather_base")] * 3 + [("1", "nccl:_reduce_scatter_base")] * 2
STEP += [("2", "nccl:all_reduce"), ("0", "nccl:all_reduce")]
DESC = {"0": "default_pg", "1": "mesh_shard", "2": "mesh_replicate"}
FRAMES = [
    {"name": "all_gather_into_tensor", "filename": "torch/distributed/distributed_c10d.py", "line": 3871},
    {"name": "foreach_all_gather", "filename": "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "line": 245},
]


def dump(rank: int) -> dict:
    seq = {"0": 0, "1": 0, "2": 0}
    entries, record, waiting_in = [], 0, None
    time = 1_733_000_000_000_000_000
    steps_done = 6
    # how far into step 7 each rank got: ranks 0,1 to the replicate all_reduce, 2 the first gather, 3 nothing
    into_step_7 = {0: 6, 1: 6, 2: 1, 3: 0}[rank]
    for step in range(1, steps_done + 2):
        todo = STEP if step <= steps_done else STEP[:into_step_7]
        for index, (group, name) in enumerate(todo):
            seq[group] += 1
            time += 1_000_000
            pending = step > steps_done and index == len(todo) - 1
            waiting_in = group if pending else waiting_in
            ranks = {"0": [0, 1, 2, 3], "1": SHARD[rank], "2": REPLICATE[rank]}[group]
            size = [[4096]] if "gather" in name else [[8192]]
            entries.append(
                {
                    "record_id": record,
                    "pg_id": int(group),
                    "process_group": (group, DESC[group]),
                    "collective_seq_id": seq[group],
                    "p2p_seq_id": 0,
                    "op_id": seq[group],
                    "profiling_name": name,
                    "time_created_ns": time + (500_000 if rank in (0, 1) else 0),
                    "duration_ms": None if pending else 0.21,
                    "input_sizes": size,
                    "input_dtypes": ["BFloat16"],
                    "output_sizes": [[size[0][0] * len(ranks)]] if "gather" in name else size,
                    "output_dtypes": ["BFloat16"],
                    "state": "started" if pending else "completed",
                    "time_discovered_started_ns": time + 10_000,
                    "time_discovered_completed_ns": None if pending else time + 220_000,
                    "retired": not pending,
                    "timeout_ms": 600_000,
                    "is_p2p": False,
                    "frames": FRAMES,
                }
            )
            record += 1
    pg_config = {
        "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
        "1": {"name": "1", "desc": "mesh_shard", "ranks": str(SHARD[rank])},
        "2": {"name": "2", "desc": "mesh_replicate", "ranks": str(REPLICATE[rank])},
    }
    pg_status = {
        g: {
            "last_enqueued_collective": seq[g],
            "last_started_collective": seq[g],
            "last_completed_collective": seq[g] - (g == waiting_in),
        }
        for g in seq
    }
    return {"version": "2.10", "pg_config": pg_config, "pg_status": pg_status, "entries": entries}


if __name__ == "__main__":
    here = Path(__file__).parent
    for rank in range(4):
        (here / f"nccl-trace-rank{rank}.pkl").write_bytes(pickle.dumps(dump(rank), protocol=2))
