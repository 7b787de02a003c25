"""Compare the groups a DeviceMesh actually built with the plan (pure: no torch).

``dist.py`` gathers, from every rank, the name of the node it runs on and the ranks of
the shard and replicate groups its mesh holds; :func:`compare_groups` turns that into a
list of problems, identical on every rank, so that every rank raises the same error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hpc_hsdp.errors import HsdpError
from hpc_hsdp.plan.topology import TopologyPlan


class GroupMismatchError(HsdpError):
    """The groups torch built differ from the plan; the message holds a table of them."""


@dataclass(frozen=True)
class GroupProblem:
    """One realized group (or rank placement) that contradicts the plan."""

    axis: str
    """``shard``, ``replicate``, ``tp`` or ``node`` (a rank on another node than planned)."""
    planned: tuple[int, ...]
    """The ranks the plan expects (for ``node``: the ranks the plan puts on that node)."""
    realized: tuple[int, ...]
    """The ranks torch actually grouped (for ``node``: the ranks found on the node)."""
    nodes: tuple[str, ...]
    """Nodes the realized group spans, in rank order, without repeats."""
    reason: str


def _nodes_of(group: Sequence[int], node_of_rank: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(node_of_rank[r] for r in group))


def compare_groups(
    plan: TopologyPlan,
    node_of_rank: Sequence[str],
    shard_group_of_rank: Sequence[Sequence[int]],
    replicate_group_of_rank: Sequence[Sequence[int]],
    tp_group_of_rank: Sequence[Sequence[int]] | None = None,
) -> list[GroupProblem]:
    """Problems of a realized layout; empty when it is the plan.

    ``node_of_rank[r]`` is the node rank ``r`` reported; ``shard_group_of_rank[r]`` and
    ``replicate_group_of_rank[r]`` the ranks of the groups rank ``r``'s mesh holds. Node
    names are matched by partition, not by spelling: the ranks the plan puts on one node
    must share one reported name, and different planned nodes different names (torchrun
    outside SLURM names nodes ``n1, n2, ...`` while the host says otherwise).
    ``tp_group_of_rank`` (with tensor parallelism): the ranks of each rank's tp group.
    """
    world = plan.world_size
    for what, seq in (
        ("node names", node_of_rank),
        ("shard groups", shard_group_of_rank),
        ("replicate groups", replicate_group_of_rank),
    ):
        if len(seq) != world:
            raise ValueError(f"{len(seq)} {what} for a plan of {world} ranks")
    problems = _node_problems(plan, node_of_rank)
    problems += _group_problems(plan, node_of_rank, "shard", shard_group_of_rank, plan.shard_group_of)
    problems += _group_problems(plan, node_of_rank, "replicate", replicate_group_of_rank, plan.replicate_group_of)
    if tp_group_of_rank is not None:
        problems += _group_problems(plan, node_of_rank, "tp", tp_group_of_rank, plan.tp_group_of)
    return problems


def _node_problems(plan: TopologyPlan, node_of_rank: Sequence[str]) -> list[GroupProblem]:
    """The ranks on each planned node, as a partition: one planned node on several hosts, or
    several planned nodes on one host."""
    problems: list[GroupProblem] = []
    names_of_planned: dict[int, tuple[str, ...]] = {}
    for node_index, first in enumerate(plan.first_rank_of_node):
        ranks = tuple(range(first, first + plan.tasks_per_node[node_index]))
        names_of_planned[node_index] = _nodes_of(ranks, node_of_rank)
        if len(names_of_planned[node_index]) > 1:
            problems.append(
                GroupProblem(
                    axis="node",
                    planned=ranks,
                    realized=ranks,
                    nodes=names_of_planned[node_index],
                    reason=f"the plan puts these ranks on one node ({plan.node_names[node_index]}) but they run on several",
                )
            )
    owners: dict[str, list[int]] = {}
    for node_index, names in names_of_planned.items():
        if len(names) == 1:  # a planned node already split over several hosts is reported above
            owners.setdefault(names[0], []).append(node_index)
    for name, planned_nodes in owners.items():
        if len(planned_nodes) > 1:
            found = tuple(r for r in range(plan.world_size) if node_of_rank[r] == name)
            problems.append(
                GroupProblem(
                    axis="node",
                    planned=(),
                    realized=found,
                    nodes=(name,),
                    reason="ranks the plan puts on different nodes ("
                    + ", ".join(plan.node_names[i] for i in planned_nodes)
                    + f") all run on {name}",
                )
            )
    return problems


def _group_problems(
    plan: TopologyPlan,
    node_of_rank: Sequence[str],
    axis: str,
    realized_of_rank: Sequence[Sequence[int]],
    planned_of,
) -> list[GroupProblem]:
    """Each realized group of one mesh axis once: other ranks than planned, or more nodes."""
    problems: list[GroupProblem] = []
    seen: set[tuple[int, ...]] = set()
    for rank in range(plan.world_size):
        realized = tuple(realized_of_rank[rank])
        planned = tuple(planned_of(rank))
        if realized in seen:
            continue
        seen.add(realized)
        nodes = _nodes_of(realized, node_of_rank)
        if realized != planned:
            problems.append(
                GroupProblem(
                    axis=axis,
                    planned=planned,
                    realized=realized,
                    nodes=nodes,
                    reason=f"rank {rank}'s {axis} group differs from the plan",
                )
            )
            continue
        planned_span = len(plan.nodes_of_group(planned))
        if len(nodes) > planned_span:
            where = "inside one node" if planned_span == 1 else f"on {planned_span} nodes"
            problems.append(
                GroupProblem(
                    axis=axis,
                    planned=planned,
                    realized=realized,
                    nodes=nodes,
                    reason=f"the plan puts this group {where} but it spans {len(nodes)}",
                )
            )
    return problems


def _ranks(group: Sequence[int]) -> str:
    return "[" + ",".join(map(str, group)) + "]" if group else "-"


def format_problems(problems: Sequence[GroupProblem]) -> str:
    """A plain-text table of the problems, one row each."""
    rows = [("axis", "planned", "realized", "nodes", "problem")]
    rows += [(p.axis, _ranks(p.planned), _ranks(p.realized), ",".join(p.nodes), p.reason) for p in problems]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:4])) + "  " + row[4] for row in rows)


def mismatch_message(problems: Sequence[GroupProblem], plan: TopologyPlan) -> str:
    return (
        f"the realized device mesh does not match the plan ({plan.nodes} nodes, tasks per node "
        f"{list(plan.tasks_per_node)}, shard size {plan.shard_size}"
        + (f", tp size {plan.tp_size}" if plan.tp_size > 1 else "")
        + f"); {len(problems)} problem(s):\n"
        + format_problems(problems)
        + "\nHINT: ranks must be node-major; launch with `srun hpc-hsdp run` (one task per GPU) or "
        "torchrun with a static rendezvous (--node-rank), and do not set RANK yourself"
    )
