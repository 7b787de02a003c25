"""The NCCL flight recorder's dumps of a hang, read without torch: which collective the job
hung in and which ranks never entered it.

Every rank of an NCCL run records its last collectives (``TORCH_FR_BUFFER_SIZE``, set by
:func:`hpc_hsdp.task.parallelism.dist.flight_recorder_env`); when the hang watchdog fires, each rank
dumps them to ``<run_dir>/hang/nccl-trace-rank<N>.pkl`` (torch's own dump on a process-group
timeout, ``TORCH_FR_DUMP_TEMP_FILE``, lands beside it as ``nccl-trace-rank<N>``). A dump is
torch's pickle (``torch/distributed/flight_recorder``'s format, version 2.x)::

    {"version": "2.10", "pg_config": {"<pg name>": {"name", "desc", "ranks": "[0, 1]"}},
     "pg_status": {...}, "entries": [{"record_id", "pg_id", "process_group": ("<pg name>", "<desc>"),
       "collective_seq_id", "p2p_seq_id", "op_id", "profiling_name": "nccl:all_reduce",
       "time_created_ns", "input_sizes", "output_sizes", "state": "scheduled|started|completed",
       "timeout_ms", "is_p2p", "frames": [...], ...}, ...]}

A collective is recorded when a rank enqueues it; so in each process group, the members whose
newest collective sequence number is below the group's highest never entered that
collective, and the members whose entry for it is not ``completed`` wait in it. Of the
groups where that happened, :func:`find_hang` names the one whose waiting entry was created
first (the later ones wait on its ranks). DeviceMesh names its groups ``mesh_<axis>``, so the
mesh axis is the group's description. Pickles are read by :func:`load_dump` with an
unpickler that builds only plain data (no class is looked up): a run directory's file is not
code.
"""

from __future__ import annotations

import io
import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

from hpc_hsdp.files import read_capped
from hpc_hsdp.rundir.status_section import RunView, StatusSection

HANG_DIR = "hang"
MAX_DUMP_BYTES = 256 << 20
"""One rank's dump: torch's buffer of 2,000 entries with their stack frames is a few MiB."""
TRACE_PREFIX = "nccl-trace-rank"
_TRACE_NAME = re.compile(r"^nccl-trace-rank(\d+)(\.pkl)?$")


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"a flight recorder dump holds plain data only, not {module}.{name}")


def load_dump(data: bytes) -> dict:
    """One rank's dump (dicts, lists, strings, numbers), or ValueError."""
    try:
        dump = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - a torn or foreign file: say so, do not trace back
        raise ValueError(f"not a flight recorder dump ({type(exc).__name__}: {exc})") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        raise ValueError("not a flight recorder dump (no entries list)")
    return dump


def trace_files(run_dir: str | Path) -> dict[int, Path]:
    """rank -> its dump in ``<run_dir>/hang`` (the watchdog's ``.pkl`` preferred to torch's own)."""
    found: dict[int, Path] = {}
    directory = Path(run_dir) / HANG_DIR
    try:
        paths = sorted(directory.iterdir())
    except OSError:
        return found
    for path in paths:
        match = _TRACE_NAME.match(path.name)
        if match and path.is_file():
            rank = int(match.group(1))
            if rank not in found or match.group(2):
                found[rank] = path
    return found


def read_dumps(run_dir: str | Path) -> tuple[dict[int, dict], list[str]]:
    """rank -> dump for every readable dump of the run, and notes on the unreadable ones."""
    dumps, notes = {}, []
    for rank, path in trace_files(run_dir).items():
        try:
            dumps[rank] = load_dump(read_capped(path, max_bytes=MAX_DUMP_BYTES))
        except (OSError, ValueError) as exc:
            notes.append(f"{path.name}: {exc}")
    return dumps, notes


@dataclass
class HungCollective:
    op: str
    """``all_reduce``, ``_reduce_scatter_base``, ... (the profiling name without ``nccl:``)."""
    group: str
    """The process group's name in the dump."""
    axis: str
    """``shard`` or ``replicate`` (a DeviceMesh group), else the group's description (``default_pg``)."""
    seq: int
    """The collective's sequence number in its group."""
    members: list[int]
    waiting: list[int]
    """Ranks that entered it and have not completed it."""
    missing: list[int]
    """Members whose dump shows they never entered it."""
    last_entered: dict[int, int | None] = field(default_factory=dict)
    """Each missing rank's newest sequence number in the group (None: none recorded)."""
    no_dump: list[int] = field(default_factory=list)
    """Members with no dump at all (their watchdog did not write one: dead, or never got there)."""

    def words(self) -> str:
        where = f"mesh axis {self.axis}" if self.axis in ("shard", "replicate") else f"group {self.axis}"
        text = f"NCCL {self.op} #{self.seq} on {where} (ranks {_ranks(self.members)})"
        parts = []
        if self.waiting:
            parts.append(f"{_plural(self.waiting)} {_ranks(self.waiting)} waiting in it")
        if self.missing:
            last = ", ".join(
                f"{rank}: {'none' if seq is None else f'#{seq}'}" for rank, seq in sorted(self.last_entered.items())
            )
            parts.append(f"{_plural(self.missing)} {_ranks(self.missing)} never entered it (last entered {last})")
        if self.no_dump:
            parts.append(f"no trace from {_plural(self.no_dump)} {_ranks(self.no_dump)}")
        return text + ": " + "; ".join(parts) if parts else text

    def to_dict(self) -> dict:
        return {
            "op": self.op,
            "group": self.group,
            "axis": self.axis,
            "seq": self.seq,
            "members": self.members,
            "waiting": self.waiting,
            "missing": self.missing,
            "no_dump": self.no_dump,
        }


