"""Checkpoints in object storage (``--checkpoint-store s3://BUCKET/PREFIX``): the store's layout,
the rules of a commit, of retention and of the choice on resume (pure), and the store itself
through fsspec (s3fs for ``s3://``). No torch.

Under ``BUCKET/PREFIX`` each step has a folder named as in ``RUN_DIR/checkpoints``:
``step-000010/`` with DCP's files, ``train_state.json``, ``uploaded/rank-00003.json`` (one per
rank: the files that rank uploaded with their sizes and CRC-32s, written after them),
``manifest.json`` (the local manifest: every DCP file's size and CRC-32) and ``COMPLETE``. Rank 0
writes the manifest and then ``COMPLETE`` only when every rank's marker is there and the markers
name every file of the manifest with its size and CRC-32 (:func:`missing_uploads`): a step with
``COMPLETE`` is committed, one without it is never read. The endpoint, keys and region come from
the standard AWS variables and files (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_PROFILE``, ...), read by botocore on each machine; nothing here writes them anywhere.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import parse_json
from hpc_hsdp.rundir.checkpointing.state import (
    COMPLETE,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    TRAIN_STATE,
    manifest_of,
    step_dir_name,
)
from hpc_hsdp.rundir.training.stragglers import rank_ranges

SCHEMES: Mapping[str, str] = {"s3": "s3fs"}
"""URL scheme -> the module of its fsspec implementation (installed by ``hpc-hsdp[s3]``)."""
EXTRA = "s3"
UPLOADED = "uploaded"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_MARKER = re.compile(r"^rank-(\d+)\.json$")
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SEGMENT = re.compile(r"^[A-Za-z0-9._=+,@-]+$")
MAX_MARKER_BYTES = 16 << 20
SETTINGS_HINT = (
    "the endpoint, keys and region come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
    "AWS_DEFAULT_REGION or AWS_PROFILE (and ~/.aws)"
)


class StoreError(RuntimeError):
    """A store operation that failed after its retries (one line, no credentials)."""


# ----------------------------------------------------------------------------- the URL


@dataclass(frozen=True)
class StoreURL:
    """``s3://BUCKET/PREFIX`` taken apart."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def root(self) -> str:
        """The path fsspec is given: ``BUCKET/PREFIX``."""
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket

    def __str__(self) -> str:
        return f"{self.scheme}://{self.root}"


def parse_store_url(text: str) -> StoreURL:
    """``--checkpoint-store``'s value: ``s3://BUCKET`` or ``s3://BUCKET/PREFIX`` (SpecError else:
    another scheme, no bucket, credentials or a port in the URL, a query, ``..``)."""
    flag = f"--checkpoint-store {text!r}"
    scheme, sep, rest = str(text).strip().partition("://")
    if not sep or not scheme:
        raise SpecError(f"{flag} is not a URL: give s3://BUCKET/PREFIX")
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise SpecError(f"{flag}: scheme {scheme}:// is not supported; give s3://BUCKET/PREFIX")
    if any(c in rest for c in "?#") or any(ord(c) < 32 or c.isspace() for c in rest):
        raise SpecError(f"{flag} holds a query, a fragment or white space; give s3://BUCKET/PREFIX")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise SpecError(f"{flag} names no bucket; give s3://BUCKET/PREFIX")
    if "@" in bucket or ":" in bucket:
        raise SpecError(
            f"--checkpoint-store {scheme}://{bucket.rpartition('@')[2]}/...: the URL holds credentials or a port; "
            f"give s3://BUCKET/PREFIX ({SETTINGS_HINT})"
        )
    if not _BUCKET.match(bucket):
        raise SpecError(f"{flag}: {bucket!r} is not a bucket name (letters, digits, '.', '-', '_')")
    segments = [part for part in prefix.split("/") if part]
    if any(part in (".", "..") or not _SEGMENT.match(part) for part in segments):
        raise SpecError(f"{flag}: the prefix may hold letters, digits and ._=+,@- between slashes, no '..'")
    return StoreURL(scheme=scheme, bucket=bucket, prefix="/".join(segments))


