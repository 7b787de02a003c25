"""The fabric check (``hpc-hsdp check``, ``submit --check``): every node's devices and links measured
in a few seconds, before training, over the backend the training uses.

:func:`run_check` is an ``--entry``: the job's own ranks run it (srun, one task per GPU, the same
rank layout and process group as training). Each rank times a fixed matrix multiply, a copy from
host to device and the memory it can allocate; each node's ranks all-reduce among themselves; the
links between nodes are measured by one rank of each node, pairs of nodes in rounds
(:func:`hpc_hsdp.plan.fabric_check_rounds.pair_rounds`), every pair of a round at once. Rank 0 gathers the
figures, judges them against their peers' median (:func:`hpc_hsdp.plan.fabric_check_rounds.verdict`), writes
``check.json`` to the run directory and prints the table.
"""

from __future__ import annotations

import glob
import os
import time
from statistics import median

import torch
import torch.distributed as dist

from hpc_hsdp.files import write_atomically
from hpc_hsdp.plan.fabric_check_rounds import (
    DEFAULT_THRESHOLD,
    THRESHOLD_ENV,
    check_threshold,
    nccl_transport,
    pair_rounds,
    table,
    transport_warning,
    verdict,
)
from hpc_hsdp.rundir.observation.fabric_check_record import CHECK_RECORD
from hpc_hsdp.task.observation.log import say

WINDOW_S = 0.1
"""How long each window of a device figure (matmuls, copies) runs; the best of five counts."""
REPEATS = 4
"""All-reduces per round of a figure (a collective: every member calls it as often)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(device: torch.device, fn, window_s: float, windows: int = 5) -> float:
    """Calls of ``fn`` per second: the best of ``windows`` windows of ``window_s`` (after one warm-up
    call). Another process taking the CPU (or the device) only ever lowers a rate, so the best window
    is what the node can do; a node slowed most of the time (a throttled GPU, a busy host) is slow in
    every window."""
    fn()
    _sync(device)
    rates = []
    for _ in range(windows):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            _sync(device)
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= window_s:
                break
        rates.append(calls / elapsed)
    return max(rates)


def _collective_seconds(device: torch.device, fn, repeats: int, rounds: int = 3) -> float:
    """Seconds per call of a collective ``fn``: the median of ``rounds`` rounds of ``repeats`` calls
    (every member calls it as often). Not the fastest round: the network buffers what a slowed
    peer has not read yet, so one round can pass while that peer barely ran."""
    fn()
    _sync(device)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / repeats)
    return median(times)


def _device_figures(device: torch.device, local_world_size: int, window_s: float) -> dict:
    n = 4096 if device.type == "cuda" else 192
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    figures = {"matmul_tflops": 2 * n**3 * _rate(device, lambda: torch.mm(a, b), window_s) / 1e12}
    if device.type == "cuda":  # a CPU has no host-to-device copy
        size = 256 << 20
        host = torch.empty(size // 4, dtype=torch.float32, pin_memory=True)
        target = torch.empty_like(host, device=device)
        figures["copy_gbps"] = size * _rate(device, lambda: target.copy_(host, non_blocking=True), window_s) / 1e9
        figures["memory_gib"] = torch.cuda.mem_get_info(device)[0] / 2**30
    else:
        figures["memory_gib"] = _available_host_bytes() / max(1, local_world_size) / 2**30
    return figures


def _available_host_bytes() -> int:
    """What the kernel can give without swapping (``MemAvailable``: free memory and the page cache it
    can drop); free memory alone swings with the page cache."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _allreduce_figures(device: torch.device, group, members: int, *, size: int, repeats: int) -> dict:
    """Bus bandwidth (the ring's ``2 (n - 1) / n`` of the bytes per second) and the latency of a
    4-byte all-reduce in ``group``."""
    data = torch.ones(size // 4, device=device)
    seconds = _collective_seconds(device, lambda: dist.all_reduce(data, group=group), repeats)
    tiny = torch.ones(1, device=device)
    latency = _collective_seconds(device, lambda: dist.all_reduce(tiny, group=group), 4 * repeats)
    return {"busbw_gbps": 2 * (members - 1) / members * size / seconds / 1e9, "latency_us": latency * 1e6}


def run_check(ctx) -> dict:
    """Measure, gather, judge; rank 0 writes ``check.json``. Collective: every rank of the job."""
    threshold = check_threshold(float(os.environ.get(THRESHOLD_ENV, DEFAULT_THRESHOLD)))
    started = time.monotonic()
    device, rank = ctx.device, ctx.rank
    realized = ctx.realized
    node_of = [r["node"] for r in realized]
    names = list(dict.fromkeys(node_of))
    ranks_of = {name: [r for r, n in enumerate(node_of) if n == name] for name in names}
    me = node_of[rank]
    size = (64 if device.type == "cuda" else 4) << 20

    dist.barrier()  # every rank measures its device at once, as training would load them
    mine = {"rank": rank, "node": me, **_device_figures(device, len(ranks_of[me]), WINDOW_S)}
    # every rank creates every group, in one order (torch.distributed's rule)
    node_groups = {name: dist.new_group(ranks_of[name]) for name in names}
    if len(ranks_of[me]) > 1:
        intra = _allreduce_figures(device, node_groups[me], len(ranks_of[me]), size=size, repeats=REPEATS)
        mine["intra_busbw_gbps"] = intra["busbw_gbps"]
    rounds = pair_rounds(len(names))
    links = {}
    for pairs in rounds:
        groups = [(a, b, dist.new_group([ranks_of[names[a]][0], ranks_of[names[b]][0]])) for a, b in pairs]
        for a, b, group in groups:
            if rank in (ranks_of[names[a]][0], ranks_of[names[b]][0]):
                links[f"{names[a]}-{names[b]}"] = _allreduce_figures(device, group, 2, size=size, repeats=REPEATS)
        dist.barrier()
    if links:
        mine["links"] = links
    gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, mine)
    if rank != 0:
        return {"rank": rank}
    nodes, link_figures = _per_node(gathered, names)
    found = verdict(nodes, link_figures, threshold=threshold)
    transport = nccl_transport(_nccl_lines()) if device.type == "cuda" else None
    record = {
        "job_id": os.environ.get("SLURM_JOB_ID", ""),  # whose check it is: the batch step and `check` ask
        "time": time.time(),
        "seconds": round(time.monotonic() - started, 3),
        "threshold": threshold,
        "backend": dist.get_backend(),
        "transport": transport,
        "nodes": nodes,
        "links": link_figures,
        "rounds": [[f"{names[a]}-{names[b]}" for a, b in pairs] for pairs in rounds],
        **found.to_dict(),
    }
    warning = transport_warning(transport)
    if warning:
        record["transport_warning"] = warning
    if ctx.run_dir is not None:
        write_atomically(ctx.run_dir / CHECK_RECORD, _json(record), mode=0o644)
    for line in table(nodes, link_figures, found):
        say(f"check: {line}")
    for finding in found.findings:
        say(f"check: {finding.line()}")
    if warning:
        say(f"check: warning: {warning}")
    say(
        f"check: {len(names)} node(s), {len(link_figures)} link(s) in {record['seconds']:.1f} s: "
        + (f"bad: {', '.join(found.bad_nodes)}" if found.bad_nodes else "no node below its peers")
    )
    return record


