"""Token files and datasets: the format ``prepare-data`` writes and the training loop reads.

A token file is ``NAME.bin``, a flat little-endian array of token ids (``uint16`` when
the vocabulary has at most 65536 ids, else ``uint32``: the nanoGPT/Megatron layout), with
a sidecar ``NAME.json``::

    {"format": "hpc-hsdp-tokens", "version": 1, "dtype": "uint16", "vocab_size": 2048,
     "num_tokens": 123456, "num_documents": 789, "eos_id": 2047, "max_token_id": 2047,
     "tokenizer": {...}, "document_index": "NAME.idx", "sha256": "<hex digest of NAME.bin>"}

``NAME.idx`` (optional) holds ``num_documents + 1`` little-endian uint64 offsets: document
``d`` is tokens ``[idx[d], idx[d+1])`` of the file, its end-of-document token included.

A dataset directory (what ``hpc-hsdp prepare-data -o DIR`` writes) has ``DIR/dataset.json``::

    {"format": "hpc-hsdp-dataset", "version": 1, "vocab_size": 2048, "dtype": "uint16",
     "tokenizer": {...}, "splits": {"train": ["train/00000.bin", ...], "val": [...]}}

plus the shards under ``DIR/train`` and ``DIR/val`` and the tokenizer under ``DIR/tokenizer``.

Reading never loads a file: :class:`TokenDataset` memory-maps every shard and
:meth:`TokenDataset.read` returns tokens ``[start, start + length)`` of the shards'
concatenation. ``sha256`` (written since ``--stage-data``; optional when read) is what a
node-local copy is verified against (:mod:`hpc_hsdp.data.staging_copies`). Everything a user can get wrong raises :class:`DataError` (one line that
ends with the fix) when the dataset is opened, before any training step.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np

from hpc_hsdp.data.sampler import num_samples
from hpc_hsdp.errors import DataError, DataNotFound
from hpc_hsdp.files import read_json, write_atomically

TOKEN_FORMAT = "hpc-hsdp-tokens"
DATASET_FORMAT = "hpc-hsdp-dataset"
FORMAT_VERSION = 1
DATASET_MANIFEST = "dataset.json"
TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
INDEX_DTYPE = np.dtype("<u8")
UINT16_VOCAB_LIMIT = 1 << 16
_REQUIRED_SIDECAR_KEYS = ("dtype", "vocab_size", "num_tokens", "num_documents", "max_token_id")
_PREPARE_HINT = "prepare the data again with `hpc-hsdp prepare-data`"
READ_LATENCY = "HPC_HSDP_FAULT_READ_LATENCY"
"""Test hook (listed with the others in :mod:`hpc_hsdp.task.resilience.injected_faults`):
``<seconds>@<directory>``: every read of a token file under that directory (a row the loader
reads, a chunk a ``--stage-data`` copy reads) first waits that long, as a round trip to a
loaded shared file system would."""


def read_latency_of(path: str | os.PathLike, env: dict[str, str] | None = None) -> float:
    """The seconds :data:`READ_LATENCY` adds to each read of ``path`` (0: none)."""
    value = (os.environ if env is None else env).get(READ_LATENCY, "")
    if not value:
        return 0.0
    seconds, _, directory = value.partition("@")
    try:
        latency = float(seconds)
    except ValueError:
        raise DataError(f"{READ_LATENCY}={value!r} is not SECONDS@DIRECTORY, e.g. 0.002@/shared/data") from None
    inside = Path(os.path.abspath(path)).is_relative_to(os.path.abspath(directory or "/"))
    return latency if inside else 0.0


def token_dtype_for(vocab_size: int) -> str:
    """The smallest token dtype that holds every id of a ``vocab_size`` vocabulary."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= UINT16_VOCAB_LIMIT else "uint32"


# ---------------------------------------------------------------------------- one token file


