"""Which rank is which GPU on which node, and which ranks form each group.

Pure functions of their inputs (no torch, no ``os.environ``): the plan computed before
submission and the layout a task derives from SLURM's environment come from the same
:func:`TopologyPlan` code, so they cannot disagree.

Ranks are node-major: the tasks of the first node in the job's node list get ranks
``0 .. G0-1``, the next node's ``G0 .. G0+G1-1``, and so on, whatever ``SLURM_PROCID``
says. Shard groups are ``shard_size`` consecutive ranks; replicate groups take every
``shard_size``-th rank, exactly as ``init_device_mesh(..., (R, S))`` groups a row-major mesh.

With tensor parallelism (``tp_size`` T > 1) the mesh is (replicate, shard, tp), R x S x T,
row-major again: rank = (r * S + s) * T + t. A TP group is T consecutive ranks, on one node
(T divides every node's task count); the S x T consecutive ranks of one r hold one copy of the
model; FSDP2 shards over (replicate, shard): a shard group is the S ranks of equal r and t,
a replicate group the R ranks of equal s and t. Where SLURM gives the nodes' switches, the
node order comes from :func:`hpc_hsdp.plan.switches.switch_order` (see ``RankLayout.from_env``).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import field
from functools import cached_property
from typing import TYPE_CHECKING

from hpc_hsdp.errors import SlurmEnvError, TopologyError
from hpc_hsdp.plan.records import record

if TYPE_CHECKING:
    from hpc_hsdp.plan.switches import NodeSwitches

# Outside Linux's default ephemeral range (32768-60999) and clear of SLURM's own ports.
RENDEZVOUS_PORT_BASE = 20000
RENDEZVOUS_PORT_SPAN = 10000

_TASKS_ITEM = r"^([1-9][0-9]*)(?:\(x([1-9][0-9]*)\))?$"

# Bounds on sizes: a typo (--nodes 99999999) must be one clear line, not a plan that takes all
# the memory. The largest SLURM clusters have about 10,000 nodes and about 100,000 GPUs; the
# bounds leave room above that and keep every plan's cost (linear in the ranks) small.
MAX_NODES = 65_536
MAX_TASKS_PER_NODE = 1_024
MAX_WORLD_SIZE = 1_048_576
_TYPO_HINT = "check for a typo"


def check_sizes(
    *,
    nodes: int,
    tasks_per_node: int,
    world_size: int | None = None,
    what_nodes: str = "--nodes",
    what_tasks: str = "--gpus-per-node",
) -> None:
    """Raise TopologyError when a job's size is beyond what any cluster has (before anything
    proportional to it is allocated)."""
    if nodes > MAX_NODES:
        raise TopologyError(
            f"{what_nodes} {nodes} is more than the {MAX_NODES:,} nodes hpc-hsdp plans for; {_TYPO_HINT}"
        )
    if tasks_per_node > MAX_TASKS_PER_NODE:
        raise TopologyError(
            f"{what_tasks} {tasks_per_node} is more than the {MAX_TASKS_PER_NODE:,} tasks per node "
            f"hpc-hsdp plans for; {_TYPO_HINT}"
        )
    world = nodes * tasks_per_node if world_size is None else world_size
    if world > MAX_WORLD_SIZE:
        raise TopologyError(
            f"{world:,} ranks ({what_nodes} {nodes:,} x {tasks_per_node:,} per node) are more than the "
            f"{MAX_WORLD_SIZE:,} ranks hpc-hsdp plans for; {_TYPO_HINT}"
        )


def _nodelist_size(text: str) -> int:
    """How many names a node list expands to, counted without expanding it (an upper bound
    when ranges repeat names; a malformed list is left to the parser)."""
    total, names = 0, 1
    for part in re.split(r"(\[[^\]]*\]|,)", text):
        if part == ",":
            total, names = total + names, 1
        elif part.startswith("["):
            in_brackets = 0
            for item in part[1:-1].split(","):
                low, sep, high = item.partition("-")
                numeric = sep and low.strip().isdigit() and high.strip().isdigit()
                in_brackets += int(high) - int(low) + 1 if numeric else 1
            names *= max(in_brackets, 1)
    return total + names


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """Expand a SLURM node list (``gpu-a[01-04,07],login2``) in its given order."""
    text = nodelist.strip()
    if not text:
        raise TopologyError("empty node list; give node names such as 'n[1-2]' or 'gpu-a01,gpu-a02'")
    size = _nodelist_size(text)
    if size > MAX_NODES:
        raise TopologyError(
            f"node list {nodelist[:80]!r} names {size:,} nodes, more than the {MAX_NODES:,} hpc-hsdp "
            f"plans for; {_TYPO_HINT}"
        )
    import hostlist  # noqa: PLC0415  (only a node list needs it: render and plan without one start without it)

    try:
        names = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as exc:
        raise TopologyError(
            f"malformed node list {nodelist!r} ({exc}); write it as SLURM does, e.g. 'gpu-a[01-04,07],login2'"
        ) from None
    if not names or any(not name or any(c in name for c in "[],") for name in names):
        raise TopologyError(f"malformed node list {nodelist!r}; write it as SLURM does, e.g. 'n[1-2]'")
    return tuple(names)


def parse_tasks_per_node(text: str) -> tuple[int, ...]:
    """Parse ``SLURM_TASKS_PER_NODE`` (``8(x2),4``) into one count per node."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = re.match(_TASKS_ITEM, item.strip())
        if not match:
            raise TopologyError(
                f"malformed tasks-per-node string {text!r}; expected SLURM's form such as '8(x2),4' or '4,8'"
            )
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        check_sizes(
            nodes=len(counts) + repeat,
            tasks_per_node=count,
            world_size=0,
            what_nodes=f"tasks-per-node {text.strip()[:80]!r}: nodes",
            what_tasks=f"tasks-per-node {item.strip()!r}:",
        )
        counts.extend([count] * repeat)
    return tuple(counts)


