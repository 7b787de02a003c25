"""How a plan looks to a person: a per-node table, a verdict on traffic, an SVG picture."""

from __future__ import annotations

from html import escape

from hpc_hsdp.plan.estimates import (
    ACTIVATION_RESERVE,
    ActivationShape,
    Estimate,
    Fit,
    Recommendation,
    SaveTime,
    TpRecommendation,
    budget_bytes,
)
from hpc_hsdp.plan.topology import TopologyPlan
from hpc_hsdp.plan.units import format_bytes

LISTED_RANKS = 8
"""A group of more ranks than this, equally spaced, is written ``[3,11,19,...,8187]``."""


def _compact(ranks: tuple[int, ...]) -> str:
    steps = {b - a for a, b in zip(ranks, ranks[1:])}
    if len(ranks) > 2 and steps == {1}:
        return f"[{ranks[0]}-{ranks[-1]}]"
    if len(ranks) > LISTED_RANKS and len(steps) == 1:
        return "[" + ",".join(map(str, ranks[:3])) + f",...,{ranks[-1]}]"
    return "[" + ",".join(map(str, ranks)) + "]"


def traffic_verdict(plan: TopologyPlan) -> list[str]:
    """What the layout means for the network, in sentences."""
    s, r, t = plan.shard_size, plan.num_replicas, plan.tp_size
    mesh = f"replicate={r}, shard={s}" + (f", tp={t}" if t > 1 else "")
    lines = [f"{plan.kind}: mesh ({mesh}) over {plan.nodes} node(s), {plan.world_size} ranks"]
    if t > 1:
        lines.append(tp_line(plan))
    if s == 1 and t > 1:
        lines.append(
            f"no sharding over the shard axis: each TP group holds a whole copy of the model (1/{t} of every "
            f"split layer per rank)" + ("; gradients are all-reduced across the replicas" if r > 1 else "")
        )
    elif s == 1:
        lines.append("no sharding: every rank holds the whole model; gradients are all-reduced across all ranks")
    elif not plan.shard_groups_cross_nodes:
        lines.append(
            "shard groups stay inside one node: the all-gathers and reduce-scatters of parameters and "
            "gradients (the heavy traffic) never leave a node"
        )
    else:
        span = len(plan.nodes_of_group(plan.shard_groups[0]))
        lines.append(
            f"shard groups span {span} whole nodes: every all-gather and reduce-scatter crosses the "
            f"inter-node network (shard across nodes, by choice of --shard {s})"
        )
    if r > 1:
        where = "crosses nodes" if plan.replicate_groups_cross_nodes else "stays inside one node"
        lines.append(f"replicate groups: the all-reduce of 1/{s * t} of the gradients {where}")
    return lines


def tp_line(plan: TopologyPlan) -> str:
    """The TP groups in one sentence: T consecutive ranks, inside one node, what they exchange."""
    t, groups = plan.tp_size, plan.tp_groups
    shown = ", ".join(_compact(g) for g in groups[:LISTED_COPIES])
    more = f", ... {len(groups) - LISTED_COPIES} more" if len(groups) > LISTED_COPIES else ""
    where = "cross nodes" if plan.tp_groups_cross_nodes else "each inside one node"
    return (
        f"TP groups: {len(groups)} of {t} consecutive ranks ({shown}{more}), {where}: every block's collectives "
        f"of activations (all-gathers and reduce-scatters under sequence parallelism, all-reduces under an hf: "
        f"model's plan) stay on the node's links"
    )


LISTED_COPIES = 4
"""Copies of the model whose nodes and switches :func:`switch_lines` names (then "..." and a count)."""