def installed(url: StoreURL) -> bool:
    """Whether the fsspec implementation of ``url``'s scheme can be imported here."""
    return importlib.util.find_spec(SCHEMES[url.scheme]) is not None


# ----------------------------------------------------------------------------- rules (pure)


def marker_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def own_files(names: Iterable[str], rank: int) -> list[str]:
    """The DCP files ``rank`` wrote (``__<rank>_<n>.distcp``; rank 0 also ``.metadata``): the ones it uploads."""
    prefix = f"__{rank}_"
    return sorted(n for n in names if n.startswith(prefix) or (rank == 0 and n == ".metadata"))


def missing_uploads(manifest: Mapping, world_size: int, markers: Mapping[int, Mapping]) -> str | None:
    """Why a step may not be committed yet (None: it may): a rank whose marker is not there, a
    file of the manifest that no marker names, or one named with another size or CRC-32."""
    absent = [rank for rank in range(world_size) if rank not in markers]
    if absent:
        return f"rank{'s' if len(absent) > 1 else ''} {rank_ranges(absent)} of {world_size} still uploading"
    uploaded: dict[str, Mapping] = {}
    for files in markers.values():
        uploaded.update(files)
    for name, record in sorted(manifest.get("files", {}).items()):
        if name not in uploaded:
            return f"{name} was uploaded by no rank"
        got = uploaded[name]
        if got.get("bytes") != record.get("bytes") or got.get("crc32") != record.get("crc32"):
            return f"{name} was uploaded with another size or CRC-32 than the manifest's"
    return None


def parse_listing(keys: Iterable[str]) -> tuple[list[int], list[int]]:
    """(committed steps, steps without COMPLETE), each ascending, from the keys under the store's
    root (``step-000010/COMPLETE``, relative to it); keys of other shapes are ignored."""
    seen: set[int] = set()
    committed: set[int] = set()
    for key in keys:
        head, _, rest = key.strip("/").partition("/")
        match = _STEP_DIR.match(head)
        if not match:
            continue
        step = int(match.group(1))
        seen.add(step)
        if rest == COMPLETE:
            committed.add(step)
    return sorted(committed), sorted(seen - committed)


def doomed_steps(committed: list[int], uncommitted: list[int], keep: int) -> list[int]:
    """The store's steps to delete after a commit: the committed ones older than the newest
    ``keep``, and the uncommitted ones older than the newest committed (abandoned: a rank died
    while uploading them). Nothing while none is committed."""
    if not committed:
        return []
    newest = max(committed)
    ordered = sorted(committed)
    old = ordered[: max(0, len(ordered) - max(keep, 1))]
    return sorted(set(old) | {step for step in uncommitted if step < newest})


@dataclass(frozen=True)
class Candidate:
    """A step to resume from: where it is (a local copy that may be used, the store)."""

    step: int
    local: bool
    stored: bool


def resume_candidates(local: Iterable[int], committed: Iterable[int]) -> list[Candidate]:
    """Newest first: every step complete in the run directory or committed in the store."""
    local, committed = set(local), set(committed)
    return [Candidate(step=s, local=s in local, stored=s in committed) for s in sorted(local | committed, reverse=True)]


def backoff_s(attempt: int, *, base: float = 0.5, cap: float = 30.0) -> float:
    """The wait before try ``attempt + 1`` (0-based ``attempt``): doubling from ``base``, at most ``cap``."""
    return min(cap, base * 2**attempt)


def short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:limit]