def format_tasks_per_node(counts: Sequence[int]) -> str:
    """The inverse of :func:`parse_tasks_per_node`, in SLURM's compressed form."""
    parts: list[str] = []
    i = 0
    while i < len(counts):
        j = i
        while j < len(counts) and counts[j] == counts[i]:
            j += 1
        run = j - i
        parts.append(f"{counts[i]}(x{run})" if run > 1 else str(counts[i]))
        i = j
    return ",".join(parts)


def _rank_span(ranks: Sequence[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def valid_shard_sizes(tasks_per_node: Sequence[int], tp_size: int = 1) -> list[int]:
    """Every shard size :class:`TopologyPlan` accepts for these nodes (and TP size), ascending:
    S with S x T dividing every node's count, then (equal nodes of G) S x T a multiple of G
    dividing the world."""
    counts = tuple(tasks_per_node)
    smallest, world = min(counts), sum(counts)
    sizes = [d for d in divisors(smallest) if all(c % d == 0 for c in counts)]
    if len(set(counts)) == 1:
        sizes += [m for m in range(2 * smallest, world + 1, smallest) if world % m == 0]
    return [m // tp_size for m in sizes if m % tp_size == 0]


def valid_tp_sizes(tasks_per_node: Sequence[int]) -> list[int]:
    """Every TP size :class:`TopologyPlan` accepts for these nodes: the divisors of every node's count."""
    counts = tuple(tasks_per_node)
    return [d for d in divisors(min(counts)) if all(c % d == 0 for c in counts)]


def default_node_names(nodes: int) -> tuple[str, ...]:
    """``n1, n2, ...``: the names of nodes nobody named, in ``plan``, the emulator and the dev cluster alike."""
    return tuple(f"n{i + 1}" for i in range(nodes))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@record
class ParallelDims:
    """The sizes of a job's mesh axes: R copies of the model, each sharded over S ranks, each
    layer split over T consecutive ranks (``("replicate", "shard", "tp")``)."""

    replicate: int
    """R: copies of the model (the outer mesh axis)."""
    shard: int
    """S: ranks that shard one copy (FSDP2's reduce-scatter and all-gather group)."""
    tp: int = 1
    """T: ranks that split every layer (1: no tensor parallelism); they read the same rows."""

    @property
    def world_size(self) -> int:
        """R x S x T."""
        return self.replicate * self.shard * self.tp

    @property
    def data_world_size(self) -> int:
        """R x S: the ranks that read different rows."""
        return self.replicate * self.shard


@record
class TopologyPlan:
    """The HSDP layout of a job: one entry per rank, groups derived from node-major ranks."""

    tasks_per_node: tuple[int, ...]
    """Tasks (GPUs) on each node, in the job's node-list order."""
    shard_size: int
    """S: ranks that shard one copy of the model (the inner mesh axis, "shard")."""
    node_names: tuple[str, ...] = field(default=())
    """Node names in node-list order; ``n1, n2, ...`` (the dev cluster's and the emulator's names) when not given."""
    tp_size: int = 1
    """T: ranks that split every layer (the innermost mesh axis, "tp"), T consecutive ranks on one node."""
    node_switches: tuple[str, ...] = field(default=())
    """Each node's leaf switch (or block), in node order, where SLURM's topology says it ("" where
    not); empty when it says none."""

    def __post_init__(self) -> None:
        counts = tuple(self.tasks_per_node)
        object.__setattr__(self, "tasks_per_node", counts)
        if not counts:
            raise TopologyError("no nodes given; a job needs at least one node (--nodes 1 or more)")
        if len(counts) > MAX_NODES:
            check_sizes(nodes=len(counts), tasks_per_node=1, what_nodes="tasks per node: nodes")
        if any(c < 1 for c in counts):
            raise TopologyError(
                f"tasks per node {list(counts)[:16]} includes a count below 1; every node needs >= 1 task"
            )
        check_sizes(nodes=len(counts), tasks_per_node=max(counts), world_size=sum(counts))
        names = tuple(self.node_names) or default_node_names(len(counts))
        if len(names) != len(counts):
            raise TopologyError(
                f"{len(names)} node names {list(names)} for {len(counts)} task counts {list(counts)}; give one count per node"
            )
        object.__setattr__(self, "node_names", names)
        switches = tuple(self.node_switches)
        if switches and len(switches) != len(counts):
            raise TopologyError(
                f"{len(switches)} node switches {list(switches)[:16]} for {len(counts)} nodes; give one switch per node"
            )
        object.__setattr__(self, "node_switches", switches)
        self._check_tp_size()
        self._check_shard_size()

    def _check_tp_size(self) -> None:
        t, counts = self.tp_size, self.tasks_per_node
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise TopologyError(f"tp size {t!r} is invalid; give a positive integer such as --tp 2")
        bad = [(name, c) for name, c in zip(self.node_names, counts) if c % t]
        if bad:
            name, c = bad[0]
            raise TopologyError(
                f"tp size {t} does not divide the {c} tasks (GPUs) on node {name}; a tensor-parallel group stays "
                f"inside one node: use a --tp that divides every node's task count "
                f"({', '.join(map(str, valid_tp_sizes(counts)))})"
            )

    def _check_shard_size(self) -> None:
        # With tp T the shard axis counts TP groups: T consecutive ranks are one unit, and a node
        # of c tasks holds c / T of them; the rules are those of T = 1 over these units.
        s, t = self.shard_size, self.tp_size
        counts = tuple(c // t for c in self.tasks_per_node)
        units, unit_count = ("tasks", "task count") if t == 1 else (f"TP groups of {t}", "TP-group count")
        world = sum(counts)
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise TopologyError(f"shard size {s!r} is invalid; give a positive integer such as --shard 4")
        smallest, largest = min(counts), max(counts)
        if s <= smallest:
            bad = [(name, c) for name, c in zip(self.node_names, counts) if c % s]
            if bad:
                name, c = bad[0]
                fits = [d for d in valid_shard_sizes(counts) if d <= smallest]
                raise TopologyError(
                    f"shard size {s} does not divide the {c} {units} on node {name}; "
                    f"choose a shard size that divides every node's {unit_count} ({', '.join(map(str, fits))})"
                    + (f" or a multiple of {largest} that divides {world}" if smallest == largest else "")
                )
            return
        if smallest != largest:
            raise TopologyError(
                f"shard size {s} is larger than the smallest node ({smallest} {units}) of the uneven allocation "
                f"{format_tasks_per_node(self.tasks_per_node)}; a shard group must then span whole, equal nodes: "
                f"use a shard size dividing {smallest}, or ask for nodes with equal task counts"
            )
        per_node = largest
        if s % per_node:
            raise TopologyError(
                f"shard size {s} is larger than a node ({per_node} {units}) but not a multiple of it; "
                f"a shard group must span whole nodes: use a multiple of {per_node} (e.g. {per_node * max(1, s // per_node)}) "
                f"or a divisor of {per_node}"
            )
        if world % s:
            raise TopologyError(
                f"shard size {s} spans {s // per_node} nodes but the job has {len(counts)} nodes ({world} {units}); "
                f"use a node count that is a multiple of {s // per_node} or a shard size dividing {world}"
            )

    @property
    def nodes(self) -> int:
        return len(self.tasks_per_node)

    @cached_property
    def world_size(self) -> int:
        return sum(self.tasks_per_node)

    @property
    def ranks_per_copy(self) -> int:
        """S x T: the consecutive ranks that hold one copy of the model."""
        return self.shard_size * self.tp_size

    @property
    def num_replicas(self) -> int:
        """R: copies of the model (the outer mesh axis, "replicate")."""
        return self.world_size // self.ranks_per_copy

    @property
    def dims(self) -> ParallelDims:
        """R, S and T together."""
        return ParallelDims(replicate=self.num_replicas, shard=self.shard_size, tp=self.tp_size)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """(R, S), or (R, S, T) with tensor parallelism."""
        if self.tp_size == 1:
            return (self.num_replicas, self.shard_size)
        return (self.num_replicas, self.shard_size, self.tp_size)

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        return ("replicate", "shard") if self.tp_size == 1 else ("replicate", "shard", "tp")

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(r, s, t) of a rank: rank = (r * S + s) * T + t."""
        t = self.tp_size
        return (rank // self.ranks_per_copy, rank % self.ranks_per_copy // t, rank % t)

    @cached_property
    def first_rank_of_node(self) -> tuple[int, ...]:
        firsts, total = [], 0
        for count in self.tasks_per_node:
            firsts.append(total)
            total += count
        return tuple(firsts)

    @cached_property
    def node_of_rank(self) -> tuple[int, ...]:
        return tuple(node for node, count in enumerate(self.tasks_per_node) for _ in range(count))

    @cached_property
    def local_rank_of_rank(self) -> tuple[int, ...]:
        return tuple(local for count in self.tasks_per_node for local in range(count))

    @cached_property
    def tp_groups(self) -> tuple[tuple[int, ...], ...]:
        """T consecutive ranks each (one rank each without tensor parallelism)."""
        t = self.tp_size
        return tuple(tuple(range(start, start + t)) for start in range(0, self.world_size, t))

    @cached_property
    def shard_groups(self) -> tuple[tuple[int, ...], ...]:
        """The S ranks of equal r and t, each: consecutive ranks when T = 1."""
        t, copy = self.tp_size, self.ranks_per_copy
        return tuple(
            tuple(range(start + offset, start + copy, t))
            for start in range(0, self.world_size, copy)
            for offset in range(t)
        )

    @cached_property
    def replicate_groups(self) -> tuple[tuple[int, ...], ...]:
        """The R ranks of equal s and t, each: every (S x T)-th rank."""
        copy = self.ranks_per_copy
        return tuple(tuple(range(offset, self.world_size, copy)) for offset in range(copy))

    def rank_of(self, node_rank: int, local_rank: int) -> int:
        return self.first_rank_of_node[node_rank] + local_rank

    def shard_group_of(self, rank: int) -> tuple[int, ...]:
        return self.shard_groups[rank // self.ranks_per_copy * self.tp_size + rank % self.tp_size]

    def replicate_group_of(self, rank: int) -> tuple[int, ...]:
        return self.replicate_groups[rank % self.ranks_per_copy]

    def tp_group_of(self, rank: int) -> tuple[int, ...]:
        return self.tp_groups[rank // self.tp_size]

    def nodes_of_group(self, group: Sequence[int]) -> tuple[int, ...]:
        return tuple(sorted({self.node_of_rank[r] for r in group}))

    @cached_property
    def shard_groups_cross_nodes(self) -> bool:
        # a shard group spans the nodes of its copy's first and last rank (T divides every node)
        copy, node = self.ranks_per_copy, self.node_of_rank
        return any(node[start] != node[start + copy - 1] for start in range(0, self.world_size, copy))

    @cached_property
    def replicate_groups_cross_nodes(self) -> bool:
        copy, node, last = self.ranks_per_copy, self.node_of_rank, self.world_size - self.ranks_per_copy
        return any(node[offset] != node[last + offset] for offset in range(copy))

    @cached_property
    def tp_groups_cross_nodes(self) -> bool:
        t, node = self.tp_size, self.node_of_rank
        return any(node[start] != node[start + t - 1] for start in range(0, self.world_size, t))

    def nodes_of_copy(self, r: int) -> range:
        """The node indices holding copy ``r`` (its S x T consecutive ranks)."""
        start = r * self.ranks_per_copy
        return range(self.node_of_rank[start], self.node_of_rank[start + self.ranks_per_copy - 1] + 1)

    @cached_property
    def copies_across_switches(self) -> tuple[int, ...]:
        """The copies r whose shard groups sit under more than one leaf switch (by
        :attr:`node_switches`; none unless every node's switch is known)."""
        if not self.switches_known:
            return ()
        return tuple(
            r for r in range(self.num_replicas) if len({self.node_switches[n] for n in self.nodes_of_copy(r)}) > 1
        )

    @property
    def switches_known(self) -> bool:
        return bool(self.node_switches) and all(self.node_switches)

    @property
    def shard_groups_cross_switches(self) -> bool | None:
        """Whether a shard group sits under more than one leaf switch; None where that cannot be told."""
        return bool(self.copies_across_switches) if self.switches_known else None

    @property
    def kind(self) -> str:
        """A name for the layout: replication only, full sharding, or hybrid (and tensor parallel)."""
        if self.tp_size > 1:
            if self.shard_size == 1:
                data = "replicate (DDP-like)" if self.num_replicas > 1 else ""
            else:
                data = "full shard (FSDP)" if self.num_replicas == 1 else "hybrid shard (HSDP)"
            return f"{data} + tensor parallel (TP)" if data else "tensor parallel (TP)"
        if self.shard_size == 1:
            return "replicate (DDP-like)" if self.world_size > 1 else "single process"
        if self.shard_size == self.world_size:
            return "full shard (FSDP)"
        return "hybrid shard (HSDP)"

    def check_under_one_switch(self) -> None:
        """``--topology strict``: raise TopologyError when a shard group spanning nodes crosses leaf
        switches, or when that cannot be told; the message names the groups, the switches and the fix."""
        if not self.shard_groups_cross_nodes:
            return
        span = len(self.nodes_of_copy(0))
        if not self.switches_known:
            unknown = [
                name for n, name in enumerate(self.node_names) if not self.node_switches or not self.node_switches[n]
            ]
            raise TopologyError(
                f"--topology strict: the shard groups span {span} nodes but SLURM gave no leaf switch for "
                f"{', '.join(unknown[:8])}{' ...' if len(unknown) > 8 else ''} (no topology plugin, or the batch script "
                f"did not export the switches), so whether they sit under one switch cannot be told; "
                f"use --topology auto, or a shard size within one node (--shard {self._largest_shard_under_switches()})"
            )
        crossing = self.copies_across_switches
        if not crossing:
            return
        described = []
        for r in crossing[:3]:
            nodes = self.nodes_of_copy(r)
            ranks = range(r * self.ranks_per_copy, (r + 1) * self.ranks_per_copy)
            leaves = dict.fromkeys(self.node_switches[n] for n in nodes)
            described.append(
                f"{r} (ranks {_rank_span(ranks)} on {','.join(self.node_names[n] for n in nodes)} under {','.join(leaves)})"
            )
        more = f" and {len(crossing) - 3} more" if len(crossing) > 3 else ""
        per_leaf = [f"{n} under {leaf}" for leaf, n in Counter(self.node_switches).items()]
        raise TopologyError(
            f"--topology strict: shard group{'s' if len(crossing) > 1 else ''} {'; '.join(described)}{more} "
            f"must cross leaf switches: the job's nodes are {', '.join(per_leaf[:8])}{' ...' if len(per_leaf) > 8 else ''}, "
            f"not whole multiples of the {span} nodes a shard group spans; ask for nodes under one switch "
            f"(--switches 1), or use --shard {self._largest_shard_under_switches()}, or --topology auto"
        )

    def _largest_shard_under_switches(self) -> int:
        """The largest shard size whose groups fit under these nodes' switches (within one node
        where those are not known)."""
        per_node, t = min(self.tasks_per_node), self.tp_size
        per_leaf = Counter(self.node_switches).values() if self.switches_known else ()
        fits = [
            s
            for s in valid_shard_sizes(self.tasks_per_node, t)
            if s * t <= per_node or (per_leaf and all(n % (s * t // per_node) == 0 for n in per_leaf))
        ]
        return max(fits)

    def to_dict(self) -> dict:
        data: dict[str, object] = {
            "nodes": self.nodes,
            "gpus_per_node": self.tasks_per_node[0] if len(set(self.tasks_per_node)) == 1 else None,
            "tasks_per_node": list(self.tasks_per_node),
            "node_names": list(self.node_names),
            "world_size": self.world_size,
            "shard_size": self.shard_size,
        }
        if self.tp_size > 1:
            data["tp_size"] = self.tp_size
        data.update(
            {
                "num_replicas": self.num_replicas,
                "mesh_shape": list(self.mesh_shape),
                "mesh_axis_names": list(self.mesh_axis_names),
                "kind": self.kind,
            }
        )
        if self.tp_size > 1:
            data["tp_groups"] = [list(g) for g in self.tp_groups]
        data.update(
            {
                "shard_groups": [list(g) for g in self.shard_groups],
                "replicate_groups": [list(g) for g in self.replicate_groups],
                "node_of_rank": list(self.node_of_rank),
                "local_rank_of_rank": list(self.local_rank_of_rank),
            }
        )
        if self.tp_size > 1:
            data["coordinates"] = [list(self.coordinates(rank)) for rank in range(self.world_size)]
            data["tp_groups_cross_nodes"] = self.tp_groups_cross_nodes
        data["shard_groups_cross_nodes"] = self.shard_groups_cross_nodes
        data["replicate_groups_cross_nodes"] = self.replicate_groups_cross_nodes
        if self.node_switches:
            data["node_switches"] = list(self.node_switches)
            data["shard_groups_cross_switches"] = self.shard_groups_cross_switches
        return data


def plan_for(
    *, nodes: int, gpus_per_node: int, shard_size: int, node_names: Sequence[str] = (), tp_size: int = 1
) -> TopologyPlan:
    """The plan of an even allocation: ``nodes`` x ``gpus_per_node`` tasks."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise TopologyError(f"--nodes {nodes!r} is invalid; a job needs at least 1 node")
    if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise TopologyError(f"--gpus-per-node {gpus_per_node!r} is invalid; give at least 1 (one task per GPU)")
    check_sizes(nodes=nodes, tasks_per_node=gpus_per_node)
    return TopologyPlan(
        tasks_per_node=(gpus_per_node,) * nodes, shard_size=shard_size, node_names=tuple(node_names), tp_size=tp_size
    )


def plan_on_switches(
    *,
    tasks_per_node: Sequence[int],
    shard_size: int,
    node_names: Sequence[str],
    places: NodeSwitches,
    tp_size: int = 1,
    topology: str = "auto",
) -> TopologyPlan:
    """The plan of a job whose nodes sit under the switches ``places`` gives (node -> switches top
    down; see :mod:`hpc_hsdp.plan.switches`): with ``auto`` or ``strict`` its nodes are ordered by
    :func:`switch_order`, and ``strict`` refuses shard groups that must cross leaf switches.
    No places, or ``off``: the node-list order, as :class:`TopologyPlan` alone gives it."""
    from hpc_hsdp.plan.switches import TOPOLOGY_MODES, nodes_per_shard_group, switch_order  # noqa: PLC0415  (tasks only)

    if topology not in TOPOLOGY_MODES:
        raise TopologyError(f"--topology {topology!r} is not one of {', '.join(TOPOLOGY_MODES)}")
    names, counts = tuple(node_names), tuple(tasks_per_node)
    if topology == "off" or not places:
        plan = TopologyPlan(tasks_per_node=counts, shard_size=shard_size, node_names=names, tp_size=tp_size)
    else:
        ranks_per_copy = shard_size * tp_size if isinstance(shard_size, int) and isinstance(tp_size, int) else 1
        order = switch_order(names, places, nodes_per_shard_group(counts, ranks_per_copy))
        count_of = dict(zip(names, counts))
        plan = TopologyPlan(
            tasks_per_node=tuple(count_of[name] for name in order),
            shard_size=shard_size,
            node_names=order,
            tp_size=tp_size,
            node_switches=tuple(places[name][-1] if places.get(name) else "" for name in order),
        )
    if topology == "strict":
        plan.check_under_one_switch()
    return plan


# ----------------------------------------------------------------------------- on a task


def _require(env: Mapping[str, str], name: str, hint: str) -> str:
    value = env.get(name)
    if value is None or value.strip() == "":
        raise SlurmEnvError(f"{name} is not set; {hint}")
    return value.strip()


def _int_var(env: Mapping[str, str], name: str, hint: str) -> int:
    text = _require(env, name, hint)
    try:
        value = int(text)
    except ValueError:
        raise SlurmEnvError(f"{name}={text!r} is not an integer; {hint}") from None
    if value < 0:
        raise SlurmEnvError(f"{name}={text!r} is negative; {hint}")
    return value


_OUTSIDE_SLURM = "run this inside a SLURM task (srun hpc-hsdp ...) or under torchrun"
_DECIMAL = r"^[0-9]+$"


def _slurm_procid(env: Mapping[str, str]) -> int | None:
    """What SLURM says this task's rank is (recorded, never trusted); None when unset."""
    text = env.get("SLURM_PROCID", "").strip()
    return int(text) if re.match(_DECIMAL, text) else None


def rendezvous_port(env: Mapping[str, str]) -> int:
    """``MASTER_PORT`` when set, else a port derived from the job id, equal on every task."""
    if env.get("MASTER_PORT", "").strip():
        text = env["MASTER_PORT"].strip()
        if not re.match(_DECIMAL, text) or not 0 < int(text) < 65536:
            raise SlurmEnvError(f"MASTER_PORT={text!r} is not a port number; unset it or give 1-65535")
        return int(text)
    job_id = _require(env, "SLURM_JOB_ID", _OUTSIDE_SLURM)
    digits = re.sub(r"\D", "", job_id) or "0"  # array and het jobs: "123_4", "123+0"
    return RENDEZVOUS_PORT_BASE + int(digits) % RENDEZVOUS_PORT_SPAN


def rendezvous_from_env(env: Mapping[str, str]) -> tuple[str, int]:
    """The TCP store's address and port: ``MASTER_ADDR``/``MASTER_PORT`` when set, else the
    job's first node and a port derived from the job id. Needs only job-level variables,
    so the batch script can call it before any task starts."""
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or _require(env, "SLURM_JOB_NODELIST", _OUTSIDE_SLURM)
        addr = expand_nodelist(nodelist)[0]
    return addr, rendezvous_port(env)


def visible_gpu_count(env: Mapping[str, str]) -> int:
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible or visible in ("NoDevFiles", "-1"):
        return 0
    return len([v for v in visible.split(",") if v.strip()])


def select_device(env: Mapping[str, str], *, local_rank: int, local_world_size: int) -> str:
    """The device of a task from what SLURM made visible to it.

    One GPU visible: ``cuda:0``. Every GPU of the node visible (no ``--gpu-bind``, the
    rendered script's way): ``cuda:LOCAL_RANK``. A part of the node's GPUs that can be
    the task's own (``--gpus-per-task=N``: N visible x tasks on the node <= GPUs on the
    node): the first of them. A part shared with other tasks (``--gpu-bind=closest``,
    GPU masks: more visible x tasks than the node has): which one is this task's cannot
    be told from its environment, so it is refused rather than guessed (every such task
    would take ``cuda:0`` and NCCL fails)."""
    count = visible_gpu_count(env)
    if count == 0:
        return "cpu"
    if count == 1:
        return "cuda:0"
    visible = env["CUDA_VISIBLE_DEVICES"]
    on_node = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node.isdigit() and count < int(on_node):
        if count * local_world_size <= int(on_node):
            return "cuda:0"  # --gpus-per-task: these GPUs are this task's alone
        raise SlurmEnvError(
            f"task with SLURM_LOCALID={local_rank} sees {count} of its node's {on_node} GPUs "
            f"(CUDA_VISIBLE_DEVICES={visible}), shared with other tasks (--gpu-bind=closest or a GPU mask?): "
            f"which one is its own cannot be told; drop --gpu-bind (every task sees the node's GPUs and takes "
            f"its local id) or give each task one GPU (--gpu-bind=single:1)"
        )
    if local_rank >= count:
        raise SlurmEnvError(
            f"SLURM_LOCALID={local_rank} but only {count} GPUs are visible (CUDA_VISIBLE_DEVICES={visible}) "
            f"for {local_world_size} tasks on this node; ask for one task per GPU (--ntasks-per-node equal to --gpus-per-node)"
        )
    return f"cuda:{local_rank}"


@record
class RankLayout:
    """What one task derives from its environment: its place in the node-major plan."""

    plan: TopologyPlan
    rank: int
    """Node-major global rank (tasks on earlier nodes + local rank)."""
    local_rank: int
    node_rank: int
    """Index of this task's node in the job's node list."""
    master_addr: str
    master_port: int
    device: str
    """``cpu``, ``cuda:0`` (one GPU visible) or ``cuda:LOCAL_RANK``."""
    slurm_procid: int | None
    """What SLURM said the rank was; differs from ``rank`` under cyclic distribution."""
    launch_mode: str
    """``task-per-gpu`` (srun), ``torchrun`` (a torchrun worker) or ``task-per-node`` (the torchrun launcher task)."""
    job_id: str | None = None

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    @property
    def local_world_size(self) -> int:
        return self.plan.tasks_per_node[self.node_rank]

    @property
    def node(self) -> str:
        return self.plan.node_names[self.node_rank]

    @property
    def shard_size(self) -> int:
        return self.plan.shard_size

    @property
    def num_replicas(self) -> int:
        return self.plan.num_replicas

    @property
    def shard_group(self) -> tuple[int, ...]:
        return self.plan.shard_group_of(self.rank)

    @property
    def replicate_group(self) -> tuple[int, ...]:
        return self.plan.replicate_group_of(self.rank)

    @property
    def tp_size(self) -> int:
        return self.plan.tp_size

    @property
    def tp_group(self) -> tuple[int, ...]:
        return self.plan.tp_group_of(self.rank)

    @property
    def coordinates(self) -> tuple[int, int, int]:
        """(r, s, t): this rank's place in the (replicate, shard, tp) mesh."""
        return self.plan.coordinates(self.rank)

    @property
    def node_switch(self) -> str:
        """This node's leaf switch (or block); "" where SLURM's topology does not say."""
        return self.plan.node_switches[self.node_rank] if self.plan.node_switches else ""

    @property
    def procid_differs(self) -> bool:
        return self.slurm_procid is not None and self.slurm_procid != self.rank

    def torch_env(self) -> dict[str, str]:
        """The variables torch.distributed's env:// initialisation reads."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def to_dict(self) -> dict:
        data = {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "node_rank": self.node_rank,
            "local_world_size": self.local_world_size,
            "world_size": self.world_size,
            "node": self.node,
            "nodes": list(self.plan.node_names),
            "tasks_per_node": list(self.plan.tasks_per_node),
            "shard_size": self.shard_size,
            "num_replicas": self.num_replicas,
            "shard_group": list(self.shard_group),
            "replicate_group": list(self.replicate_group),
            "shard_groups_cross_nodes": self.plan.shard_groups_cross_nodes,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "device": self.device,
            "slurm_procid": self.slurm_procid,
            "procid_differs": self.procid_differs,
            "launch_mode": self.launch_mode,
            "job_id": self.job_id,
        }
        if self.tp_size > 1:
            data.update(tp_size=self.tp_size, coordinates=list(self.coordinates), tp_group=list(self.tp_group))
        if self.plan.node_switches:
            data.update(
                node_switch=self.node_switch,
                node_switches=list(self.plan.node_switches),
                shard_groups_cross_switches=self.plan.shard_groups_cross_switches,
            )
        return data

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str],
        *,
        shard_size: int,
        nproc_per_node: int | None = None,
        tp_size: int = 1,
        topology: str = "auto",
    ) -> RankLayout:
        """Derive this task's layout from SLURM's (or torchrun's) environment.

        ``nproc_per_node``: given only by the torchrun launcher (a task that will start
        that many workers on its node); the task is then ``task-per-node``. Without it a
        task is one rank (``task-per-gpu``), also in a job of one task per node: the
        launcher is said, never guessed from the allocation's shape.

        ``topology`` (``auto``, ``off``, ``strict``): where the batch shell exported the nodes'
        switches (``HPC_HSDP_NODE_SWITCHES``), ``auto`` and ``strict`` order the nodes by them
        (:func:`plan_on_switches`); without the variable, or with ``off``, the node-list order.
        """
        from hpc_hsdp.plan.switches import NODE_SWITCHES_ENV, parse_node_switches  # noqa: PLC0415  (tasks only)

        places = parse_node_switches(env.get(NODE_SWITCHES_ENV, "")) if topology != "off" else {}
        if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:
            return cls._from_torchrun_env(env, shard_size=shard_size, tp_size=tp_size, places=places, topology=topology)
        return cls._from_slurm_env(
            env, nproc_per_node=nproc_per_node, shard_size=shard_size, tp_size=tp_size, places=places, topology=topology
        )

    @classmethod
    def for_task(
        cls, env: Mapping[str, str], *, shard_size: int, device: str, tp_size: int = 1, topology: str = "auto"
    ) -> RankLayout:
        """:meth:`from_env` for a task that will train on ``device`` (``cpu``, ``cuda``, ``auto``):
        with ``cpu`` the GPUs the task can see are left out, so that the layout neither picks
        nor refuses GPUs that will not be used."""
        if device == "cpu":
            env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
        return cls.from_env(env, shard_size=shard_size, tp_size=tp_size, topology=topology)

    @classmethod
    def _from_slurm_env(
        cls,
        env: Mapping[str, str],
        *,
        shard_size: int,
        nproc_per_node: int | None,
        tp_size: int,
        places: NodeSwitches,
        topology: str,
    ) -> RankLayout:
        if "SLURM_JOB_ID" not in env and "SLURM_PROCID" not in env:
            raise SlurmEnvError(f"no SLURM environment found (SLURM_JOB_ID is not set); {_OUTSIDE_SLURM}")
        nodelist = env.get("SLURM_STEP_NODELIST") or _require(env, "SLURM_JOB_NODELIST", _OUTSIDE_SLURM)
        node_names = expand_nodelist(nodelist)
        tasks_text = env.get("SLURM_STEP_TASKS_PER_NODE") or _require(env, "SLURM_TASKS_PER_NODE", _OUTSIDE_SLURM)
        tasks_per_node = parse_tasks_per_node(tasks_text)
        if len(tasks_per_node) != len(node_names):
            raise SlurmEnvError(
                f"tasks per node {tasks_text!r} lists {len(tasks_per_node)} nodes but the node list {nodelist!r} "
                f"has {len(node_names)}; the job's variables are inconsistent (was SLURM_STEP_* overwritten?)"
            )
        ntasks_name = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
        ntasks = _int_var(env, ntasks_name, _OUTSIDE_SLURM)
        if ntasks != sum(tasks_per_node):
            raise SlurmEnvError(
                f"{ntasks_name}={ntasks} but tasks per node {tasks_text!r} add up to {sum(tasks_per_node)}; "
                f"launch with srun inside the allocation so both describe the same step"
            )
        node_name = env.get("SLURMD_NODENAME", "").strip()
        if node_name:
            if node_name not in node_names:
                raise SlurmEnvError(
                    f"SLURMD_NODENAME={node_name!r} is not in the node list {nodelist!r}; "
                    f"run the task inside its own allocation"
                )
            node_rank = node_names.index(node_name)
        else:
            node_rank = _int_var(env, "SLURM_NODEID", _OUTSIDE_SLURM)
            if node_rank >= len(node_names):
                raise SlurmEnvError(f"SLURM_NODEID={node_rank} but the job has {len(node_names)} nodes ({nodelist})")
        local_rank = _int_var(env, "SLURM_LOCALID", _OUTSIDE_SLURM)
        on_node = tasks_per_node[node_rank]
        if local_rank >= on_node:
            raise SlurmEnvError(
                f"SLURM_LOCALID={local_rank} but node {node_names[node_rank]} runs only {on_node} tasks "
                f"({tasks_text}); launch the step with srun so each task gets its own local id"
            )
        procid = _slurm_procid(env)
        master_addr, master_port = rendezvous_from_env(env)
        job_id = env.get("SLURM_JOB_ID")

        if nproc_per_node is not None:
            # The torchrun launcher: this task starts nproc_per_node workers on its node.
            if set(tasks_per_node) != {1}:
                raise SlurmEnvError(
                    f"--nproc-per-node {nproc_per_node} is for a step of one task per node, but this step runs "
                    f"{tasks_text} tasks per node; start the torchrun launcher with srun --ntasks-per-node=1"
                )
            if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
                raise SlurmEnvError(f"--nproc-per-node {nproc_per_node!r} must be a positive number of workers")
            workers = nproc_per_node
            plan = plan_on_switches(
                tasks_per_node=(workers,) * len(node_names),
                shard_size=shard_size,
                node_names=node_names,
                places=places,
                tp_size=tp_size,
                topology=topology,
            )
            placed = plan.node_names.index(node_names[node_rank])
            return cls(
                plan=plan,
                rank=plan.rank_of(placed, 0),
                local_rank=0,
                node_rank=placed,
                master_addr=master_addr,
                master_port=master_port,
                device=select_device(env, local_rank=0, local_world_size=workers),
                slurm_procid=procid,
                launch_mode="task-per-node",
                job_id=job_id,
            )

        plan = plan_on_switches(
            tasks_per_node=tasks_per_node,
            shard_size=shard_size,
            node_names=node_names,
            places=places,
            tp_size=tp_size,
            topology=topology,
        )
        placed = plan.node_names.index(node_names[node_rank])
        return cls(
            plan=plan,
            rank=plan.rank_of(placed, local_rank),
            local_rank=local_rank,
            node_rank=placed,
            master_addr=master_addr,
            master_port=master_port,
            device=select_device(env, local_rank=local_rank, local_world_size=on_node),
            slurm_procid=procid,
            launch_mode="task-per-gpu",
            job_id=job_id,
        )

    @classmethod
    def _from_torchrun_env(
        cls, env: Mapping[str, str], *, shard_size: int, tp_size: int, places: NodeSwitches, topology: str
    ) -> RankLayout:
        hint = "start workers with torchrun --node-rank <index of this node> (static rendezvous)"
        local_rank = _int_var(env, "LOCAL_RANK", hint)
        local_world = _int_var(env, "LOCAL_WORLD_SIZE", hint)
        world = _int_var(env, "WORLD_SIZE", hint)
        node_rank = _int_var(env, "GROUP_RANK", hint)
        torch_rank = _int_var(env, "RANK", hint)
        if local_world < 1 or world < local_world or world % local_world:
            raise SlurmEnvError(
                f"WORLD_SIZE={world} is not a positive multiple of LOCAL_WORLD_SIZE={local_world}; "
                f"give every node the same --nproc-per-node"
            )
        nnodes = world // local_world
        if local_rank >= local_world:
            raise SlurmEnvError(f"LOCAL_RANK={local_rank} but LOCAL_WORLD_SIZE={local_world}; {hint}")
        if node_rank >= nnodes:
            raise SlurmEnvError(
                f"GROUP_RANK={node_rank} but WORLD_SIZE={world} / LOCAL_WORLD_SIZE={local_world} gives {nnodes} nodes; {hint}"
            )
        nodelist = env.get("SLURM_JOB_NODELIST", "").strip()
        node_names = expand_nodelist(nodelist) if nodelist else ()
        if len(node_names) != nnodes:
            node_names = default_node_names(nnodes)
        # GROUP_RANK is the node's place in the launcher's order, which followed the same switches
        plan = plan_on_switches(
            tasks_per_node=(local_world,) * nnodes,
            shard_size=shard_size,
            node_names=node_names,
            places=places,
            tp_size=tp_size,
            topology=topology,
        )
        rank = plan.rank_of(node_rank, local_rank)
        if rank != torch_rank:
            raise SlurmEnvError(
                f"torchrun gave RANK={torch_rank} but node {node_rank} local rank {local_rank} is rank {rank} "
                f"node-major; use a static rendezvous (--node-rank), not c10d, so ranks follow node order"
            )
        return cls(
            plan=plan,
            rank=rank,
            local_rank=local_rank,
            node_rank=node_rank,
            master_addr=_require(env, "MASTER_ADDR", hint),
            master_port=rendezvous_port(env),
            device=select_device(env, local_rank=local_rank, local_world_size=local_world),
            slurm_procid=_slurm_procid(env),
            launch_mode="torchrun",
            job_id=env.get("SLURM_JOB_ID"),
        )
