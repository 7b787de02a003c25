"""The fabric check's plan and verdict (pure: no torch): which nodes measure their link together in
which round, and which nodes and links fall below their peers.

Every node measures its devices (a fixed matrix multiply, a host-to-device copy, the memory it can
allocate) and the all-reduce among its own ranks; the links between nodes are measured by pairs of
nodes, one rank of each, in rounds: round 0 pairs nodes (0, 1), (2, 3), ...; round 1 pairs (1, 2),
(3, 4), ... and (last, 0). Each pair of a round runs at once, so the check costs two or three rounds
whatever the node count, and every node (of more than two) is measured on two links:
a node whose fastest link is slow is the slow one, a link slow alone is named as a link. On an odd
count a third round closes the ring (last, 0).

A figure below ``threshold`` x the median of its peers (the same figure on the other nodes, or
links) marks its node (or link) bad.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from hpc_hsdp.errors import SpecError
from hpc_hsdp.plan.records import record

DEFAULT_THRESHOLD = 0.7
THRESHOLD_ENV = "HPC_HSDP_CHECK_THRESHOLD"
"""How ``--check-threshold`` reaches the check's tasks (the rendered script exports it)."""
NODE_FIGURES = (
    ("matmul_tflops", "matmul TFLOP/s"),
    ("copy_gbps", "host->device GB/s"),
    ("memory_gib", "memory GiB"),
    ("intra_busbw_gbps", "intra-node all-reduce GB/s"),
)
"""Per node, higher is better: (key, what a table says)."""
LINK_FIGURES = (("busbw_gbps", "all-reduce GB/s"),)
LATENCY = "latency_us"
"""Shown, not judged: a 4-byte all-reduce's time swings by 2x on a loaded machine; the bandwidth
carries the verdict."""