def _plural(ranks: list[int]) -> str:
    return "rank" if len(ranks) == 1 else "ranks"


def _ranks(ranks: list[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


def _groups_of(dump: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
    """This rank's groups: name -> (description, member ranks), from its ``pg_config``. The
    same name may stand for different groups on different ranks (``split_group`` names every
    split alike: the shard group of ranks 0,1 and the one of ranks 2,3), so a group is its
    name with its members."""
    groups: dict[str, tuple[str, tuple[int, ...]]] = {}
    config = dump.get("pg_config")
    if not isinstance(config, dict):
        return groups
    for name, info in config.items():
        if not isinstance(info, dict):
            continue
        members = _members(info.get("ranks"))
        if members is None:
            continue
        groups[str(name)] = (str(info.get("desc", "")), members)
    return groups


_RANK_LIST = re.compile(r"^\[\s*(\d{1,9}\s*(,\s*\d{1,9}\s*)*)?\]$")


def _members(ranks: object) -> tuple[int, ...] | None:
    """A group's member ranks, as torch writes them (``"[0, 1]"``, or a list of ints); None
    for anything else (read by a pattern, never evaluated)."""
    if isinstance(ranks, str):
        if len(ranks) > 1 << 24 or not _RANK_LIST.match(ranks):
            return None
        inside = ranks.strip()[1:-1].strip()
        return tuple(sorted(int(r) for r in inside.split(","))) if inside else ()
    if isinstance(ranks, (list, tuple)) and all(_rank_number(r) for r in ranks):
        return tuple(sorted(ranks))
    return None


def _rank_number(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 30


def _entries(dump: dict) -> list[dict]:
    """The collectives of a dump, those whose fields :func:`find_hang` compares are of torch's
    types: an integer sequence number and a finite creation time (a dump of other types is no
    answer, never a traceback)."""
    entries = dump.get("entries") or []
    return [e for e in entries if isinstance(e, dict) and not e.get("is_p2p") and _comparable(e)]


def _comparable(entry: dict) -> bool:
    seq, created = entry.get("collective_seq_id"), entry.get("time_created_ns", 0)
    return (
        isinstance(seq, int)
        and not isinstance(seq, bool)
        and -1 <= seq < 1 << 62
        and isinstance(created, (int, float))
        and not isinstance(created, bool)
        and math.isfinite(created)
        and abs(created) < 1 << 62
    )


def _sequence_number(entry: dict | None) -> int | None:
    return None if entry is None else int(entry["collective_seq_id"])


def _group_of(entry: dict) -> str | None:
    group = entry.get("process_group")
    if isinstance(group, (list, tuple)) and group:
        return str(group[0])
    return None


def _axis(desc: str) -> str:
    return desc[len("mesh_") :] if desc.startswith("mesh_") else desc or "unnamed"


def find_hang(dumps: dict[int, dict]) -> HungCollective | None:
    """The collective the job hung in (see the module docstring), or None when every group's
    newest collective was entered by all members that dumped and completed on all of them."""
    groups: dict[tuple[str, tuple[int, ...]], str] = {}
    newest: dict[tuple[str, tuple[int, ...]], dict[int, dict | None]] = {}
    for rank, dump in dumps.items():
        mine = _groups_of(dump)
        for name, (desc, members) in mine.items():
            if rank in members:
                groups.setdefault((name, members), desc)
                newest.setdefault((name, members), {})[rank] = None
        for entry in _entries(dump):
            group = _group_of(entry)
            if group is None or group not in mine:
                continue
            key = (group, mine[group][1])
            if rank not in key[1]:
                continue
            held = newest[key].get(rank)
            if held is None or entry["collective_seq_id"] > held["collective_seq_id"]:
                newest[key][rank] = entry
    candidates = []
    for key, desc in groups.items():
        name, members = key
        seen = newest[key]
        seqs = [e["collective_seq_id"] for e in seen.values() if e is not None]
        if not seqs:
            continue
        top = max(seqs)
        at_top = {r: e for r, e in seen.items() if e is not None and e["collective_seq_id"] == top}
        waiting = sorted(r for r, e in at_top.items() if e.get("state") != "completed")
        missing = sorted(r for r in seen if r not in at_top)
        if not waiting and not missing:
            continue
        sample = next(iter(at_top.values()))
        created = min((at_top[r].get("time_created_ns", 0) for r in waiting), default=float("inf"))
        found = HungCollective(
            op=str(sample.get("profiling_name", "?")).split(":", 1)[-1],
            group=name,
            axis=_axis(desc),
            seq=int(top),
            members=list(members),
            waiting=waiting,
            missing=missing,
            last_entered={r: _sequence_number(seen[r]) for r in missing},
            no_dump=sorted(r for r in members if r not in dumps),
        )
        # ranks waiting while others never came (or left no dump): the hang; of several, the wait that began first
        candidates.append(((not (waiting and (missing or found.no_dump)), created), found))
    if not candidates:
        return None
    candidates.sort(key=lambda c: c[0])
    return candidates[0][1]


def hang_words(run_dir: str | Path) -> str | None:
    """The run's flight-recorder finding in one line (None: no dumps, or nothing hung in them)."""
    dumps, notes = read_dumps(run_dir)
    if not dumps:
        return None
    found = find_hang(dumps)
    if found is None:
        return "NCCL flight recorder: every rank's last collective completed" + (
            f" ({'; '.join(notes)})" if notes else ""
        )
    return found.words()


HANG_SECTION: StatusSection[RunView, str | None] = StatusSection(
    name="hang",
    read=lambda view: hang_words(view.run_dir),
    lines=lambda hang: [f"last hang: {hang}"] if hang else [],
    fields=lambda hang: {"hang": hang},
)
