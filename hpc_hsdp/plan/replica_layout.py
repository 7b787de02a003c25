"""The shape of a fault-tolerant job (``--fault-tolerance replica``): pure, no torch.

A *replica group* is the whole nodes that hold one full copy of the model: one node when a
shard group fits in a node (the node's shard groups are replicas inside the group, an HSDP
mesh of its own), ``shard / gpus-per-node`` nodes when a shard group spans nodes. Each group
runs as its own job step with its own process group; torchft averages the gradients across
the groups and keeps the quorum. Spare nodes wait after the groups' nodes; the lighthouse
(torchft's quorum server) runs on the job's first node.

The data split of a step over the live groups (:func:`group_rows`) is a function of the step's
global batch and the participating groups only, so every sample of every step is trained
exactly once whichever groups are alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hpc_hsdp.errors import SpecError, TopologyError
from hpc_hsdp.plan.records import record
from hpc_hsdp.plan.topology import TopologyPlan

if TYPE_CHECKING:
    from hpc_hsdp.plan.switches import NodeSwitches

REPLICA_ID_ENV = "HPC_HSDP_REPLICA_ID"
"""Which replica group a task belongs to (0-based), set by the job's replica supervisor."""
REPLICA_GROUPS_ENV = "HPC_HSDP_REPLICA_GROUPS"
"""How many replica groups the job trains with when none is lost."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's variable: ``http://HOST:PORT`` of the lighthouse."""
ATTEMPT_ENV = "HPC_HSDP_REPLICA_ATTEMPT"
"""How often this replica group's step was started (0 the first time): a fresh store prefix each."""
REPLICA_TAG = "{replica}"
"""In a fault-tolerant job's srun options (the rendered log file names): the replica supervisor
replaces it by ``r<group>a<attempt>``, each group step's own log files."""


@record
class ReplicaShape:
    """The replica groups, spares and lighthouse of a job with ``--fault-tolerance replica``."""

    nodes_per_group: int
    tasks_per_group: int
    groups: tuple[tuple[int, ...], ...]
    """Node indices (in the allocation's order) of each group."""
    spares: tuple[int, ...]
    """Node indices of the spare nodes (after every group's)."""
    min_replicas: int
    lighthouse_node: int = 0

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def total_nodes(self) -> int:
        return sum(len(g) for g in self.groups) + len(self.spares)

    def describe(self, node_names: tuple[str, ...] = ()) -> list[str]:
        """Lines for ``plan`` and the rendered script."""

        def name(index: int) -> str:
            return node_names[index] if index < len(node_names) else f"node {index + 1} of the allocation"

        lines = [
            f"fault tolerance: replica (torchft); {self.num_groups} replica groups of {self.nodes_per_group} "
            f"node{'s' if self.nodes_per_group > 1 else ''} ({self.tasks_per_group} ranks), each its own job "
            f"step; at least {self.min_replicas} must live, else save and requeue"
        ]
        for index, nodes in enumerate(self.groups):
            lines.append(f"  replica group {index}: {', '.join(name(n) for n in nodes)}")
        spares = ", ".join(name(n) for n in self.spares) or "none"
        lines.append(f"  spare nodes: {spares}")
        lines.append(f"  lighthouse: on {name(self.lighthouse_node)} (the job's address), restarted if it ends")
        lines.append(
            "  listeners: each rank's heal server on its node's job address; torchft's manager on every interface "
            "of each group's first node (torchft 0.2.0 binds it so; see SECURITY.md)"
        )
        return lines

    def to_dict(self) -> dict:
        return {
            "nodes_per_group": self.nodes_per_group,
            "tasks_per_group": self.tasks_per_group,
            "groups": [list(g) for g in self.groups],
            "spares": list(self.spares),
            "min_replicas": self.min_replicas,
            "lighthouse_node": self.lighthouse_node,
        }