def switch_lines(plan: TopologyPlan) -> list[str]:
    """Where the nodes' leaf switches (or blocks) put the groups; none where they are not known."""
    if not plan.node_switches:
        return []
    if not plan.switches_known:
        unknown = [name for name, leaf in zip(plan.node_names, plan.node_switches) if not leaf]
        return [f"switches: no leaf switch known for {', '.join(unknown[:8])}: the node-list order stands"]
    leaves = dict.fromkeys(plan.node_switches)
    lines = [f"switches: {len(plan.node_names)} nodes under {len(leaves)} leaf switch(es), in the switch order"]
    if plan.shard_groups_cross_nodes:
        crossing = set(plan.copies_across_switches)
        described = []
        for r in range(min(plan.num_replicas, LISTED_COPIES)):
            nodes = plan.nodes_of_copy(r)
            under = ",".join(dict.fromkeys(plan.node_switches[n] for n in nodes))
            names = ",".join(plan.node_names[n] for n in nodes)
            described.append(f"copy {r} on {names} ({'across ' if r in crossing else 'under '}{under})")
        more = f"; ... {plan.num_replicas - LISTED_COPIES} more" if plan.num_replicas > LISTED_COPIES else ""
        verdict = (
            f"{len(crossing)} of {plan.num_replicas} cross leaf switches" if crossing else "each under one leaf switch"
        )
        lines.append(f"shard groups spanning nodes: {verdict}: {'; '.join(described)}{more}")
    else:
        lines.append("shard groups inside one node: under one leaf switch by themselves")
    if plan.num_replicas > 1:
        spans = len(leaves) > 1
        lines.append(
            "replicate groups cross leaf switches (their once-a-step all-reduce goes over the spine)"
            if spans
            else "replicate groups under one leaf switch"
        )
    return lines


def request_lines(plan: TopologyPlan) -> list[str]:
    """What the job asks SLURM for by default, per node: the CPUs and memory each rank gets."""
    tasks = max(plan.tasks_per_node)
    return [
        f"request: whole nodes (--exclusive, --mem=0), {tasks} task(s) and GPU(s) per node: each rank gets "
        f"1/{tasks} of its node's CPUs (srun --cpus-per-task) and memory; --no-exclusive with --cpus-per-task "
        f"and --mem to share nodes"
    ]


TABLE_HEAD_NODES, TABLE_TAIL_NODES = 4, 2
"""A plan of more nodes than these lists the first and the last nodes' ranks (``--json``: all)."""


def _shown_nodes(plan: TopologyPlan) -> tuple[list[int], int | None]:
    """Node indexes the table lists, and where the elided ones would be (None: all listed)."""
    if plan.nodes <= TABLE_HEAD_NODES + TABLE_TAIL_NODES + 1:
        return list(range(plan.nodes)), None
    return list(range(TABLE_HEAD_NODES)) + list(range(plan.nodes - TABLE_TAIL_NODES, plan.nodes)), TABLE_HEAD_NODES


