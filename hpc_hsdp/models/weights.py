"""Giving a sharded model its values without any rank holding the whole model.

Two ways in, shared by the ``hf:`` and ``MODULE:FUNCTION`` adapters:

:func:`init_unit_by_unit`
    The model's own initialisation, deterministic and independent of the mesh shape.
    A second, unsharded copy of the model is built on the meta device; its FSDP units
    (each shard-unit instance, then the root's remaining modules) are materialized on the
    CPU one at a time. Every module of the unit is initialised by the caller's
    ``init_module(module)`` (transformers' ``_init_weights``, or ``reset_parameters``)
    under the global RNG seeded by ``(seed, module name)``, children before parents; each
    rank then keeps its own shard of every value and frees the unit. So the values depend
    on the seed and the names only: a (2, 2) mesh, a (1, 4) mesh and a plain unsharded
    model start from the same numbers, and a rank never holds more than one unit unsharded.
    Limit: an ``init_module`` of a module *above* a shard unit that re-initialises
    parameters *inside* the unit has no effect (they are not materialized at that point).
    Every floating-point tensor of a unit is first filled with NaN; one still NaN after
    the unit's initialisation was not initialised by the model and is a clear error.

:func:`load_safetensors_shards`
    Pretrained weights: every rank reads, from the safetensors files, only the bytes of the
    rows of its own shard of each parameter (``os.pread`` at offsets from the file's
    header; FSDP2 shards dim 0, so a shard is one contiguous byte range). No collective,
    no memory map (its pages would count in the rank's resident memory), no full copy
    anywhere; the model directory must be visible on every node (as the run directory
    already is). Measured: a rank's resident memory grows by its shard plus one tensor's
    rows at a time.

Tied parameters (one ``nn.Parameter`` under two names, e.g. a language-model head tied to
the input embedding) are set once, under their first name; :func:`check_tied_parameters`
refuses a tie whose two modules would land in different FSDP units.
"""

from __future__ import annotations

import math
import os
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hpc_hsdp.errors import SpecError
from hpc_hsdp.files import parse_json, read_json

ROOT_UNIT = ""


def module_seed(seed: int, name: str) -> int:
    """The RNG seed of module ``name`` under run seed ``seed``."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def unit_of(name: str, unit_names: Iterable[str]) -> str:
    """The FSDP unit a module (or parameter) named ``name`` belongs to: the longest unit
    name that is ``name`` or a dotted prefix of it; the root unit ``""`` otherwise."""
    best = ROOT_UNIT
    for unit in unit_names:
        if (name == unit or name.startswith(unit + ".")) and len(unit) > len(best):
            best = unit
    return best


def unit_names(model: nn.Module, unit_classes: tuple[type, ...]) -> list[str]:
    """Names of the modules that become FSDP units (instances of ``unit_classes``)."""
    return [name for name, module in model.named_modules() if name and isinstance(module, unit_classes)]


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Names of each parameter that is registered under more than one name (first name first)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def check_tied_parameters(model: nn.Module, unit_classes: tuple[type, ...], *, what: str) -> None:
    """A tied parameter must stay in one FSDP unit (FSDP2 shards it once there); refuse a
    shard unit choice that would split the tie."""
    units = unit_names(model, unit_classes)
    for group in tied_groups(model):
        owners = {unit_of(name.rpartition(".")[0], units) for name in group}
        if len(owners) > 1:
            places = ", ".join(f"{n} in {unit_of(n.rpartition('.')[0], units) or 'the root'}" for n in group)
            raise SpecError(
                f"{what}: the tied parameters {places} would be in different FSDP units; choose shard units "
                f"(--shard-unit) that leave both in the same one (e.g. the transformer blocks only)"
            )


def retie_like(target: nn.Module, reference: nn.Module) -> None:
    """Tie ``target``'s parameters as they are tied in ``reference`` (the same model on meta):
    ``to_empty`` on a model without FSDP replaces each module's parameters one by one and
    so unties a tied head; FSDP2 keeps ties, and then this does nothing."""
    for group in tied_groups(reference):
        first = target.get_parameter(group[0])
        for name in group[1:]:
            owner, _, attribute = name.rpartition(".")
            module = target.get_submodule(owner)
            if getattr(module, attribute) is not first:
                setattr(module, attribute, first)


def _local_part(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` for ``target`` (a DTensor shard, or the whole tensor)."""
    if isinstance(target, DTensor):
        shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape))
        return full[index]
    return full