def replica_shape(plan: TopologyPlan, *, min_replicas: int = 1, spare_nodes: int = 0) -> ReplicaShape:
    """The replica groups of ``plan`` (the nodes that train) with ``spare_nodes`` more; raises
    TopologyError/SpecError (one line, exit 2) where the job cannot be split into whole-node
    replica groups."""
    counts = plan.tasks_per_node
    if len(set(counts)) != 1:
        raise TopologyError(
            f"--fault-tolerance replica needs the same tasks on every node (got {','.join(map(str, counts))}): "
            f"each replica group is whole nodes holding one copy; drop --ntasks"
        )
    per_node, shard = counts[0], plan.shard_size
    nodes = len(counts)
    nodes_per_group = 1 if shard <= per_node else shard // per_node
    groups = nodes // nodes_per_group
    if groups < 2:
        raise TopologyError(
            f"--fault-tolerance replica: {nodes} node(s) of {per_node} ranks with --shard {shard} hold "
            f"{groups} replica group of whole nodes; it needs at least 2 (more --nodes, or a smaller --shard)"
        )
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise SpecError(f"--min-replicas {min_replicas!r} must be a positive integer")
    if min_replicas > groups:
        raise SpecError(
            f"--min-replicas {min_replicas} is more than the job's {groups} replica groups "
            f"({nodes} nodes / {nodes_per_group} per group); give at most {groups}"
        )
    if isinstance(spare_nodes, bool) or not isinstance(spare_nodes, int) or spare_nodes < 0:
        raise SpecError(f"--spare-nodes {spare_nodes!r} must be 0 or a positive integer")
    if spare_nodes % nodes_per_group:
        raise SpecError(
            f"--spare-nodes {spare_nodes}: a replica group is {nodes_per_group} whole nodes; give a multiple of "
            f"{nodes_per_group}"
        )
    return ReplicaShape(
        nodes_per_group=nodes_per_group,
        tasks_per_group=nodes_per_group * per_node,
        groups=tuple(tuple(range(g * nodes_per_group, (g + 1) * nodes_per_group)) for g in range(groups)),
        spares=tuple(range(nodes, nodes + spare_nodes)),
        min_replicas=min_replicas,
    )


def groups_on_switches(
    node_names: Sequence[str], places: NodeSwitches, *, groups: int, nodes_per_group: int, spare_nodes: int = 0
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """The replica groups and the spare groups of the job's nodes ``node_names`` (in its node
    list's order), as indices into that list: ``nodes_per_group`` nodes each, in the switch order
    (:func:`~hpc_hsdp.plan.switches.switch_order`), the groups under one leaf switch first, so
    that a group that must cross switches is a spare where one can be. Without every node's
    switches (``places``): the node-list order, as :func:`replica_shape` numbers them."""
    from hpc_hsdp.plan.switches import switch_order  # noqa: PLC0415  (the supervisor only)

    names = tuple(node_names)
    order = switch_order(names, places, nodes_per_group)
    index = {name: i for i, name in enumerate(names)}
    chunks = [
        tuple(index[name] for name in order[start : start + nodes_per_group])
        for start in range(0, groups * nodes_per_group + spare_nodes, nodes_per_group)
    ]
    if all(places.get(name) for name in names):
        chunks.sort(key=lambda chunk: len({places[names[i]] for i in chunk}) > 1)  # stable: crossing ones last
    return tuple(chunks[:groups]), tuple(chunks[groups:])


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``total`` items are split into ``parts`` contiguous
    parts whose sizes differ by at most one (the first ``total % parts`` get one more)."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def group_rows(
    global_batch: int, *, participants: int, group_index: int, group_world: int, rank: int, max_rows: int
) -> list[tuple[int, int]]:
    """This rank's rows of one step's global batch when ``participants`` replica groups train it:
    ``[start, stop)`` offsets into the global batch, one per micro-batch, each at most ``max_rows``
    rows (the rows per micro-batch of the full job, so memory stays what it was). Group
    ``group_index`` takes its contiguous part of the batch; its ``group_world`` ranks split that;
    every rank of a group runs the same number of micro-batches (the most any rank of it needs:
    FSDP's collectives are per micro-batch), an empty one where it has no rows left."""
    if participants < 1 or not 0 <= group_index < participants:
        raise ValueError(f"group {group_index} is not one of {participants} participants")
    g_start, g_stop = split_evenly(global_batch, participants, group_index)
    size = g_stop - g_start
    r_start, r_stop = split_evenly(size, group_world, rank)
    largest_group = -(-global_batch // participants)
    most = -(-largest_group // group_world)  # every rank of every group: the same number of micro-batches
    micro = max(1, -(-most // max_rows))
    out = []
    for m in range(micro):
        start, stop = split_evenly(r_stop - r_start, micro, m)
        out.append((g_start + r_start + start, g_start + r_start + stop))
    return out