@dataclass(frozen=True, kw_only=True)
class TokenFile:
    """One ``.bin`` file, its sidecar checked against it."""

    path: Path
    """The ``.bin`` file."""
    dtype: str
    vocab_size: int
    num_tokens: int
    num_documents: int
    eos_id: int | None
    max_token_id: int
    tokenizer: dict[str, Any]
    document_index: Path | None
    """The ``.idx`` file of document offsets, when the sidecar names one."""
    sha256: str | None = None
    """The hex SHA-256 of the ``.bin`` file as written (None: a sidecar written before they were recorded)."""

    @property
    def sidecar(self) -> Path:
        return sidecar_path(self.path)

    def document_offsets(self) -> np.ndarray:
        """``num_documents + 1`` offsets (int64): document ``d`` is ``[off[d], off[d+1])``."""
        if self.document_index is None:
            raise DataError(f"{self.sidecar} names no document index; {_PREPARE_HINT} to record document boundaries")
        return np.fromfile(self.document_index, dtype=INDEX_DTYPE).astype(np.int64)


def sidecar_path(bin_path: str | os.PathLike) -> Path:
    return Path(bin_path).with_suffix(".json")


MAX_SIDECAR_BYTES = 64 << 20
"""The most a token sidecar or dataset manifest may hold (its tokenizer's description included)."""


def _load_json(path: Path, what: str) -> dict[str, Any]:
    """A sidecar or manifest, read as data that may be hostile (:func:`~hpc_hsdp.files.read_json`:
    a regular file, at most :data:`MAX_SIDECAR_BYTES`, not nested past Python's stack, numbers in
    range); a symlinked one is read where it leads (datasets are linked into place)."""
    try:
        data = read_json(path.resolve(), max_bytes=MAX_SIDECAR_BYTES)
    except OSError as exc:
        raise DataError(f"cannot read {what} {path} ({exc.strerror}); check that it exists and is readable") from None
    except ValueError as exc:
        raise DataError(f"{what} {path} is not valid JSON ({exc}); {_PREPARE_HINT}") from None
    if not isinstance(data, dict):
        raise DataError(f"{what} {path} holds a JSON {type(data).__name__}, not an object; {_PREPARE_HINT}")
    return data


def _check_format(data: dict[str, Any], path: Path, expected: str) -> None:
    if data.get("format") != expected:
        raise DataError(
            f"{path} has format {data.get('format')!r}, not {expected!r}: it is not an hpc-hsdp "
            f"{'token sidecar' if expected == TOKEN_FORMAT else 'dataset manifest'}; {_PREPARE_HINT}"
        )
    version = data.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise DataError(
            f"{path} has format version {version!r}; this hpc-hsdp reads version {FORMAT_VERSION}: "
            f"upgrade hpc-hsdp or {_PREPARE_HINT}"
        )


@overload
def _int_field(
    data: dict[str, Any], key: str, path: Path, *, minimum: int = 0, optional: Literal[False] = False
) -> int: ...
@overload
def _int_field(
    data: dict[str, Any], key: str, path: Path, *, minimum: int = 0, optional: Literal[True]
) -> int | None: ...
def _int_field(data: dict[str, Any], key: str, path: Path, *, minimum: int = 0, optional: bool = False) -> int | None:
    value = data.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DataError(f"{path}: {key} is {value!r}, expected an integer >= {minimum}; {_PREPARE_HINT}")
    return value