def retrying(
    action: Callable[[], object],
    *,
    what: str,
    deadline: Callable[[], float | None] = lambda: None,
    on_retry: Callable[[int, BaseException, float], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
):
    """``action()``, tried again after each exception with a growing wait (and a little jitter)
    until it succeeds or the next try would start after ``deadline()`` (a ``time.monotonic()``,
    None: none), then StoreError naming ``what``."""
    attempt = 0
    while True:
        try:
            return action()
        except Exception as exc:  # noqa: BLE001 - any failure of the store is retried
            wait = backoff_s(attempt) * (1 + 0.2 * random.random())
            limit = deadline()
            if limit is not None and time.monotonic() + wait > limit:
                raise StoreError(f"{what}: {short(exc)} (after {attempt + 1} tries)") from None
            attempt += 1
            if on_retry is not None:
                on_retry(attempt, exc, wait)
            sleep(wait)


UNKNOWN_END_WAIT_S = 3600.0
"""How long the final save waits for its upload when the job's end is not known (no SLURM)."""
END_MARGIN_S = 10.0
"""Seconds kept back from the time SLURM leaves (the process must still exit)."""
KILL_WAIT_S = 30.0
"""SLURM's default KillWait: the time from SIGTERM to SIGKILL."""


def wait_limit_s(env, *, now: float, term_at: float | None) -> float:
    """How long the save on the way out may wait for its upload: until SIGKILL follows a SIGTERM
    (``term_at``: when it came), else until the job's end (``SLURM_JOB_END_TIME``), less a margin;
    an hour when neither is known."""
    limits = []
    if term_at is not None:
        limits.append(term_at + KILL_WAIT_S - now)
    end = str(env.get("SLURM_JOB_END_TIME", "")).strip()
    if end.isdigit() and int(end) > 0:
        limits.append(int(end) - now)
    if not limits:
        return UNKNOWN_END_WAIT_S
    return max(0.0, min(limits) - END_MARGIN_S)


# ----------------------------------------------------------------------------- the store


class CheckpointStore:
    """One run's checkpoints under ``BUCKET/PREFIX``, through fsspec."""

    def __init__(self, url: StoreURL, fs) -> None:
        self.url = url
        self.fs = fs

    @classmethod
    def open(cls, text: str | StoreURL, *, quick: bool = False) -> CheckpointStore:
        """The store of a URL; ``quick``: few retries and short timeouts (a check before submitting).
        SpecError when the URL is not one or its extra is not installed."""
        url = text if isinstance(text, StoreURL) else parse_store_url(text)
        if not installed(url):
            raise SpecError(
                f"--checkpoint-store {url}: {SCHEMES[url.scheme]} is not installed in this environment; "
                f"pip install 'hpc-hsdp[{EXTRA}]'"
            )
        import fsspec  # noqa: PLC0415 - only runs with a store import it

        config: dict[str, object] = {"connect_timeout": 5, "read_timeout": 20 if quick else 120}
        config["retries"] = {"max_attempts": 1 if quick else 3, "mode": "standard"}
        fs = fsspec.filesystem(url.scheme, skip_instance_cache=True, use_listings_cache=False, config_kwargs=config)
        if quick and hasattr(fs, "retries"):
            fs.retries = 1  # s3fs's own tries of a call (5), each with botocore's
        return cls(url, fs)

    def path(self, step: int, name: str = "") -> str:
        base = f"{self.url.root}/{step_dir_name(step)}"
        return f"{base}/{name}" if name else base

    def listing(self) -> tuple[list[int], list[int]]:
        """(committed steps, uncommitted steps), ascending."""
        root = self.url.root
        try:
            keys = self.fs.find(root)
        except FileNotFoundError:
            return [], []
        return parse_listing(key[len(root) :] for key in keys if key.startswith(root + "/"))

    def put(self, step: int, directory: Path, names: list[str]) -> None:
        """Upload ``names`` of ``directory`` into the step's folder (concurrently; multipart
        above s3fs's chunk size)."""
        if names:
            self.fs.put([str(directory / n) for n in names], [self.path(step, n) for n in names])

    def get(self, step: int, names: list[str], directory: Path) -> None:
        if names:
            self.fs.get([self.path(step, n) for n in names], [str(directory / n) for n in names])

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        self.fs.pipe_file(self.path(step, name), data)

    def read_json(self, step: int, name: str, *, max_bytes: int) -> object:
        data = self.fs.cat_file(self.path(step, name), start=0, end=max_bytes + 1)
        if len(data) > max_bytes:
            raise ValueError(f"{self.path(step, name)} is larger than {max_bytes:,} bytes")
        return parse_json(data, where=self.path(step, name))

    def manifest(self, step: int) -> dict | None:
        """The step's manifest, checked as a local one (None: missing, unreadable or not one hpc-hsdp wrote)."""
        try:
            return manifest_of(self.read_json(step, MANIFEST, max_bytes=MAX_MANIFEST_BYTES))
        except (OSError, ValueError):
            return None

    def sizes(self, step: int) -> dict[str, int]:
        """Name -> size of the objects directly in the step's folder."""
        base = self.path(step)
        return {
            entry["name"].rsplit("/", 1)[-1]: int(entry.get("size") or 0)
            for entry in self.fs.ls(base, detail=True)
            if entry.get("type") == "file"
        }

    def write_marker(self, step: int, rank: int, files: Mapping[str, Mapping]) -> None:
        self.write_bytes(step, f"{UPLOADED}/{marker_name(rank)}", json.dumps({"files": files}).encode())

    def markers(self, step: int) -> dict[int, dict]:
        """Rank -> the files its marker names (markers that are not JSON objects of records: absent)."""
        try:
            names = self.fs.ls(self.path(step, UPLOADED), detail=False, refresh=True)
        except FileNotFoundError:
            return {}
        found: dict[int, dict] = {}
        for name in names:
            match = _MARKER.match(name.rsplit("/", 1)[-1])
            if not match:
                continue
            try:
                data = self.read_json(step, f"{UPLOADED}/{match.group(0)}", max_bytes=MAX_MARKER_BYTES)
            except (OSError, ValueError):
                continue
            files = data.get("files") if isinstance(data, dict) else None
            if isinstance(files, dict) and all(isinstance(v, dict) for v in files.values()):
                found[int(match.group(1))] = files
        return found

    def commit(self, step: int) -> None:
        self.write_bytes(step, COMPLETE, f"step {step}\n".encode())

    def remove(self, step: int) -> None:
        try:
            self.fs.rm(self.path(step), recursive=True)
        except FileNotFoundError:
            pass

    def check_writable(self) -> None:
        """Write and delete one small object under the prefix (the check before submitting);
        SpecError naming what failed."""
        probe = f"{self.url.root}/.hpc-hsdp-probe-{uuid.uuid4().hex}"
        flag = f"--checkpoint-store {self.url}"
        try:
            self.fs.pipe_file(probe, b"hpc-hsdp write check\n")
            self.fs.rm(probe)
        except FileNotFoundError:
            raise SpecError(f"{flag}: bucket {self.url.bucket!r} does not exist; create it or fix the URL") from None
        except PermissionError as exc:
            raise SpecError(
                f"{flag}: the store refused the write ({short(exc, 120)}); check the credentials ({SETTINGS_HINT}) "
                f"and that they may write to the bucket"
            ) from None
        except Exception as exc:  # noqa: BLE001 - no credentials, no endpoint, a refused connection: one line
            raise SpecError(f"{flag}: the store could not be written ({short(exc, 160)}); {SETTINGS_HINT}") from None


__all__ = [
    "COMPLETE",
    "MANIFEST",
    "TRAIN_STATE",
    "Candidate",
    "CheckpointStore",
    "StoreError",
    "StoreURL",
    "doomed_steps",
    "missing_uploads",
    "parse_listing",
    "parse_store_url",
    "resume_candidates",
    "retrying",
]
