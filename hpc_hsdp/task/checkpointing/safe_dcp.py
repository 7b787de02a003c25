"""Checkpoints are data, not code: DCP's files read without running anything they hold.

torch.distributed.checkpoint keeps its index in ``.metadata``, a pickle that
``FileSystemReader.read_metadata`` loads with a plain ``pickle.load``, and it loads the
non-tensor entries of a state dict (the optimizer's ``param_groups``) with
``torch.load(weights_only=False)`` in ``DefaultLoadPlanner.load_bytes``. A checkpoint from a
shared directory or a colleague would run whatever its pickles reduce to. Here:

- :class:`SafeReader` reads ``.metadata`` with :class:`_MetadataUnpickler`, whose
  ``find_class`` admits only the classes DCP's metadata holds (its dataclasses, ``torch.Size``,
  dtypes, layouts, ``pathlib`` paths); the result must be a ``Metadata`` whose storage entries
  name plain files inside the checkpoint directory;
- :class:`SafePlanner` loads the non-tensor entries with ``torch.load(weights_only=True)``
  (tensors are read that way by DCP already);
- :func:`unsafe_content` checks a checkpoint both ways before it is chosen: the metadata, and
  every non-tensor entry, so that a resume can fall back to the previous checkpoint and
  ``export`` can refuse with one line.

The manifest's CRC-32s catch accidents (a torn copy, a full disk); they are not this defence,
since whoever forges a pickle can forge the manifest too.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from hpc_hsdp.files import UnreadableFile, open_regular
from hpc_hsdp.models.third_party_noise import single_process_load

METADATA = ".metadata"
MAX_METADATA_BYTES = 256 << 20
"""A ``.metadata`` larger than this is refused unread (a big model's is a few MB)."""
MAX_BYTES_ITEM = 16 << 20
"""A non-tensor entry (a learning rate, a list of names) larger than this is refused."""

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},  # a lookup of a torch.layout by its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}
_DATA_FILE = re.compile(r"^[A-Za-z0-9_.-]+$")


class UnsafeCheckpoint(ValueError):
    """A checkpoint file would run code, or names files outside its directory (one line)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch":  # a dtype, layout or memory format is named as torch.<name>
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeCheckpoint(f"{METADATA} names {module}.{name}, which DCP's metadata never holds")


def read_metadata_file(path: str | os.PathLike) -> Metadata:
    """DCP's ``.metadata`` file unpickled with only its own classes admitted; raises
    :class:`UnsafeCheckpoint` (also for a symlink, FIFO or device: never followed, never read;
    OSError when unreadable)."""
    path = Path(path)
    try:
        f = open_regular(path)
    except UnreadableFile:
        raise UnsafeCheckpoint(f"{path.name} is a symlink, FIFO or device, not a file") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_METADATA_BYTES:
            raise UnsafeCheckpoint(f"{path.name} has {size:,} bytes, more than the {MAX_METADATA_BYTES:,} admitted")
        try:
            metadata = _MetadataUnpickler(f).load()
        except UnsafeCheckpoint:
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure: a file that is not DCP's metadata
            raise UnsafeCheckpoint(f"{path.name} is not DCP metadata ({type(exc).__name__})") from None
    _check_metadata(metadata, path.name)
    return metadata


def _check_metadata(metadata: object, name: str) -> None:
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpoint(f"{name} does not hold DCP metadata ({type(metadata).__name__})")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise UnsafeCheckpoint(f"{name} has no storage index")
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise UnsafeCheckpoint(f"{name} has a storage entry of type {type(info).__name__}")
        rel = info.relative_path
        if not isinstance(rel, str) or not _DATA_FILE.match(rel) or rel in (".", ".."):
            raise UnsafeCheckpoint(f"{name} points {index.fqn!r} at {str(rel)[:80]!r}, outside the checkpoint")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)):
            raise UnsafeCheckpoint(f"{name} gives {index.fqn!r} an offset or length that is not a size")


def _load_bytes_item(data: io.BytesIO | bytes):
    """A non-tensor entry: plain data only (``torch.load`` with ``weights_only=True``)."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    return torch.load(stream, map_location="cpu", weights_only=True)


class SafeReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata_file` in place of ``pickle.load``."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata_file(self._get_metadata_path(kwargs.get("rank")))
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = dcp_metadata.StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor entries loaded as plain data."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = _load_bytes_item(value)
        except pickle.UnpicklingError as exc:
            raise UnsafeCheckpoint(
                f"the entry {read_item.dest_index.fqn!r} is not plain data ({' '.join(str(exc).split())[:160]})"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415 - DCP's own helper

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def unsafe_content(path: str | os.PathLike) -> str | None:
    """What in the checkpoint directory ``path`` would run code or reach outside it, on one
    line; None when its metadata and every non-tensor entry are plain data."""
    path = Path(path)
    try:
        metadata = read_metadata_file(path / METADATA)
        _check_data_files(path, {info.relative_path for info in metadata.storage_data.values()})
        for index, info in metadata.storage_data.items():
            if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                continue
            if info.length > MAX_BYTES_ITEM:
                raise UnsafeCheckpoint(f"the entry {index.fqn!r} has {info.length:,} bytes")
            with open_regular(path / info.relative_path) as f:
                f.seek(info.offset)
                data = f.read(info.length)
            if info.transform_descriptors:
                continue  # a compressed entry: SafePlanner still loads it as plain data only
            try:
                _load_bytes_item(data)
            except Exception as exc:  # noqa: BLE001 - refused by weights_only, or not a pickle at all
                raise UnsafeCheckpoint(
                    f"the entry {index.fqn!r} in {info.relative_path} is not plain data "
                    f"({' '.join(str(exc).split())[:120]})"
                ) from None
    except UnsafeCheckpoint as exc:
        return str(exc)
    except UnreadableFile:
        return "a data file is a symlink, FIFO or device, not a file"
    except OSError as exc:
        return f"{METADATA} or a data file is unreadable ({exc.strerror})"
    return None


def _check_data_files(path: Path, names: set[str]) -> None:
    """Every data file the metadata names is a regular file of the checkpoint directory itself:
    DCP opens them as it is told, and a symlink to ``/dev/zero`` or a FIFO would never end or
    never open (export hung, a resumed rank spun)."""
    for name in sorted(names):
        try:
            info = os.lstat(path / name)
        except FileNotFoundError:
            raise UnsafeCheckpoint(f"{name} is missing") from None
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeCheckpoint(f"{name} is a symlink, FIFO or device, not a file")


def load_state(state: dict, path: str | os.PathLike, *, no_dist: bool = False) -> None:
    """``dcp.load`` of ``state`` from the checkpoint directory ``path`` through
    :class:`SafeReader` and :class:`SafePlanner`."""
    with single_process_load() if no_dist else nullcontext():
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafePlanner(), no_dist=no_dist)