def _per_node(gathered: list[dict], names: list[str]) -> tuple[dict, dict]:
    """Each node's figures (the worst of its ranks) and each link's."""
    nodes: dict[str, dict] = {}
    links: dict[str, dict] = {}
    for figures in gathered:
        node = nodes.setdefault(figures["node"], {"ranks": 0})
        node["ranks"] += 1
        for key in ("matmul_tflops", "copy_gbps", "memory_gib", "intra_busbw_gbps"):
            if key in figures:
                node[key] = min(node.get(key, figures[key]), figures[key])
        for name, link in figures.get("links", {}).items():
            seen = links.setdefault(name, dict(link))
            seen["busbw_gbps"] = min(seen["busbw_gbps"], link["busbw_gbps"])
            seen["latency_us"] = max(seen["latency_us"], link["latency_us"])
    return {name: nodes[name] for name in names}, links


def _nccl_lines():
    """The lines of NCCL's debug files of this job (``NCCL_DEBUG_FILE``), when it wrote them."""
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    if not pattern:
        return
    for path in glob.glob(pattern.replace("%h", "*").replace("%p", "*")):
        try:
            with open(path, errors="replace") as handle:
                yield from handle
        except OSError:
            continue


def _json(record: dict) -> str:
    import json  # noqa: PLC0415 - only rank 0, once

    return json.dumps(record, indent=1) + "\n"