def read_token_file(bin_path: str | os.PathLike) -> TokenFile:
    """Check a ``.bin`` file against its sidecar (nothing is read but the sidecar and sizes)."""
    bin_path = Path(bin_path)
    side = sidecar_path(bin_path)
    if not bin_path.is_file():
        raise DataNotFound(f"token file {bin_path} does not exist; check the path, or {_PREPARE_HINT}")
    if not side.is_file():
        raise DataError(
            f"token file {bin_path} has no sidecar {side.name} beside it (dtype, vocabulary, tokenizer); "
            f"write the data with `hpc-hsdp prepare-data`, or write the sidecar as "
            f"hpc_hsdp.data.tokens.write_token_file does"
        )
    meta = _load_json(side, "token sidecar")
    _check_format(meta, side, TOKEN_FORMAT)
    missing = [key for key in _REQUIRED_SIDECAR_KEYS if key not in meta]
    if missing:
        raise DataError(f"{side} lacks {', '.join(missing)}; {_PREPARE_HINT}")
    dtype = meta["dtype"]
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"{side}: dtype {dtype!r} is not one of {', '.join(TOKEN_DTYPES)}; {_PREPARE_HINT}")
    vocab_size = _int_field(meta, "vocab_size", side, minimum=1)
    num_tokens = _int_field(meta, "num_tokens", side)
    num_documents = _int_field(meta, "num_documents", side)
    max_token_id = _int_field(meta, "max_token_id", side)
    eos_id = _int_field(meta, "eos_id", side, optional=True)
    if dtype == "uint16" and vocab_size > UINT16_VOCAB_LIMIT:
        raise DataError(
            f"{side}: dtype uint16 cannot hold the ids of vocab_size {vocab_size} (> 65536); the sidecar "
            f"disagrees with the data: {_PREPARE_HINT}"
        )
    itemsize = TOKEN_DTYPES[dtype].itemsize
    size = bin_path.stat().st_size
    if size == 0 or num_tokens == 0:
        raise DataError(
            f"token file {bin_path} is empty ({size} bytes, num_tokens {num_tokens}); prepare it from "
            f"input that holds text"
        )
    if size % itemsize:
        raise DataError(
            f"token file {bin_path} is {size} bytes, not a whole number of {dtype} tokens ({itemsize} "
            f"bytes each): it is truncated or not a token file; {_PREPARE_HINT}"
        )
    if size // itemsize != num_tokens:
        raise DataError(
            f"token file {bin_path} holds {size // itemsize} {dtype} tokens but its sidecar says "
            f"num_tokens {num_tokens}: file and sidecar disagree (a truncated copy, or the sidecar of "
            f"another file); {_PREPARE_HINT}"
        )
    if max_token_id >= vocab_size:
        raise DataError(
            f"{side}: max_token_id {max_token_id} >= vocab_size {vocab_size}; the sidecar contradicts "
            f"itself: {_PREPARE_HINT}"
        )
    if eos_id is not None and eos_id >= vocab_size:
        raise DataError(f"{side}: eos_id {eos_id} >= vocab_size {vocab_size}; {_PREPARE_HINT}")
    tokenizer = meta.get("tokenizer") or {}
    if not isinstance(tokenizer, dict):
        raise DataError(f"{side}: tokenizer must be a JSON object, got {type(tokenizer).__name__}; {_PREPARE_HINT}")
    sha256 = meta.get("sha256")
    if sha256 is not None and not (isinstance(sha256, str) and re.fullmatch("[0-9a-f]{64}", sha256)):
        raise DataError(f"{side}: sha256 {str(sha256)[:80]!r} is not a hex SHA-256 digest; {_PREPARE_HINT}")
    index = None
    if meta.get("document_index"):
        name = meta["document_index"]
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise DataError(
                f"{side}: document_index {str(name)[:80]!r} is not a file name beside the token file; {_PREPARE_HINT}"
            )
        index = bin_path.parent / name
        expected = (num_documents + 1) * INDEX_DTYPE.itemsize
        actual = index.stat().st_size if index.is_file() else None
        if actual != expected:
            found = "is missing" if actual is None else f"is {actual} bytes"
            raise DataError(
                f"document index {index} {found}, expected {expected} bytes for {num_documents} "
                f"documents; {_PREPARE_HINT}"
            )
    return TokenFile(
        path=bin_path,
        dtype=dtype,
        vocab_size=vocab_size,
        num_tokens=num_tokens,
        num_documents=num_documents,
        eos_id=eos_id,
        max_token_id=max_token_id,
        tokenizer=tokenizer,
        document_index=index,
        sha256=sha256,
    )