@torch.no_grad()
def _assign(target: torch.Tensor, full: torch.Tensor) -> None:
    local = target.to_local() if isinstance(target, DTensor) else target
    part = _local_part(full, target)
    if tuple(part.shape) != tuple(local.shape):
        raise RuntimeError(f"shard of shape {tuple(part.shape)} does not fit local tensor {tuple(local.shape)}")
    local.copy_(part.to(device=local.device, dtype=local.dtype))


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(attribute, tensor, is_parameter) registered directly on ``module``."""
    out = [(n, p, True) for n, p in module._parameters.items() if p is not None]
    return out + [(n, b, False) for n, b in module._buffers.items() if b is not None]


def _has_nan(tensor: torch.Tensor) -> bool:
    """Whether any element is NaN: ``amax`` propagates NaN, in one pass without a mask
    (5x faster than ``isnan(t).any()`` on the CPU)."""
    return tensor.numel() > 0 and bool(torch.isnan(tensor.amax()))


@torch.no_grad()
def init_unit_by_unit(
    target: nn.Module,
    fresh_meta: nn.Module,
    unit_classes: tuple[type, ...],
    *,
    seed: int,
    init_module: Callable[[nn.Module, str], None],
    what: str,
    buffers_only: bool = False,
) -> None:
    """Initialise ``target`` (sharded or not, materialized) from ``fresh_meta``, an
    unsharded copy of the same model on the meta device, one FSDP unit at a time (see the
    module docstring). ``init_module(module, name)`` initialises one module of the copy
    in place. ``buffers_only``: set only the buffers (the rest comes from pretrained weights).
    """
    retie_like(target, fresh_meta)
    units = unit_names(fresh_meta, unit_classes)
    target_tensors = {**dict(target.named_parameters()), **dict(target.named_buffers())}
    canonical = set(target_tensors)  # a tied parameter's first name only
    by_unit: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in fresh_meta.named_modules():
        by_unit.setdefault(unit_of(name, units), []).append((name, module))
    # deeper units first, the root last; modules of a unit children before parents
    order = sorted(by_unit, key=lambda u: (u == ROOT_UNIT, -u.count(".")))
    for unit in order:
        modules = list(reversed(by_unit[unit]))
        if buffers_only:  # only the modules that own buffers are materialized and initialised
            modules = [(n, m) for n, m in modules if any(b is not None for b in m._buffers.values())]
        for _, module in modules:
            module.to_empty(device="cpu", recurse=False)
            for _, tensor, _ in _own_tensors(module):
                if tensor.is_floating_point():
                    tensor.fill_(math.nan)
        for name, module in modules:
            with torch.random.fork_rng(devices=[]):  # units are materialized on the CPU: its generator only
                torch.default_generator.manual_seed(module_seed(seed, name))  # torch.manual_seed formats 3 stacks
                init_module(module, name)
        for name, module in modules:
            for attribute, tensor, is_param in _own_tensors(module):
                full_name = f"{name}.{attribute}" if name else attribute
                if full_name not in canonical or (buffers_only and is_param):
                    continue
                if tensor.is_floating_point() and _has_nan(tensor):
                    raise SpecError(
                        f"{what}: {full_name} is not initialised by the model's own initialisation (still NaN after "
                        f"it); give {type(module).__name__} a reset_parameters() or initialise it in _init_weights"
                    )
                _assign(target_tensors[full_name], tensor)
        for _, module in modules:
            module.to_empty(device="meta", recurse=False)


# ----------------------------------------------------------------------------- safetensors


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


MAX_SAFETENSORS_HEADER = 100_000_000
"""The largest header of a ``.safetensors`` file (safetensors' own limit), and of its index."""


class SafetensorsFile:
    """One ``.safetensors`` file read with ``os.pread``: its header (names, dtypes, shapes,
    byte ranges) and, per tensor, any range of rows, reading exactly those bytes (no
    memory map: mapped pages would count in the rank's resident memory)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        size = int.from_bytes(os.pread(self._fd, 8, 0), "little")
        if not 0 < size <= MAX_SAFETENSORS_HEADER:  # checked before that many bytes are read
            os.close(self._fd)
            raise SpecError(
                f"{path} is not a safetensors file (a header of {size} bytes); give the model's own weights"
            )
        try:
            header = parse_json(os.pread(self._fd, size, 8), where=str(path))
            if not isinstance(header, dict):
                raise ValueError(f"{path} has no safetensors header")
        except ValueError as exc:
            os.close(self._fd)
            raise SpecError(f"{exc}; give the model's own weights") from None
        header.pop("__metadata__", None)
        self.tensors: dict[str, dict] = header
        self._data_start = 8 + size

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def read_rows(self, name: str, start: int, count: int) -> torch.Tensor:
        """Rows ``[start, start + count)`` (dim 0) of tensor ``name``."""
        entry = self.tensors[name]
        dtype, shape = _SAFETENSORS_DTYPES[entry["dtype"]], tuple(entry["shape"])
        begin, _ = entry["data_offsets"]
        row_bytes = (math.prod(shape[1:]) if len(shape) > 1 else 1) * torch.empty((), dtype=dtype).element_size()
        rows = (count, *shape[1:]) if shape else ()
        if count == 0 or not shape:
            length = 0 if count == 0 else row_bytes
            raw = bytearray(os.pread(self._fd, length, self._data_start + begin)) if length else bytearray()
        else:
            raw = bytearray(os.pread(self._fd, count * row_bytes, self._data_start + begin + start * row_bytes))
        if not raw:
            return torch.empty(rows, dtype=dtype)
        return torch.frombuffer(raw, dtype=dtype).reshape(rows)

    def close(self) -> None:
        os.close(self._fd)


def safetensors_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the ``.safetensors`` file holding it (``model.safetensors`` or the
    files of ``model.safetensors.index.json``); empty when the directory has none."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            index_record: Any = read_json(index.resolve(), max_bytes=MAX_SAFETENSORS_HEADER)  # of another shape: caught
            weight_map = index_record["weight_map"]
            files = {str(name): str(file) for name, file in weight_map.items()}
            if any(Path(file).name != file or file in ("", ".", "..") for file in files.values()):
                raise ValueError("it names a file outside its directory")
            return {name: directory / file for name, file in files.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SpecError(
                f"cannot read {index} ({type(exc).__name__}: {str(exc)[:120]}); give the model's own weights"
            ) from None
    single = directory / "model.safetensors"
    if not single.is_file():
        return {}
    handle = SafetensorsFile(single)
    try:
        return {name: single for name in handle.tensors}
    finally:
        handle.close()


@torch.no_grad()
def load_safetensors_shards(
    target: nn.Module, files: dict[str, Path], *, what: str, strip_prefixes: tuple[str, ...] = ()
) -> list[str]:
    """Read each parameter's (and persistent buffer's) own shard from ``files`` into
    ``target`` (only its rows' bytes: FSDP2 shards dim 0); returns the file's tensor names
    that the model did not take. A missing parameter or a shape that differs is a
    :class:`SpecError`."""
    persistent = {
        (f"{name}.{b}" if name else b)
        for name, module in target.named_modules()
        for b in module._buffers
        if b not in module._non_persistent_buffers_set
    }
    wanted = {**dict(target.named_parameters()), **{n: b for n, b in target.named_buffers() if n in persistent}}
    aliases = {group[0]: group for group in tied_groups(target)}
    handles: dict[Path, SafetensorsFile] = {}
    used: set[str] = set()
    missing: list[str] = []
    try:
        for name, tensor in wanted.items():
            candidates = list(aliases.get(name, [name]))
            candidates += [c.removeprefix(p) for c in list(candidates) for p in strip_prefixes if c.startswith(p)]
            key = next((c for c in candidates if c in files), None)
            if key is None:
                if name in persistent:
                    continue  # the initialisation already gave it its value
                missing.append(name)
                continue
            path = files[key]
            if path not in handles:
                handles[path] = SafetensorsFile(path)
            handle = handles[path]
            shape = handle.shape(key)
            if shape != tuple(tensor.shape):
                raise SpecError(
                    f"{what}: {key} has shape {shape} in {path.name} but the config builds "
                    f"{tuple(tensor.shape)}; the weights do not belong to this config.json"
                )
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            start, count = 0, (shape[0] if shape else 1)
            if isinstance(tensor, DTensor):
                local_shape, offset = compute_local_shape_and_global_offset(
                    tensor.shape, tensor.device_mesh, tensor.placements
                )
                if any(offset[1:]) or tuple(local_shape[1:]) != shape[1:]:
                    full = handle.read_rows(key, 0, shape[0])  # sharded beyond dim 0: take it whole
                    local.copy_(_local_part(full, tensor).to(device=local.device, dtype=local.dtype))
                    used.add(key)
                    continue
                start, count = offset[0], local_shape[0]
            part = handle.read_rows(key, start, count)
            local.copy_(part.reshape(local.shape).to(device=local.device, dtype=local.dtype))
            used.add(key)
    finally:
        for handle in handles.values():
            handle.close()
    if missing:
        raise SpecError(
            f"{what}: the safetensors weights lack {len(missing)} parameter(s) of the model, e.g. "
            f"{', '.join(missing[:3])}; they were saved from another model class or config"
        )
    return sorted(set(files) - used)


def fsdp_forward_method(model: nn.Module, method: str) -> None:
    """Let ``model.<method>(...)`` unshard the root like ``model(...)`` does (FSDP2 only
    hooks ``forward``); a no-op for a model that is not an FSDP module."""
    if isinstance(model, FSDPModule) and method not in getattr(model, "_hpc_hsdp_forward_methods", ()):
        register_fsdp_forward_method(model, method)
        # torch's stubs type a module's attributes as Tensor | Module; any value may be set
        model._hpc_hsdp_forward_methods = (*getattr(model, "_hpc_hsdp_forward_methods", ()), method)  # type: ignore[assignment]