def plan_text(
    plan: TopologyPlan,
    *,
    estimate: Estimate | None = None,
    fit: Fit | None = None,
    gpu_memory: int | None = None,
    save: SaveTime | None = None,
    activations: ActivationShape | None = None,
) -> str:
    nodes, gap_at = _shown_nodes(plan)
    switches = bool(plan.node_switches)
    tp = plan.tp_size > 1
    header = (
        "node",
        *(("switch",) if switches else ()),
        "gpu",
        "rank",
        *(("(r,s,t)", "tp group") if tp else ()),
        "shard group",
        "replicate group",
    )
    blocks: list[list[tuple[str, ...]]] = []
    for node in nodes:
        first = plan.first_rank_of_node[node]
        blocks.append(
            [
                (
                    plan.node_names[node],
                    *((plan.node_switches[node] or "?",) if switches else ()),
                    str(local),
                    str(rank),
                    *(
                        (_coordinates(plan, rank), f"{rank // plan.tp_size}: {_compact(plan.tp_group_of(rank))}")
                        if tp
                        else ()
                    ),
                    f"{shard_group_index(plan, rank)}: {_compact(plan.shard_group_of(rank))}",
                    f"{replicate_group_index(plan, rank)}: {_compact(plan.replicate_group_of(rank))}",
                )
                for local, rank in ((local, first + local) for local in range(plan.tasks_per_node[node]))
            ]
        )
    widths = [max(len(row[i]) for row in [header, *(r for b in blocks for r in b)]) for i in range(len(header))]

    def line(row) -> str:
        return "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    for index, block in enumerate(blocks):
        if index:
            out.append("")
        if gap_at is not None and index == gap_at:
            hidden_first, hidden_last = TABLE_HEAD_NODES, plan.nodes - TABLE_TAIL_NODES - 1
            out.append(
                f"... {hidden_last - hidden_first + 1:,} more nodes ({plan.node_names[hidden_first]} to "
                f"{plan.node_names[hidden_last]}, ranks {plan.first_rank_of_node[hidden_first]}-"
                f"{plan.first_rank_of_node[hidden_last] + plan.tasks_per_node[hidden_last] - 1}): "
                f"--json lists every rank"
            )
            out.append("")
        out.extend(line(row) for row in block)
    out.append("")
    out.extend(traffic_verdict(plan))
    out.extend(switch_lines(plan))
    out.extend(request_lines(plan))
    if estimate is not None:
        out.append("")
        out.append(
            f"per GPU, {estimate.model_params:,} parameters (--precision {estimate.precision}, {estimate.optimizer}):"
        )
        over = f" (over shard x tp = {plan.ranks_per_copy})" if plan.tp_size > 1 else ""
        out.append(
            f"  parameters {format_bytes(estimate.param_bytes)}, gradients {format_bytes(estimate.grad_bytes)} "
            f"(fp32), optimizer state {format_bytes(estimate.optimizer_bytes)}; total "
            f"{format_bytes(estimate.total_bytes)}{over}"
        )
        held = "the whole model" if not estimate.reshard_after_forward else "two blocks"
        out.append(
            f"  in flight: {held} gathered and one block's gradients unsharded "
            f"({estimate.blocks} blocks): {format_bytes(estimate.working_bytes)}"
        )
        if estimate.activation_bytes is not None:
            style = (
                "sequence parallel"
                if activations is None or activations.sequence_parallel
                else "no sequence parallelism"
            )
            split = f" over tp {plan.tp_size} ({style})" if plan.tp_size > 1 else ""
            out.append(
                f"  activations {format_bytes(estimate.activation_bytes)}{split}{_shape_note(activations)}; "
                f"peak {format_bytes(estimate.needed_bytes)}"
            )
        elif plan.tp_size > 1:
            out.append(
                f"  peak {format_bytes(estimate.needed_bytes)} and the activations; activations and TP bytes: give "
                f"--seq-len (and --batch-size) to estimate them (the model's blocks and width from --model or "
                f"--model-params builtin, else a Llama-family shape)"
            )
        else:
            out.append(
                f"  peak {format_bytes(estimate.needed_bytes)} and the activations (give --seq-len and --batch-size "
                f"to count them)"
            )
        for t in estimate.traffic:
            where = "inter-node" if t.inter_node else "intra-node"
            out.append(
                f"  {t.kind:<14} over {t.axis:<9} {format_bytes(t.wire_bytes):>11} on the wire per step ({where})"
            )
        out.append(
            f"  per step: {format_bytes(estimate.intra_node_wire_bytes)} intra-node, "
            f"{format_bytes(estimate.inter_node_wire_bytes)} inter-node"
        )
        if not estimate.reshard_after_forward:
            out.append(
                "  (the whole model gathered fits beside the state: --reshard-after-forward auto keeps the "
                "gathered parameters to backward, no backward re-gather)"
            )
    if save is not None:
        out.append(
            save.warning()
            or f"a save on SIGTERM (about {save.seconds:.0f} s at {save.rate / 1e9:g} GB/s per "
            f"node) fits KillWait ({save.kill_wait_s} s)"
        )
    if gpu_memory is not None:
        if estimate is not None:
            out.append(_fit_line(plan, estimate, gpu_memory))
        if fit is None:
            out.append(
                f"no shard size fits {format_bytes(gpu_memory)}: even full sharding needs more than "
                f"{format_bytes(budget_bytes(gpu_memory))} per GPU; add nodes, split layers (--tp), or give "
                f"--activation-checkpointing, a smaller --batch-size or a shorter --seq-len"
            )
        else:
            at_tp = f" at tp {plan.tp_size}" if plan.tp_size > 1 else ""
            counted = estimate is not None and estimate.activation_bytes is not None
            what = "states, blocks in flight and activations" if counted else "states and blocks in flight"
            left = "left" if counted else "left for activations"
            out.append(
                f"smallest shard size that fits {format_bytes(gpu_memory)}{at_tp}: {fit.shard_size} "
                f"({format_bytes(fit.needed_bytes)} of {what}, {format_bytes(fit.headroom_bytes)} {left})"
            )
    return "\n".join(out) + "\n"