# ---------------------------------------------------------------------------- a dataset (split)


class TokenDataset:
    """The concatenation of one split's shards, memory-mapped.

    ``read(start, length)`` returns tokens ``[start, start + length)`` as a read-only numpy
    array of :attr:`dtype` (a view of the map when the range lies in one shard). Maps are
    opened on first read and dropped on pickling, so a dataset is cheap to hand to a
    background thread or process.
    """

    def __init__(
        self,
        *,
        path: str,
        split: str,
        files: Sequence[TokenFile],
        tokenizer: dict[str, Any] | None = None,
        tokenizer_base: Path | None = None,
    ):
        if not files:
            raise DataError(f"{path}: the {split!r} split has no token files; {_PREPARE_HINT}")
        first = files[0]
        for other in files[1:]:
            for key in ("dtype", "vocab_size", "eos_id"):
                if getattr(other, key) != getattr(first, key):
                    raise DataError(
                        f"{path}: shards disagree on {key} ({first.path.name}: {getattr(first, key)!r}, "
                        f"{other.path.name}: {getattr(other, key)!r}); shards of one dataset come from "
                        f"one tokenizer: {_PREPARE_HINT}"
                    )
        self.path = path
        self.split = split
        self.files = tuple(files)
        self.dtype: np.dtype = TOKEN_DTYPES[first.dtype]
        self.vocab_size: int = first.vocab_size
        self.eos_id: int | None = first.eos_id
        self.tokenizer: dict[str, Any] = dict(tokenizer if tokenizer is not None else first.tokenizer)
        self.tokenizer_base: Path = tokenizer_base if tokenizer_base is not None else first.path.parent
        """The directory that a relative ``tokenizer["path"]`` is relative to."""
        self.max_token_id: int = max(f.max_token_id for f in files)
        self.num_documents: int = sum(f.num_documents for f in files)
        self._ends: list[int] = np.cumsum([f.num_tokens for f in files]).tolist()
        self.num_tokens: int = self._ends[-1]
        self._maps: list[np.ndarray] | None = None
        self._latency: list[float] = [read_latency_of(f.path) for f in self.files]

    def __repr__(self) -> str:
        return (
            f"TokenDataset({self.path!r}, split={self.split!r}, num_tokens={self.num_tokens}, "
            f"shards={len(self.files)}, dtype={self.dtype.name}, vocab_size={self.vocab_size})"
        )

    def __len__(self) -> int:
        return self.num_tokens

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None}

    def read_from(self, copies: Mapping[str, str | os.PathLike]) -> None:
        """Read the shards named in ``copies`` (a shard's path -> a byte-identical copy of it,
        :mod:`hpc_hsdp.data.staging_copies`) from the copies from now on: the same shards in the same
        order, so the same tokens at every position; the others stay where they are."""
        self.files = tuple(
            dataclasses.replace(f, path=Path(copies[str(f.path)])) if str(f.path) in copies else f for f in self.files
        )
        self._maps = None
        self._latency = [read_latency_of(f.path) for f in self.files]

    def _shard_maps(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [np.memmap(f.path, dtype=self.dtype, mode="r", shape=(f.num_tokens,)) for f in self.files]
        return self._maps

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of the concatenated shards."""
        start, length = int(start), int(length)
        if start < 0 or length < 0 or start + length > self.num_tokens:
            raise IndexError(f"read({start}, {length}) outside the {self.num_tokens} tokens of {self.path}")
        maps = self._shard_maps()
        shard = bisect.bisect_right(self._ends, start)
        pieces = []
        while length > 0:
            begin = self._ends[shard - 1] if shard else 0
            offset = start - begin
            take = min(length, self._ends[shard] - start)
            if self._latency[shard]:
                time.sleep(self._latency[shard])
            piece = maps[shard][offset : offset + take]
            self._check_ids(piece, shard, offset)
            pieces.append(piece)
            start, length, shard = start + take, length - take, shard + 1
        if not pieces:
            return np.empty(0, dtype=self.dtype)
        return np.asarray(pieces[0]) if len(pieces) == 1 else np.concatenate(pieces)

    def _check_ids(self, piece: np.ndarray, shard: int, offset: int) -> None:
        """Every id read is at most the ``max_token_id`` its sidecar records (which the checks
        before step 1 hold against the model's vocabulary): a sidecar that understates its data
        stops the run with the file and the id, not an IndexError inside the model."""
        if not piece.size:
            return
        high = int(piece.max())
        limit = self.files[shard].max_token_id
        if high > limit:
            at = offset + int(np.argmax(piece > limit))
            raise DataError(
                f"token file {self.files[shard].path} holds token id {high} (token {at}), above the max_token_id "
                f"{limit} its sidecar records: file and sidecar disagree; {_PREPARE_HINT}"
            )

    def document_offsets(self) -> np.ndarray:
        """``num_documents + 1`` offsets into the concatenation (int64)."""
        offsets, base = [np.zeros(1, dtype=np.int64)], 0
        for f in self.files:
            offsets.append(f.document_offsets()[1:] + base)
            base += f.num_tokens
        return np.concatenate(offsets)


def open_dataset(path: str | os.PathLike, split: str = "train") -> TokenDataset:
    """Open token data: a dataset directory (its ``split``), a directory of ``.bin`` shards,
    or one ``.bin`` file (its ``.json`` sidecar beside it; ``split`` names only what it is
    used for then: the caller named the file). Raises :class:`DataError`."""
    given = str(path)
    path = Path(path)
    if path.is_file() and path.name == DATASET_MANIFEST:
        path = path.parent
    elif path.is_file() and path.suffix == ".json" and path.with_suffix(".bin").is_file():
        path = path.with_suffix(".bin")
    if not path.exists():
        raise DataNotFound(
            f"token data {given} does not exist; give a directory written by `hpc-hsdp prepare-data` "
            f"or a .bin token file"
        )
    if path.is_file():
        if path.suffix != ".bin":
            raise DataError(
                f"token data {given} is neither a .bin token file nor a dataset directory; give a "
                f"directory written by `hpc-hsdp prepare-data` or a .bin file with its .json sidecar"
            )
        return TokenDataset(path=given, split=split, files=[read_token_file(path)])
    manifest = path / DATASET_MANIFEST
    if manifest.is_file():
        return _open_manifest(given, path, manifest, split)
    shards = sorted(path.glob("*.bin"))
    if shards:
        return TokenDataset(path=given, split=split, files=[read_token_file(p) for p in shards])
    hint = " (an unfinished prepare-data run?)" if ".tmp-" in path.name else ""
    raise DataError(
        f"token data {given} is a directory with neither {DATASET_MANIFEST} nor .bin files{hint}; give "
        f"a directory written by `hpc-hsdp prepare-data` or a .bin token file"
    )


def _open_manifest(given: str, root: Path, manifest: Path, split: str) -> TokenDataset:
    data = _load_json(manifest, "dataset manifest")
    _check_format(data, manifest, DATASET_FORMAT)
    splits = data.get("splits")
    if not isinstance(splits, dict) or not all(isinstance(v, list) for v in splits.values()):
        raise DataError(f"{manifest}: 'splits' must map split names to lists of .bin paths; {_PREPARE_HINT}")
    if not splits.get(split):
        have = ", ".join(sorted(name for name, files in splits.items() if files)) or "none"
        fix = "prepare it with --val-fraction (e.g. 0.01), or give --val-data" if split == "val" else _PREPARE_HINT
        raise DataError(f"dataset {given} has no {split!r} split (it has: {have}); {fix}")
    files = []
    for relative in splits[split]:
        bin_path = (root / str(relative)).resolve()
        if root.resolve() not in bin_path.parents:
            raise DataError(f"{manifest}: shard {relative!r} lies outside the dataset directory; {_PREPARE_HINT}")
        files.append(read_token_file(bin_path))
    for key in ("dtype", "vocab_size"):
        if key in data and data[key] != getattr(files[0], key):
            raise DataError(
                f"{manifest} says {key} {data[key]!r} but shard {files[0].path.name} says "
                f"{getattr(files[0], key)!r}: manifest and shards disagree; {_PREPARE_HINT}"
            )
    tokenizer = data.get("tokenizer")
    if not isinstance(tokenizer, dict):
        return TokenDataset(path=given, split=split, files=files)
    return TokenDataset(path=given, split=split, files=files, tokenizer=tokenizer, tokenizer_base=root)


def check_for_training(ds: TokenDataset, *, model_vocab_size: int | None, seq_len: int, global_batch: int) -> None:
    """Before step 1: every token id fits the model's embedding, and one global batch of
    samples (``seq_len + 1`` tokens each, overlapping by one) exists. Raises :class:`DataError`.
    ``model_vocab_size`` None: not known yet (before submitting); only the size is checked."""
    what = f"token data {ds.path}" + (f" ({ds.split} split)" if ds.split != "train" else "")
    if model_vocab_size is not None and ds.max_token_id >= model_vocab_size:
        raise DataError(
            f"{what} holds token id {ds.max_token_id} but the model's vocabulary has {model_vocab_size} "
            f"ids (0..{model_vocab_size - 1}); use a model with at least {ds.max_token_id + 1} ids, or "
            f"prepare the data with the model's tokenizer"
        )
    samples = num_samples(ds.num_tokens, seq_len)
    if samples < global_batch:
        need = global_batch * seq_len + 1
        raise DataError(
            f"{what} has {ds.num_tokens} tokens: {samples} samples of --seq-len {seq_len}, fewer than one "
            f"global batch of {global_batch} (needs {need} tokens); use more data, a smaller --seq-len, "
            f"or a smaller batch"
        )


def check_token_data(
    train: TokenDataset | None,
    *,
    val: TokenDataset | None = None,
    model_vocab_size: int | None,
    seq_len: int,
    global_batch: int,
) -> None:
    """The one check of a job's token data, before submitting (``submit_host/preflight.py``) and on the
    tasks before step 1 (``task/training/run_data.py``): the sidecars were read and checked when the
    datasets opened (types, ranges, each ``.bin``'s size against its dtype and token count);
    here the largest token id against the model's vocabulary and the samples against the
    batch. Every id read later is held to its sidecar's ``max_token_id`` (:meth:`TokenDataset.read`)."""
    if train is not None:
        check_for_training(train, model_vocab_size=model_vocab_size, seq_len=seq_len, global_batch=global_batch)
    if val is not None:
        check_for_eval(val, model_vocab_size=model_vocab_size, seq_len=seq_len)


def check_for_eval(ds: TokenDataset, *, model_vocab_size: int | None, seq_len: int) -> None:
    """Before step 1: the held-out data's token ids fit the model's embedding and it holds
    at least one sample. Raises :class:`DataError`; ``model_vocab_size`` as above."""
    if model_vocab_size is not None and ds.max_token_id is not None and ds.max_token_id >= model_vocab_size:
        raise DataError(
            f"the held-out data has token id {ds.max_token_id}, not below the model's vocabulary "
            f"of {model_vocab_size}; prepare it with the training data's tokenizer"
        )
    if num_samples(ds.num_tokens, seq_len) < 1:
        raise DataError(f"the held-out data ({ds.num_tokens} tokens) holds no sample of --seq-len {seq_len} + 1 tokens")


def open_eval_dataset(data: str | os.PathLike, val_data: str | os.PathLike | None = None) -> TokenDataset:
    """The held-out data for evaluation: ``val_data`` when given (a dataset directory's
    ``val`` split, a shard directory or a .bin file), else the ``val`` split of the
    ``data`` directory. A single training ``.bin`` has no held-out part: DataError."""
    if val_data is not None:
        return open_dataset(val_data, split="val")
    if Path(data).is_file():
        raise DataError(
            f"--data {data} is one token file with no held-out split; give --val-data, or prepare a "
            f"dataset directory with --val-fraction"
        )
    return open_dataset(data, split="val")


# ---------------------------------------------------------------------------- writing


class TokenFileWriter:
    """Append token chunks to ``NAME.bin`` and document offsets to ``NAME.idx``; ``close()``
    renames both into place and writes the sidecar last, so a token file with a sidecar
    is always complete. Used by ``prepare-data`` (one writer per shard) and by tests."""

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        vocab_size: int,
        tokenizer: dict[str, Any] | None = None,
        eos_id: int | None = None,
        dtype: str | None = None,
        extra: dict[str, Any] | None = None,
    ):
        self.path = Path(path)
        if self.path.suffix != ".bin":
            raise ValueError(f"a token file is named NAME.bin, got {self.path}")
        self.vocab_size = vocab_size
        self.dtype = dtype or token_dtype_for(vocab_size)
        if self.dtype not in TOKEN_DTYPES:
            raise ValueError(f"dtype must be one of {list(TOKEN_DTYPES)}, got {self.dtype!r}")
        if self.dtype == "uint16" and vocab_size > UINT16_VOCAB_LIMIT:
            raise ValueError(f"uint16 cannot hold the ids of a {vocab_size}-id vocabulary")
        self.tokenizer = dict(tokenizer or {})
        self.eos_id = eos_id
        self.extra = dict(extra or {})
        self.num_tokens = 0
        self.num_documents = 0
        self.max_token_id = -1
        self._last_end = 0
        suffix = f".tmp-{os.getpid()}-{os.urandom(3).hex()}"
        self._bin_tmp = self.path.with_name(self.path.name + suffix)
        self._idx_tmp = self.path.with_name(self.path.with_suffix(".idx").name + suffix)
        self._bin = open(self._bin_tmp, "wb")
        self._idx = open(self._idx_tmp, "wb")
        self._idx.write(np.zeros(1, dtype=INDEX_DTYPE).tobytes())
        self._digest = hashlib.sha256()
        self._closed = False

    def append(self, tokens: np.ndarray, document_lengths: Iterable[int], *, continues: bool = False) -> None:
        """Append a chunk of documents: ``tokens`` is their concatenation (end-of-document
        tokens included), ``document_lengths`` the tokens of each document that ends in this
        chunk (the first may have begun in an earlier chunk). With ``continues``, the tokens
        after the last of them begin a document that a later chunk (or ``close``) ends."""
        tokens = np.asarray(tokens)
        lengths = np.asarray(
            list(document_lengths) if not isinstance(document_lengths, np.ndarray) else document_lengths, dtype=np.int64
        )
        covered = int(lengths.sum())
        if (lengths < 0).any() or covered > tokens.size or (covered != tokens.size and not continues):
            raise ValueError(
                f"document lengths sum to {covered}, not to the {tokens.size} tokens given "
                f"(pass continues=True for a document that goes on)"
            )
        if tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high >= self.vocab_size:
                raise ValueError(
                    f"token id {high if high >= self.vocab_size else low} outside the vocabulary "
                    f"0..{self.vocab_size - 1}"
                )
            self.max_token_id = max(self.max_token_id, high)
            data = tokens.astype(TOKEN_DTYPES[self.dtype], copy=False).tobytes()
            self._bin.write(data)
            self._digest.update(data)
        if lengths.size:
            ends = self.num_tokens + np.cumsum(lengths)
            self._idx.write(ends.astype(INDEX_DTYPE).tobytes())
            self._last_end = int(ends[-1])
            self.num_documents += lengths.size
        self.num_tokens += tokens.size

    @property
    def in_document(self) -> bool:
        """A document has begun and not ended yet (see ``continues``)."""
        return self.num_tokens > self._last_end

    def close(self) -> TokenFile:
        """Finish the file: data renamed into place, sidecar written last (atomically)."""
        if self._closed:
            raise ValueError(f"{self.path} is already closed")
        self._closed = True
        if self.in_document:
            self._idx.write(np.array([self.num_tokens], dtype=INDEX_DTYPE).tobytes())
            self._last_end = self.num_tokens
            self.num_documents += 1
        for f in (self._bin, self._idx):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        index = self.path.with_suffix(".idx")
        os.replace(self._bin_tmp, self.path)
        os.replace(self._idx_tmp, index)
        sidecar = {
            "format": TOKEN_FORMAT,
            "version": FORMAT_VERSION,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "eos_id": self.eos_id,
            "max_token_id": max(self.max_token_id, 0),
            "tokenizer": self.tokenizer,
            "document_index": index.name,
            "sha256": self._digest.hexdigest(),
            **self.extra,
        }
        write_atomically(sidecar_path(self.path), json.dumps(sidecar, indent=1) + "\n", durable=True)
        return TokenFile(
            path=self.path,
            dtype=self.dtype,
            vocab_size=self.vocab_size,
            num_tokens=self.num_tokens,
            num_documents=self.num_documents,
            eos_id=self.eos_id,
            max_token_id=sidecar["max_token_id"],
            tokenizer=self.tokenizer,
            document_index=index,
            sha256=sidecar["sha256"],
        )

    def abort(self) -> None:
        """Drop everything written; nothing is left behind."""
        if self._closed:
            return
        self._closed = True
        for f, tmp in ((self._bin, self._bin_tmp), (self._idx, self._idx_tmp)):
            f.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_token_file(
    path: str | os.PathLike,
    tokens: Sequence[int] | np.ndarray,
    *,
    vocab_size: int,
    tokenizer: dict[str, Any] | None = None,
    eos_id: int | None = None,
    document_lengths: Sequence[int] | np.ndarray | None = None,
    dtype: str | None = None,
) -> TokenFile:
    """Write ``tokens`` as ``path`` (``NAME.bin`` + ``NAME.idx`` + ``NAME.json``), atomically.

    Documents: ``document_lengths`` when given; else, with an ``eos_id``, each document
    ends at an end-of-document token (a trailing piece without one is the last document);
    else the whole file is one document.
    """
    tokens = np.asarray(tokens)
    if document_lengths is None:
        if eos_id is not None and tokens.size:
            ends = np.flatnonzero(tokens == eos_id) + 1
            if not ends.size or ends[-1] != tokens.size:
                ends = np.append(ends, tokens.size)
            document_lengths = np.diff(ends, prepend=0)
        else:
            document_lengths = [tokens.size] if tokens.size else []
    writer = TokenFileWriter(path, vocab_size=vocab_size, tokenizer=tokenizer, eos_id=eos_id, dtype=dtype)
    try:
        writer.append(tokens, document_lengths)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def write_dataset_manifest(
    root: str | os.PathLike,
    *,
    vocab_size: int,
    dtype: str,
    tokenizer: dict[str, Any],
    splits: dict[str, list[str]],
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write ``root/dataset.json`` (atomically) naming each split's shards, relative to ``root``."""
    manifest = Path(root) / DATASET_MANIFEST
    data = {
        "format": DATASET_FORMAT,
        "version": FORMAT_VERSION,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "tokenizer": tokenizer,
        "splits": splits,
        **(extra or {}),
    }
    write_atomically(manifest, json.dumps(data, indent=1) + "\n", durable=True)
    return manifest
