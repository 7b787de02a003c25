"""Count the collectives a rank issues, per mesh axis, intra- or inter-node.

:class:`CommStats` is a context manager that listens, while active, to the
``torch.distributed`` functions FSDP2 looks up at call time (``dist.all_gather_single``,
``dist.reduce_scatter_single``, ``dist.all_reduce`` in
``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``; also the older names
``all_gather_into_tensor``/``reduce_scatter_tensor``) through their one wrapper
(:mod:`hpc_hsdp.task.observation.collectives`: only the outermost call of a thread is seen) and
records the group, the tensor bytes and the bytes on the wire of each call.

Per call, for a group of ``n`` ranks (ring algorithms):

- ``all_gather``: tensor bytes = the gathered output; on the wire ``(n-1)/n`` of it;
- ``reduce_scatter``: tensor bytes = the full input; on the wire ``(n-1)/n`` of it;
- ``all_reduce``: tensor bytes = the tensor; on the wire ``2(n-1)/n`` of it.

A collective on a one-rank group moves nothing and is not recorded. The axis is
``shard``, ``replicate`` or ``tp`` when the group is that axis' group of the mesh, ``world`` for
the default group, else ``other``; it is inter-node when the group's ranks ran on more
than one node of the REALIZED layout (the node names every rank reported at init).
The functional collectives of DTensor's redistributions (tensor parallelism's all-gathers and
reduce-scatters of activations, the loss's all-reduces on vocabulary shards) are counted the same
way, under the ``tp`` axis.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch.distributed as dist

from hpc_hsdp.task.observation.collectives import Listening, listen

# counted name -> (kind, which argument holds the tensor whose size is the tensor bytes)
_COUNTED = {
    "all_gather_single": ("all_gather", "output"),
    "all_gather_into_tensor": ("all_gather", "output"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
    # DTensor's redistributions (tensor parallelism): the gathered size is the input's times the group's
    "funcol.all_gather_single": ("all_gather", "gathered"),
    "funcol.reduce_scatter_single": ("reduce_scatter", "input"),
    "funcol.all_reduce": ("all_reduce", "tensor"),
}
# positional index of (output, input) / tensor; group keyword or its position
_POSITIONS = {
    "all_gather_single": {"output": 0, "input": 1, "group": 2},
    "all_gather_into_tensor": {"output": 0, "input": 1, "group": 2},
    "reduce_scatter_single": {"output": 0, "input": 1, "group": 3},
    "reduce_scatter_tensor": {"output": 0, "input": 1, "group": 3},
    "all_reduce": {"tensor": 0, "group": 2},
    "funcol.all_gather_single": {"gathered": 0, "group": 2},
    "funcol.reduce_scatter_single": {"input": 0, "group": 3},
    "funcol.all_reduce": {"tensor": 0, "group": 2},
}
_KEYWORDS = {
    "output": ("output", "output_tensor"),
    "input": ("input", "input_tensor", "self"),
    "gathered": ("self",),
    "tensor": ("tensor", "self"),
    "group": ("group",),
}

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _argument(name: str, role: str, args: tuple, kwargs: dict):
    for key in _KEYWORDS[role]:
        if key in kwargs:
            return kwargs[key]
    index = _POSITIONS[name][role]
    return args[index] if index < len(args) else None


def wire_bytes(kind: str, tensor_bytes: int | Fraction, group_size: int) -> Fraction:
    """Bytes one rank sends with a ring algorithm."""
    n = group_size
    factor = Fraction(2 * (n - 1), n) if kind == "all_reduce" else Fraction(n - 1, n)
    return tensor_bytes * factor


@dataclass
class _Entry:
    calls: int = 0
    tensor_bytes: int = 0


class CommStats:
    """Record collectives while active; ``take()`` returns the totals so far and starts anew.

    ``mesh``: the ``("replicate", "shard")`` DeviceMesh (None: only ``world``/``other``);
    ``node_of_rank``: the node name of every global rank (the realized layout).
    """

    def __init__(self, *, mesh=None, node_of_rank: Sequence[str]) -> None:
        self.node_of_rank = list(node_of_rank)
        self._axis_of_ranks: dict[tuple[int, ...], str] = {}
        self._axis_of_group: dict[int, str] = {}
        if mesh is not None:
            for axis in mesh.mesh_dim_names or ():
                group = mesh.get_group(axis)
                self._axis_of_group[id(group)] = axis
                self._axis_of_ranks.setdefault(tuple(dist.get_process_group_ranks(group)), axis)
        self._group_info: dict[int, tuple[str, int, bool]] = {}
        self._totals: dict[tuple[str, str, int, bool], _Entry] = {}
        self._listening: Listening | None = None
        self._lock = threading.Lock()

    # -------------------------------------------------------------------- listen / stop
    def __enter__(self) -> CommStats:
        if self._listening is not None:
            raise RuntimeError("CommStats is already active")
        self._listening = listen(self._entered, names=_COUNTED)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening to the collectives (idempotent)."""
        if self._listening is not None:
            self._listening.close()
            self._listening = None

    @property
    def active(self) -> bool:
        return self._listening is not None

    def _entered(self, name: str, args: tuple, kwargs: dict) -> None:
        kind, role = _COUNTED[name]
        group = _argument(name, "group", args, kwargs)
        if name.startswith("funcol."):
            group = _process_group(group)
        self._record(kind, _argument(name, role, args, kwargs), group, gathered=role == "gathered")

    # -------------------------------------------------------------------- recording
    def _info(self, group) -> tuple[str, int, bool]:
        key = id(group)
        info = self._group_info.get(key)
        if info is None:
            if group is None:
                ranks, axis = tuple(range(dist.get_world_size())), "world"
            else:
                ranks = tuple(dist.get_process_group_ranks(group))
                axis = (
                    self._axis_of_group.get(id(group))
                    or self._axis_of_ranks.get(ranks)
                    or ("world" if group is dist.group.WORLD else "other")
                )
            nodes = {self.node_of_rank[r] for r in ranks} if self.node_of_rank else set()
            info = (axis, len(ranks), len(nodes) > 1)
            self._group_info[key] = info
        return info

    def _record(self, kind: str, tensor, group, *, gathered: bool = False) -> None:
        if tensor is None:
            return
        axis, size, inter = self._info(group)
        if size <= 1:
            return
        nbytes = tensor.numel() * tensor.element_size() * (size if gathered else 1)
        with self._lock:
            entry = self._totals.setdefault((axis, kind, size, inter), _Entry())
            entry.calls += 1
            entry.tensor_bytes += nbytes

    def reset(self) -> None:
        with self._lock:
            self._totals = {}

    def take(self) -> dict:
        """The totals since the last ``take``/``reset`` (then starts anew)::

            {"shard": {"group_size": 4, "inter_node": False,
                       "all_gather": {"calls": 3, "tensor_bytes": ..., "wire_bytes": ...}, ...},
             "replicate": {...}, "world": {...},
             "intra_node_wire_bytes": ..., "inter_node_wire_bytes": ...}

        Wire bytes are rounded down to whole bytes per (axis, kind).
        """
        with self._lock:
            totals, self._totals = self._totals, {}
        out: dict = {}
        intra = inter_total = 0
        for (axis, kind, size, inter), entry in sorted(totals.items()):
            wire = int(wire_bytes(kind, entry.tensor_bytes, size))
            section = out.setdefault(axis, {"group_size": size, "inter_node": inter})
            if section["group_size"] != size:  # "other" groups of different sizes
                section["group_size"] = None
            section["inter_node"] = section["inter_node"] or inter
            section[kind] = {"calls": entry.calls, "tensor_bytes": entry.tensor_bytes, "wire_bytes": wire}
            if inter:
                inter_total += wire
            else:
                intra += wire
        out["intra_node_wire_bytes"] = intra
        out["inter_node_wire_bytes"] = inter_total
        return out


def _process_group(group):
    """A functional collective's group (a ProcessGroup, a group name, a (mesh, axis) pair or a
    list of ranks) as the ProcessGroup it names."""
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    import torch.distributed._functional_collectives as funcol  # noqa: PLC0415 - loaded with DTensor anyway

    return dist.distributed_c10d._resolve_process_group(funcol._resolve_group_name(group))


def recorder_for(mesh, realized: list[dict]) -> CommStats:
    """A recorder for a job's mesh, with the realized node of every rank (``init``'s groups)."""
    return CommStats(mesh=mesh, node_of_rank=[d["node"] for d in realized])
