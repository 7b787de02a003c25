"""Where each node of a job sits in the network, and the node order that follows from it.

Pure: text in, names out; no ``os.environ``, no subprocess.

SLURM describes a fat-tree (``TopologyPlugin=topology/tree``) with switches: a leaf switch
holds nodes, an upper switch holds switches. Each task sees only its own node's place,
``SLURM_TOPOLOGY_ADDR`` (``spine.leaf1.n1``: switches from the top down, then the node), but
every task must derive the same rank order. So the job's places come from one source that
every task reads alike: the batch shell asks ``scontrol show topology`` once and exports every
node's switches in :data:`NODE_SWITCHES_ENV`; each task orders the nodes from that
(:func:`switch_order`). Where the variable is absent the node-list order stands, as before.

The variable's form is compact enough for thousands of nodes (an environment variable is at
most 128 KiB): ``spine.leaf1:n[1,3];spine.leaf2:n2``, each item a switch path (top down, dot
separated, as in ``SLURM_TOPOLOGY_ADDR``) and the nodes under that leaf as a SLURM node list.
A topology/block cluster (NVL72-like) reads the same way: a block is a leaf without parents.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from hpc_hsdp.errors import SlurmEnvError

NODE_SWITCHES_ENV = "HPC_HSDP_NODE_SWITCHES"
"""Every node's switches, exported by the batch shell for its tasks (see the module text)."""

TOPOLOGY_MODES = ("auto", "off", "strict")
"""``--topology``: order the nodes by their switches where SLURM gives them (``auto``), keep the
node-list order (``off``), or also refuse shard groups that must cross leaf switches (``strict``)."""

NodeSwitches = Mapping[str, tuple[str, ...]]
"""A node's switches from the top down; the last one is its leaf switch (or block)."""

_FIELD = r"(\w+)=(\S*)"
_NAME = r"^[^\s.:;=,\[\]]+$"


@dataclass(frozen=True)
class Switch:
    """One line of ``scontrol show topology``: a switch (topology/tree) or a block (topology/block)."""

    name: str
    level: int
    """0 for a leaf switch and for a block."""
    nodes: tuple[str, ...]
    """Every node below it (for an upper switch: the nodes of all its leaves)."""
    switches: tuple[str, ...] = ()
    """The switches directly below it (upper switches only)."""


def parse_topology_addr(addr: str, pattern: str = "") -> tuple[str, tuple[str, ...]]:
    """A task's ``SLURM_TOPOLOGY_ADDR`` (``spine.leaf1.n1``) and, when given,
    ``SLURM_TOPOLOGY_ADDR_PATTERN`` (``switch.switch.node``): its node and its switches top down."""
    parts = addr.strip().split(".")
    if not addr.strip() or any(not part for part in parts):
        raise SlurmEnvError(
            f"SLURM_TOPOLOGY_ADDR={addr!r} is not a dot-separated address such as 'spine.leaf1.n1'; "
            f"unset it or fix the cluster's topology.conf"
        )
    kinds = pattern.strip().split(".") if pattern.strip() else []
    if kinds and (len(kinds) != len(parts) or kinds[-1] != "node"):
        raise SlurmEnvError(
            f"SLURM_TOPOLOGY_ADDR={addr!r} does not match SLURM_TOPOLOGY_ADDR_PATTERN={pattern!r} "
            f"(one name per level, the node last); the task's environment was changed: launch it with srun"
        )
    return parts[-1], tuple(parts[:-1])


def parse_scontrol_topology(text: str) -> tuple[Switch, ...]:
    """The switches (or blocks) in the output of ``scontrol show topology``; none where SLURM has
    no topology plugin (it then says ``No topology information available``)."""
    found = []
    for line in text.splitlines():
        fields = dict(re.findall(_FIELD, line))
        name = fields.get("SwitchName") or fields.get("BlockName")
        if not name:
            continue
        level = fields.get("Level", "0")
        if not level.isdigit():
            raise SlurmEnvError(f"scontrol show topology: switch {name} has Level={level!r}; expected a number")
        found.append(
            Switch(
                name=name,
                level=int(level),
                nodes=_expand(fields.get("Nodes", ""), name),
                switches=_expand(fields.get("Switches", ""), name),
            )
        )
    return tuple(found)