def _fit_line(plan: TopologyPlan, estimate, gpu_memory: int) -> str:
    """Whether the plan's own shard size fits, in so many words, with the numbers that decide it."""
    budget = budget_bytes(gpu_memory)
    kept = "buffers and the allocator" if estimate.activation_bytes is not None else "activations and buffers"
    of = (
        f"{format_bytes(budget)} that may be used ({ACTIVATION_RESERVE:.0%} of {format_bytes(gpu_memory)} kept for "
        f"{kept})"
    )
    at = f"--shard {plan.shard_size}" + (f" --tp {plan.tp_size}" if plan.tp_size > 1 else "")
    if estimate.needed_bytes <= budget:
        return f"{at} fits: {format_bytes(estimate.needed_bytes)} per GPU of the {of}"
    return (
        f"{at} does not fit: {format_bytes(estimate.needed_bytes)} per GPU (states "
        f"{format_bytes(estimate.total_bytes)}, in flight {format_bytes(estimate.working_bytes)}"
        + (f", activations {format_bytes(estimate.activation_bytes)}" if estimate.activation_bytes is not None else "")
        + f"), more than the {of}"
    )


def shard_group_index(plan: TopologyPlan, rank: int) -> int:
    """The index of ``rank``'s shard group in ``plan.shard_groups``: ``rank // S`` when T = 1."""
    return rank // plan.ranks_per_copy * plan.tp_size + rank % plan.tp_size


def replicate_group_index(plan: TopologyPlan, rank: int) -> int:
    """The index of ``rank``'s replicate group in ``plan.replicate_groups``: ``rank % S`` when T = 1."""
    return rank % plan.ranks_per_copy


def _coordinates(plan: TopologyPlan, rank: int) -> str:
    return "({},{},{})".format(*plan.coordinates(rank))


def _colour(index: int, count: int) -> str:
    hue = (index * 360 / max(count, 1) + 200) % 360
    return f"hsl({hue:.0f},65%,72%)"


def plan_svg(plan: TopologyPlan) -> str:
    """Nodes as boxes, GPUs as cells coloured by shard group, labelled with rank and replicate group;
    with tensor parallelism also each rank's (r, s, t) and a frame around each TP group."""
    tp = plan.tp_size > 1
    cell_w, cell_h, gap, pad, label_w = (80, 64, 6, 12, 110) if tp else (64, 48, 6, 12, 110)
    widest = max(plan.tasks_per_node)
    width = label_w + pad + widest * (cell_w + gap) + pad
    row_h = cell_h + 2 * pad
    height = 60 + plan.nodes * (row_h + gap) + 30
    if tp:
        legend = (
            f"colour and Sn: shard group n; Rn: replicate group n; Tn: TP group n (framed); "
            f"mesh (replicate, shard, tp) = ({plan.num_replicas}, {plan.shard_size}, {plan.tp_size})"
        )
    else:
        legend = (
            f"colour and Sn: shard group n; Rn: replicate group n; "
            f"mesh (replicate, shard) = ({plan.num_replicas}, {plan.shard_size})"
        )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{pad}" y="22" font-size="15" font-weight="bold">{escape(plan.kind)}: '
        f"{plan.nodes} node(s) x {escape(str(plan.tasks_per_node[0]) if len(set(plan.tasks_per_node)) == 1 else 'uneven')} GPUs, "
        f"shard {plan.shard_size}, {f'tp {plan.tp_size}, ' if tp else ''}{plan.num_replicas} replicas</text>",
        f'<text x="{pad}" y="42" fill="#444">{legend}</text>',
    ]
    groups = len(plan.shard_groups)
    for node in range(plan.nodes):
        y = 60 + node * (row_h + gap)
        box_w = label_w + plan.tasks_per_node[node] * (cell_w + gap) + pad
        parts.append(
            f'<rect x="{pad / 2}" y="{y}" width="{box_w}" height="{row_h}" rx="8" fill="#f4f4f4" stroke="#333"/>'
        )
        parts.append(
            f'<text x="{pad}" y="{y + row_h / 2 + 4}" font-weight="bold">{escape(plan.node_names[node])}</text>'
        )
        for local in range(plan.tasks_per_node[node]):
            rank = plan.rank_of(node, local)
            shard_index = shard_group_index(plan, rank)
            x = label_w + local * (cell_w + gap)
            if tp and rank % plan.tp_size == 0:
                frame_w = plan.tp_size * (cell_w + gap) - gap + 4
                parts.append(
                    f'<rect x="{x - 2}" y="{y + pad - 2}" width="{frame_w}" height="{cell_h + 4}" rx="5" '
                    f'fill="none" stroke="#000" stroke-width="2" stroke-dasharray="5,3"/>'
                )
            parts.append(
                f'<rect x="{x}" y="{y + pad}" width="{cell_w}" height="{cell_h}" rx="4" '
                f'fill="{_colour(shard_index, groups)}" stroke="#222"/>'
            )
            parts.append(
                f'<text x="{x + cell_w / 2}" y="{y + pad + 18}" text-anchor="middle" font-weight="bold">'
                f"rank {rank}</text>"
            )
            parts.append(
                f'<text x="{x + cell_w / 2}" y="{y + pad + 36}" text-anchor="middle">'
                f"S{shard_index} R{replicate_group_index(plan, rank)}"
                f"{f' T{rank // plan.tp_size}' if tp else ''}</text>"
            )
            if tp:
                parts.append(
                    f'<text x="{x + cell_w / 2}" y="{y + pad + 54}" text-anchor="middle">'
                    f"{_coordinates(plan, rank)}</text>"
                )
    span = len(plan.nodes_of_group(plan.shard_groups[0]))
    verdict = (
        f"each shard group spans {span} whole nodes"
        if plan.shard_groups_cross_nodes
        else "every shard group inside one node"
    )
    if tp:
        verdict += f"; every TP group ({plan.tp_size} consecutive ranks) inside one node"
    parts.append(f'<text x="{pad}" y="{height - 10}" fill="#444">{escape(verdict)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def recommend_text(rec: Recommendation, plan: TopologyPlan) -> str:
    """The recommendation, why, and a table of every shard size considered."""
    out = []
    nodes = (
        f"{plan.nodes} node(s) x {plan.tasks_per_node[0]} GPUs"
        if len(set(plan.tasks_per_node)) == 1
        else f"{plan.nodes} nodes ({','.join(map(str, plan.tasks_per_node))} GPUs)"
    )
    first = rec.candidates[0].estimate
    out.append(
        f"{nodes}, {first.model_params:,} parameters (--precision {first.precision}, {first.optimizer}), "
        f"{format_bytes(rec.gpu_memory)} per GPU"
    )
    if rec.chosen is not None:
        keep = " --reshard-after-forward never" if rec.reshard_after_forward is False else ""
        at_tp = f"--tp {plan.tp_size} " if plan.tp_size > 1 else ""
        out.append(f"recommended: {at_tp}--shard {rec.chosen.shard_size}{keep}")
    else:
        out.append("recommended: none")
    out.extend(f"  {reason}" for reason in rec.reasons)
    out.append("")
    rows = [("shard", "memory/GPU", "fits?", "intra-node/step", "inter-node/step", "")]
    for c in rec.candidates:
        e = c.estimate
        rows.append(
            (
                str(c.shard_size),
                format_bytes(e.needed_bytes),
                "yes" if c.fits else "no",
                format_bytes(e.intra_node_wire_bytes),
                format_bytes(e.inter_node_wire_bytes),
                "<- recommended" if c is rec.chosen else "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        cells = [row[0].rjust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:5], widths[1:5])] + [row[5]]
        out.append("  ".join(cells).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths[:5]))
    out.append(
        f"(bytes on the wire per GPU per step, ring all-gather/reduce-scatter/all-reduce; memory: parameters, "
        f"gradients and optimizer state, the blocks in flight{' and activations' if rec_counts_activations(rec) else ''}"
        f", against {format_bytes(rec.budget_bytes)} = GPU memory less {ACTIVATION_RESERVE:.0%} for "
        f"{'buffers and the allocator' if rec_counts_activations(rec) else 'activations'})"
    )
    return "\n".join(out) + "\n"


def rec_counts_activations(rec: Recommendation) -> bool:
    return any(c.estimate.activation_bytes is not None for c in rec.candidates)


def _shape_note(activations: ActivationShape | None) -> str:
    if activations is None:
        return ""
    ac = ", activation checkpointing" if activations.checkpointing else ""
    return f" (micro-batch {activations.batch_size} x {activations.seq_len} tokens, {activations.source}{ac})"


def recommend_tp_text(rec: TpRecommendation, plan: TopologyPlan, activations: ActivationShape | None) -> str:
    """The recommended TP and shard sizes, why, and a table of every (T, S) considered."""
    nodes = (
        f"{plan.nodes} node(s) x {plan.tasks_per_node[0]} GPUs"
        if len(set(plan.tasks_per_node)) == 1
        else f"{plan.nodes} nodes ({','.join(map(str, plan.tasks_per_node))} GPUs)"
    )
    first_rec = rec.by_tp[0][1]
    first = first_rec.candidates[0].estimate
    out = [
        f"{nodes}, {first.model_params:,} parameters (--precision {first.precision}, {first.optimizer}), "
        f"{format_bytes(first_rec.gpu_memory)} per GPU",
    ]
    if activations is not None:
        out.append(f"activations per micro-batch{_shape_note(activations)}")
    chosen = rec.chosen
    if chosen is not None and chosen.chosen is not None:
        keep = " --reshard-after-forward never" if chosen.reshard_after_forward is False else ""
        out.append(f"recommended: --tp {rec.chosen_tp} --shard {chosen.chosen.shard_size}{keep}")
    else:
        out.append("recommended: none")
    out.extend(f"  {reason}" for reason in rec.reasons)
    if chosen is not None:
        out.extend(f"  {reason}" for reason in chosen.reasons)
    out.append("")
    rows = [("tp", "shard", "memory/GPU", "activations", "fits?", "tp/step", "intra-node/step", "inter-node/step", "")]
    for t, at_t in rec.by_tp:
        for c in at_t.candidates:
            e = c.estimate
            rows.append(
                (
                    str(t),
                    str(c.shard_size),
                    format_bytes(e.needed_bytes),
                    format_bytes(e.activation_bytes) if e.activation_bytes is not None else "?",
                    "yes" if c.fits else "no",
                    format_bytes(e.tp_wire_bytes),
                    format_bytes(e.intra_node_wire_bytes),
                    format_bytes(e.inter_node_wire_bytes),
                    "<- recommended" if chosen is not None and c is chosen.chosen else "",
                )
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        out.append("  ".join([*(cell.rjust(w) for cell, w in zip(row[:-1], widths)), row[-1]]).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths[:-1]))
    out.append(
        f"(bytes on the wire per GPU per step, ring collectives; tp/step: the TP group's activation all-gathers "
        f"and reduce-scatters, inside a node and part of intra-node/step; memory: states, blocks in flight and activations, against "
        f"{format_bytes(first_rec.budget_bytes)} = GPU memory less {ACTIVATION_RESERVE:.0%} for buffers and the "
        f"allocator)"
    )
    return "\n".join(out) + "\n"