def check_threshold(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise SpecError(
            f"--check-threshold {value!r} must be between 0 and 1 (exclusive): the share of its peers' median "
            f"below which a node or link is named, e.g. 0.7"
        )
    return float(value)


def pair_rounds(nodes: int) -> list[list[tuple[int, int]]]:
    """The pairs of node indices that measure their link together, round by round: every node on
    two links (one when there are two nodes), the pairs of a round disjoint, at most three rounds."""
    if nodes < 2:
        return []
    if nodes == 2:
        return [[(0, 1)]]
    first = [(i, i + 1) for i in range(0, nodes - 1, 2)]
    second = [(i, i + 1) for i in range(1, nodes - 1, 2)]
    if nodes % 2 == 0:
        return [first, [*second, (nodes - 1, 0)]]
    return [first, second, [(nodes - 1, 0)]]


@record(kw_only=False)
class Finding:
    """One node or link below its peers."""

    kind: str
    """``node`` or ``link``."""
    name: str
    """The node's name, or ``a-b`` for a link."""
    figure: str
    value: float
    median: float

    def line(self) -> str:
        return (
            f"{self.kind} {self.name}: {self.figure} {self.value:.3g}, {self.value / self.median:.0%} of its peers' "
            f"median {self.median:.3g}"
            if self.median
            else f"{self.kind} {self.name}: {self.figure} {self.value:.3g}"
        )


def _low(values: Mapping[str, object], threshold: float, kind: str, figure: str) -> list[Finding]:
    """Those below ``threshold`` x the median of the others (their peers, not themselves: with two
    nodes the median of both would halve what the slow one is measured against)."""
    from statistics import median  # noqa: PLC0415 - statistics loads fractions and decimal: not at render's start

    known = {k: v for k, v in values.items() if isinstance(v, (int, float))}
    if len(known) < 2:
        return []
    found = []
    for name, value in known.items():
        peers = median(v for k, v in known.items() if k != name)
        if peers > 0 and value < threshold * peers:
            found.append(Finding(kind, name, figure, value, peers))
    return found


@record
class Verdict:
    findings: tuple[Finding, ...]
    bad_nodes: tuple[str, ...]
    """Nodes to leave out: slow themselves, or on two slow links."""
    bad_links: tuple[str, ...]
    """Links slow alone (neither node can be blamed from them)."""

    def to_dict(self) -> dict:
        return {
            "bad_nodes": list(self.bad_nodes),
            "bad_links": list(self.bad_links),
            "findings": [
                {"kind": f.kind, "name": f.name, "figure": f.figure, "value": f.value, "median": f.median}
                for f in self.findings
            ],
        }


def verdict(nodes: dict[str, dict], links: dict[str, dict], *, threshold: float = DEFAULT_THRESHOLD) -> Verdict:
    """``nodes``: node name -> its figures (:data:`NODE_FIGURES`, the worst of its ranks);
    ``links``: ``a-b`` -> its figures (:data:`LINK_FIGURES`, and :data:`LATENCY`, shown only)."""
    findings: list[Finding] = []
    for key, label in NODE_FIGURES:
        findings += _low({n: f.get(key) for n, f in nodes.items()}, threshold, "node", label)
    for key, label in LINK_FIGURES:
        findings += _low({n: f.get(key) for n, f in links.items()}, threshold, "link", label)
    bad_nodes = {f.name for f in findings if f.kind == "node"}
    # a node's link figure is its fastest link: a slow node slows every link it is on (and with three
    # nodes those are two of the three, so the links' median is no yardstick), a slow link alone does not
    best: dict[str, float] = {}
    for link, f in links.items():
        value = f.get("busbw_gbps")
        if value is None:
            continue
        for node in link.split("-", 1):
            best[node] = max(best.get(node, 0.0), value)
    if len(best) >= 3:
        blamed = _low(best, threshold, "node", "fastest link's all-reduce GB/s")
        findings += [f for f in blamed if f.name not in bad_nodes]
        bad_nodes |= {f.name for f in blamed}
    slow_links = sorted({f.name for f in findings if f.kind == "link"})
    alone = tuple(link for link in slow_links if not set(link.split("-", 1)) & bad_nodes)
    order = list(nodes)
    return Verdict(
        findings=tuple(findings),
        bad_nodes=tuple(sorted(bad_nodes, key=lambda n: order.index(n) if n in order else len(order))),
        bad_links=alone,
    )


def table(nodes: dict[str, dict], links: dict[str, dict], found: Verdict) -> list[str]:
    """The check's figures, one line per node and per link, the bad ones marked."""
    bad = set(found.bad_nodes) | set(found.bad_links)
    lines = [
        f"{'node':<12} {'matmul TFLOP/s':>14} {'h->d GB/s':>9} {'memory GiB':>10} {'intra all-reduce GB/s':>21}",
    ]
    for name, f in nodes.items():
        lines.append(
            f"{name:<12} {_num(f.get('matmul_tflops')):>14} {_num(f.get('copy_gbps')):>9} "
            f"{_num(f.get('memory_gib')):>10} {_num(f.get('intra_busbw_gbps')):>21}"
            + ("  <- below its peers" if name in bad else "")
        )
    if links:
        lines.append(f"{'link':<12} {'all-reduce GB/s':>15} {'latency us':>10}")
        for name, f in links.items():
            lines.append(
                f"{name:<12} {_num(f.get('busbw_gbps')):>15} {_num(f.get(LATENCY)):>10}"
                + ("  <- below its peers" if name in bad else "")
            )
    return lines


def _num(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "?"


_USING_NETWORK = re.compile(r"NCCL INFO Using network (\w+)")
_VIA_NET = re.compile(r"via NET/(\w+)")


def nccl_transport(lines) -> str | None:
    """The network transport NCCL chose between nodes, from its own ``NCCL_DEBUG=INFO`` lines:
    ``Using network IB|Socket|...``, else a channel's ``via NET/IB``; None when the lines do not say
    (``NET/IB : No device found`` is what it tried, not what it uses)."""
    via = None
    for line in lines:
        found = _USING_NETWORK.search(line)
        if found:
            return found.group(1)
        if via is None:
            found = _VIA_NET.search(line)
            via = found.group(1) if found else None
    return via


def transport_warning(transport: str | None, *, expect: str = "IB") -> str | None:
    """A warning when NCCL moved the bytes between nodes over sockets where InfiniBand or RoCE (or
    another RDMA network, ``expect``) was expected."""
    if transport is None or transport != "Socket" or expect == "Socket":
        return None
    return (
        "NCCL uses TCP sockets between nodes (NET/Socket), not InfiniBand or RoCE: every all-reduce crosses "
        "the kernel's TCP stack; look at NCCL_IB_HCA, NCCL_SOCKET_IFNAME and NCCL_NET (unset, or naming the "
        "RDMA devices), and that the nodes see their HCAs (ibv_devinfo)"
    )