def _expand(nodelist: str, switch: str) -> tuple[str, ...]:
    if not nodelist or nodelist == "(null)":
        return ()
    import hostlist  # noqa: PLC0415  (as expand_nodelist: only a node list needs it)

    try:
        return tuple(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist:
        raise SlurmEnvError(f"scontrol show topology: switch {switch} lists {nodelist!r}, not a node list") from None


def switches_of_nodes(switches: Iterable[Switch], nodes: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each of ``nodes``'s switches from the top down (its leaf last), as ``SLURM_TOPOLOGY_ADDR``
    would say them on that node. A node under no leaf switch is left out."""
    table = tuple(switches)
    parent = {child: s.name for s in table for child in s.switches}
    leaf_of: dict[str, str] = {}
    for s in table:
        if s.level == 0:
            for node in s.nodes:
                leaf_of.setdefault(node, s.name)
    places = {}
    for node in nodes:
        if node not in leaf_of:
            continue
        path = [leaf_of[node]]
        while path[-1] in parent and len(path) <= len(table):  # a cycle in a broken config stops here
            path.append(parent[path[-1]])
        places[node] = tuple(reversed(path))
    return places


def switches_from_addrs(addrs: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """Every node's switches from the ``SLURM_TOPOLOGY_ADDR`` of one task per node."""
    places = {}
    for addr in addrs:
        node, path = parse_topology_addr(addr)
        places[node] = path
    return places


def format_node_switches(places: NodeSwitches, nodes: Sequence[str]) -> str:
    """The value of :data:`NODE_SWITCHES_ENV` for ``nodes``: one item per leaf, in node order;
    empty when no node has a switch."""
    import hostlist  # noqa: PLC0415

    by_path: dict[tuple[str, ...], list[str]] = {}
    for node in nodes:
        path = places.get(node)
        if path:
            bad = [name for name in path if not re.match(_NAME, name)]
            if bad:
                raise SlurmEnvError(
                    f"switch name {bad[0]!r} has a space or one of '.:;=,[]'; rename it in topology.conf"
                )
            by_path.setdefault(path, []).append(node)
    return ";".join(f"{'.'.join(path)}:{hostlist.collect_hostlist(names)}" for path, names in by_path.items())


def parse_node_switches(text: str) -> dict[str, tuple[str, ...]]:
    """The inverse of :func:`format_node_switches`."""
    import hostlist  # noqa: PLC0415

    places: dict[str, tuple[str, ...]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        path, sep, nodelist = item.partition(":")
        switches = tuple(path.split("."))
        if not sep or not nodelist or not all(re.match(_NAME, name) for name in switches):
            raise SlurmEnvError(
                f"{NODE_SWITCHES_ENV} item {item!r} is not 'SWITCH.SWITCH:NODELIST' (e.g. 'spine.leaf1:n[1-2]'); "
                f"unset it to keep the node-list order"
            )
        try:
            names = hostlist.expand_hostlist(nodelist)
        except hostlist.BadHostlist:
            raise SlurmEnvError(f"{NODE_SWITCHES_ENV} item {item!r}: {nodelist!r} is not a node list") from None
        for node in names:
            if places.setdefault(node, switches) != switches:
                raise SlurmEnvError(
                    f"{NODE_SWITCHES_ENV} puts node {node} under both {'.'.join(places[node])} and {path}; "
                    f"give each node one leaf switch"
                )
    return places


def nodes_per_shard_group(tasks_per_node: Sequence[int], ranks_per_group: int) -> int:
    """How many whole nodes one shard group (``ranks_per_group`` consecutive ranks) spans: 1 when
    it fits in a node."""
    per_node = min(tasks_per_node)
    return ranks_per_group // per_node if ranks_per_group > per_node else 1


def switch_order(nodes: Sequence[str], places: NodeSwitches, group_nodes: int = 1) -> tuple[str, ...]:
    """The job's nodes in the order that keeps shard groups of ``group_nodes`` consecutive nodes
    under one leaf switch wherever the allocation allows.

    Nodes are grouped by switch, top level first, each switch where its first node stands in
    ``nodes`` (a stable sort: nodes already grouped keep their order). When a group spans
    several nodes, each leaf's whole groups come first and the leaves' leftover nodes after them
    (or before them, where the first leaf has fewer nodes than one group): that leaves the fewest
    shard groups crossing switches that the allocation allows. The first node stays first (the
    batch shell, where rank 0 serves the rendezvous). Replicate groups then cross switches.

    Nodes whose switches are not all known keep the given order."""
    names = tuple(nodes)
    if len(names) < 2 or any(not places.get(node) for node in names):
        return names
    first_seen: dict[tuple[str, ...], int] = {}
    for node in names:
        path = places[node]
        for depth in range(1, len(path) + 1):
            first_seen.setdefault(path[:depth], len(first_seen))
    grouped = sorted(names, key=lambda node: [first_seen[places[node][:d]] for d in range(1, len(places[node]) + 1)])
    if group_nodes < 2:
        return tuple(grouped)
    leaves = _runs(grouped, places)
    # each leaf's leftover nodes are its last ones, or its first ones where the leftovers lead:
    # a leaf's nodes keep their order either way
    leftovers_lead = len(leaves[0]) < group_nodes
    whole: list[str] = []
    leftover: list[str] = []
    for leaf_nodes in leaves:
        extra = len(leaf_nodes) % group_nodes
        cut = extra if leftovers_lead else len(leaf_nodes) - extra
        head, tail = leaf_nodes[:cut], leaf_nodes[cut:]
        leftover += head if leftovers_lead else tail
        whole += tail if leftovers_lead else head
    return tuple(leftover + whole if leftovers_lead else whole + leftover)


def _runs(ordered: Sequence[str], places: NodeSwitches) -> list[list[str]]:
    runs: list[list[str]] = []
    for node in ordered:
        if runs and places[runs[-1][-1]] == places[node]:
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs
