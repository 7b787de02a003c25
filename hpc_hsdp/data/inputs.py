"""The inputs of ``prepare-data``: which files, checked up front, read as blocks of text.

A text file is one document; a JSONL file holds one per line (either gzip'd, ``.gz``, or
zstandard-compressed, ``.zst``, streamed). A Parquet file holds one document per row, in the
column ``--field`` names, read one row group's batch at a time with pyarrow (memory stays
bounded); a directory written by ``datasets``' ``save_to_disk`` is read the same way from its
Arrow files (``state.json`` names them, in order), with pyarrow alone: the ``datasets``
library is not imported and nothing is downloaded. A block is about ``BLOCK_BYTES`` of text:
many small files, or a piece of a long one, cut where the tokenizer's pre-tokenizer splits
anyway, so that the pieces encode as the whole would.
"""

from __future__ import annotations

import codecs
import fnmatch
import gzip
import hashlib
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpc_hsdp.data.tokens import DataError
from hpc_hsdp.files import read_json

BLOCK_BYTES = 1 << 20
PEEK_BYTES = 1 << 12
JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
RECORD_KINDS = ("jsonl", "parquet", "arrow")
"""Kinds whose documents are records: ``--field`` names the key or column of the text."""
DATASETS_STATE = "state.json"
"""The file ``datasets``' ``save_to_disk`` writes beside its Arrow files (``_data_files``)."""
DATASETS_DICT = "dataset_dict.json"
EXTRA_HINT = "install it with pip install 'hpc-hsdp[data]'"
MAX_ROWS_PER_BATCH = 256
"""The most rows of a Parquet row group read at a time (fewer: about ``BLOCK_BYTES`` of its text,
as its metadata says). The metadata does not bound what the rows decode to: a dictionary-encoded
column repeats one value in as many rows as it likes (a 444-byte file of a million rows of 1 KB
decodes to 1.1 GB). So the text column is read as a dictionary, measured, and decoded in slices
of about ``BLOCK_BYTES`` (:func:`_decoded_slices`): memory holds a slice and the row group's
dictionary (as large as the file says), not rows x the longest value. Small batches cost nothing
measurable (pyarrow reads 2 million short rows as fast in batches of 256 as of 65,536)."""


@dataclass(frozen=True)
class InputFile:
    path: Path
    kind: str
    """``text`` (the file is one document), ``jsonl`` (one document per line), ``parquet`` (one
    per row) or ``arrow`` (one per row of a ``datasets`` directory's Arrow stream file)."""
    compressed: str | None
    """``gzip``, ``zstd`` or None."""
    size: int
    """Bytes on disk."""


def _kind_of(path: Path) -> tuple[str, str | None]:
    compressed = COMPRESSIONS.get(path.suffix)
    stem = path.with_suffix("") if compressed else path
    if not compressed and path.suffix in PARQUET_SUFFIXES:
        return "parquet", None
    return ("jsonl" if stem.suffix in JSONL_SUFFIXES else "text"), compressed


def require_pyarrow(why: str):
    """The pyarrow module (the ``data`` extra), or a one-line DataError."""
    try:
        import pyarrow  # noqa: PLC0415 - pyarrow is an optional extra, loaded only for Parquet and Arrow inputs
        import pyarrow.ipc  # noqa: PLC0415 - as above
        import pyarrow.parquet  # noqa: PLC0415 - as above
    except ImportError:
        raise DataError(f"{why} needs the `pyarrow` library, which is not installed; {EXTRA_HINT}") from None
    return pyarrow


def require_zstandard(why: str):
    """The zstandard module (the ``data`` extra), or a one-line DataError."""
    try:
        import zstandard  # noqa: PLC0415 - zstandard is an optional extra, loaded only for .zst inputs
    except ImportError:
        raise DataError(f"{why} needs the `zstandard` library, which is not installed; {EXTRA_HINT}") from None
    return zstandard


MAX_LINE_BYTES = 256 << 20
"""The longest JSONL line (one document) read by default: a file with an enormous line is
refused with ``--max-line-bytes`` named, so that memory stays bounded."""


def _line_too_long(source: str, number: int, max_line_bytes: int) -> DataError:
    return DataError(
        f"input {source} line {number} is longer than {max_line_bytes:,} bytes (--max-line-bytes); "
        f"split the document, or raise --max-line-bytes if the memory allows"
    )


def discover_inputs(
    inputs: tuple[str, ...],
    *,
    glob: str | None = None,
    field: str | None = None,
    decode_errors: str = "strict",
    max_line_bytes: int = MAX_LINE_BYTES,
) -> tuple[list[InputFile], dict[str, int]]:
    """The input files in order (each directory walked recursively, sorted, hidden names
    skipped), and how many files inside directories were left out: ``{"empty": n, "binary": m}``
    (not UTF-8 text, e.g. ``__pycache__/*.pyc``; a file named itself is refused instead).
    Raises DataError."""
    files: list[InputFile] = []
    left_out = {"empty": 0, "binary": 0}
    for given in inputs:
        path = Path(given)
        if not path.exists():
            raise DataError(f"input {given} does not exist; check the path")
        if path.is_dir() and ((path / DATASETS_STATE).is_file() or (path / DATASETS_DICT).is_file()):
            files.extend(_datasets_files(path, given))
        elif path.is_dir():
            found = 0
            for root, dirs, names in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                for name in sorted(names):
                    if name.startswith(".") or (glob and not fnmatch.fnmatch(name, glob)):
                        continue
                    file = Path(root) / name
                    if not file.is_file():
                        continue
                    if file.stat().st_size == 0:
                        left_out["empty"] += 1
                        continue
                    try:
                        files.append(_checked_input(file, decode_errors))
                    except NotText:
                        left_out["binary"] += 1
                        continue
                    found += 1
            if not found:
                what = f"no non-empty file matching {glob!r}" if glob else "no non-empty file"
                raise DataError(f"input directory {given} holds {what}; check the path{' or --glob' if glob else ''}")
        elif path.is_file():
            if path.stat().st_size == 0:
                raise DataError(f"input {given} is empty; leave it out")
            files.append(_checked_input(path, decode_errors))
        else:
            raise DataError(f"input {given} is neither a file nor a directory; give text or JSONL files")
    records = [f for f in files if f.kind in RECORD_KINDS]
    if records and field is None:
        first = records[0]
        if first.kind == "jsonl":
            raise DataError(
                f"input {first.path} is JSONL: say which key holds the text with --field, e.g. --field text"
            )
        raise DataError(
            f"input {first.path} is {_KIND_NAMES[first.kind]}: say which column holds the text with --field "
            f"(it has: {', '.join(map(repr, _columns(first)))})"
        )
    if field is not None and not records:
        raise DataError(
            f"--field {field} is for JSONL, Parquet or datasets inputs (.jsonl, .ndjson, .gz or .zst of them, "
            f".parquet, a save_to_disk directory) but none was given; leave --field out for text files"
        )
    for record_file in records:
        if record_file.kind == "jsonl":
            _check_first_jsonl_line(record_file, field, max_line_bytes)
        else:
            _check_text_column(record_file, field)
    return files, left_out


_KIND_NAMES = {"parquet": "Parquet", "arrow": "a datasets (save_to_disk) Arrow file"}


MAX_DATASETS_JSON = 16 << 20
"""The most a ``datasets`` directory's ``state.json`` or ``dataset_dict.json`` may hold."""


def _datasets_files(path: Path, given: str) -> list[InputFile]:
    """The Arrow files of a ``datasets`` directory (``save_to_disk``), in the order its
    ``state.json`` lists them. A DatasetDict's directory is refused, naming its splits."""
    if not (path / DATASETS_STATE).is_file():
        try:
            dataset_dict: Any = read_json((path / DATASETS_DICT).resolve(), max_bytes=MAX_DATASETS_JSON)
            splits = dataset_dict.get("splits") or []  # of another shape: the AttributeError below
        except (OSError, ValueError, AttributeError):
            splits = []
        named = ", ".join(f"{given.rstrip('/')}/{split}" for split in splits) or "one of its split directories"
        raise DataError(f"input {given} is a datasets DatasetDict: give the split to read, e.g. {named}")
    try:
        state: Any = read_json(
            (path / DATASETS_STATE).resolve(), max_bytes=MAX_DATASETS_JSON
        )  # of another shape: caught
        names = [entry["filename"] for entry in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(
            f"input {given} has no readable {DATASETS_STATE} ({type(exc).__name__}: {exc}); "
            f"give a directory written by datasets' save_to_disk"
        ) from None
    if not names:
        raise DataError(f"input {given}: its {DATASETS_STATE} lists no data file; the dataset is empty")
    require_pyarrow(f"input {given} (a datasets directory)")
    out = []
    for name in names:
        file = path / name
        if Path(name).is_absolute() or ".." in Path(name).parts or not file.is_file():
            raise DataError(f"input {given}: {DATASETS_STATE} names {name!r}, which is not a file in it")
        out.append(InputFile(path=file, kind="arrow", compressed=None, size=file.stat().st_size))
    return out


def _parquet_batches(parquet, field: str, block_bytes: int, source: Path):
    """The ``field`` column of a Parquet file, row group by row group, in batches of about
    ``block_bytes`` of its uncompressed text (the row group's metadata says its size) and at most
    :data:`MAX_ROWS_PER_BATCH` rows, whatever they decode to: memory holds one such batch, however
    large the row groups. A file that breaks while read is DataError, one line."""
    pa = require_pyarrow(f"input {source}")
    try:
        yield from _group_batches(parquet, field, block_bytes)
    except (pa.ArrowException, OSError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise DataError(f"input {source} is not a readable Parquet file ({reason}); fix or leave it out") from None


def _group_batches(parquet, field: str, block_bytes: int):
    meta = parquet.metadata
    for index in range(meta.num_row_groups):
        group = meta.row_group(index)
        chunks = [group.column(j) for j in range(group.num_columns)]
        size = next((c.total_uncompressed_size for c in chunks if c.path_in_schema == field), group.total_byte_size)
        rows = max(1, min(MAX_ROWS_PER_BATCH, group.num_rows * block_bytes // max(size, 1)))
        yield from parquet.iter_batches(batch_size=rows, row_groups=[index], columns=[field], use_threads=False)


def _open_table(file: InputFile, block_bytes: int = BLOCK_BYTES):
    """(the schema, a function that yields record batches of one column) of a Parquet or
    Arrow input; DataError when it is not one."""
    pa = require_pyarrow(f"input {file.path} ({_KIND_NAMES[file.kind]})")
    try:
        if file.kind == "parquet":
            parquet = pa.parquet.ParquetFile(file.path)
            return parquet.schema_arrow, lambda field: _parquet_batches(
                pa.parquet.ParquetFile(file.path, read_dictionary=[field]), field, block_bytes, file.path
            )
        source = pa.memory_map(str(file.path), "r")
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:  # datasets writes the stream format; the file format serves too
            reader = pa.ipc.open_file(source)
            return reader.schema, lambda field: (
                reader.get_batch(i).select([field]) for i in range(reader.num_record_batches)
            )
        return reader.schema, lambda field: (batch.select([field]) for batch in reader)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"input {file.path} is not a readable {_KIND_NAMES[file.kind]} file ({exc}); fix or leave it out"
        ) from None


def _columns(file: InputFile) -> list[str]:
    return list(_open_table(file)[0].names)


def _check_text_column(file: InputFile, field: str | None) -> None:
    pa = require_pyarrow(f"input {file.path}")
    schema = _open_table(file)[0]
    if field not in schema.names:
        raise DataError(
            f"input {file.path} has no column {field!r} (it has: {', '.join(map(repr, schema.names))}); "
            f"give the column that holds the text with --field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(
            f"input {file.path}: column {field!r} holds {kind}, not text; give the column that holds the text with --field"
        )


def _open_binary(file: InputFile) -> tuple[io.BufferedIOBase, io.BufferedIOBase]:
    """(the decompressed stream, the file on disk) of an input."""
    raw = open(file.path, "rb")
    if file.compressed == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if file.compressed == "zstd":
        zstandard = require_zstandard(f"input {file.path} (zstandard)")
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False)
        return io.BufferedReader(reader, buffer_size=1 << 16), raw
    return raw, raw


def _zstd_errors() -> tuple[type[BaseException], ...]:
    try:
        import zstandard  # noqa: PLC0415 - zstandard is an optional extra
    except ImportError:
        return ()
    return (zstandard.ZstdError,)


class NotText(DataError):
    """An input that does not start as UTF-8 text (under ``--decode-errors strict``)."""


def _checked_input(path: Path, decode_errors: str) -> InputFile:
    """An input that exists, is readable, holds something, and (strict) starts as UTF-8 text."""
    kind, compressed = _kind_of(path)
    file = InputFile(path=path, kind=kind, compressed=compressed, size=path.stat().st_size)
    if kind == "parquet":
        _open_table(file)  # readable, and pyarrow installed
        return file
    try:
        stream, raw = _open_binary(file)
        with raw, stream:
            first = stream.read(PEEK_BYTES)
    except (gzip.BadGzipFile, EOFError, zlib.error, *_zstd_errors()) as exc:  # type: ignore[misc]  # mypy cannot unpack a tuple of exception types here
        name = "gzip" if compressed == "gzip" else "zstandard"
        raise DataError(f"input {path} is not a valid {name} file ({exc}); fix or leave it out") from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise DataError(
            f"cannot read input {path} ({reason}); check that it is a readable{f' {compressed}' if compressed else ''} file"
        ) from None
    if not first:
        raise DataError(f"input {path} is empty{' after decompression' if compressed else ''}; leave it out")
    if decode_errors == "strict":
        try:
            codecs.getincrementaldecoder("utf-8")().decode(first, final=False)
        except UnicodeDecodeError as exc:
            raise NotText(
                f"input {path} is not UTF-8 text (byte {exc.start} is {first[exc.start : exc.start + 1]!r}); "
                f"leave it out (e.g. with --glob) or pass --decode-errors replace"
            ) from None
    return file


def _check_first_jsonl_line(file: InputFile, key: str | None, max_line_bytes: int = MAX_LINE_BYTES) -> None:
    stream, raw = _open_binary(file)
    with raw, stream:
        for number in range(1, 1002):
            line = stream.readline(max_line_bytes + 1)
            if not line:
                break
            if len(line) > max_line_bytes and not line.endswith(b"\n"):
                raise _line_too_long(str(file.path), number, max_line_bytes)
            if line.strip():
                jsonl_text(line, key, str(file.path), number)
                return
            if number > 1000:
                break
    raise DataError(f"input {file.path} has no JSON line in its first 1000 lines; leave it out or check the format")


def jsonl_text(line: bytes, key: str | None, source: str, number: int) -> str:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{source} line {number} is not JSON ({exc}); fix the line or leave the file out") from None
    except RecursionError:
        raise DataError(
            f"{source} line {number} is nested too deeply to read; fix the line or leave the file out"
        ) from None
    if not isinstance(record, dict) or key not in record:
        has = ", ".join(map(repr, list(record)[:8])) if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise DataError(
            f"{source} line {number} has no {key!r} key (it has: {has}); give the key that holds the text with --field"
        )
    text = record[key]
    if not isinstance(text, str):
        raise DataError(
            f"{source} line {number}: {key!r} holds a {type(text).__name__}, not text; give the key that "
            f"holds the text with --field"
        )
    return text


# ---------------------------------------------------------------------------- blocks of input


@dataclass(frozen=True)
class Piece:
    """Text of one input: a whole text file, a piece of a long one, or a run of JSONL lines."""

    source: str
    kind: str
    data: bytes
    start: int
    """Text: byte offset of ``data`` in the file; JSONL: the number of its first line; rows
    (Parquet, Arrow): the number of its first row (0-based)."""
    ends_document: bool = True
    """Text: the document (file) ends with this piece."""
    val: bool = False
    """Text: the document belongs to the val split."""
    lengths: tuple[int, ...] = ()
    """Rows: the UTF-8 bytes of each row's text, one after the other in ``data`` (0: an empty
    or null text)."""


@dataclass(frozen=True)
class Block:
    pieces: tuple[Piece, ...]
    disk_bytes: int
    """Input bytes on disk consumed by this block (compressed ones for .gz)."""


def is_val(key: bytes, fraction: float) -> bool:
    """Whether the document with this text goes to the held-out split: a hash, so the
    decision depends on the document alone."""
    if fraction <= 0.0:
        return False
    value = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return value < fraction * (1 << 64)


def _cut(data: bytes, final: bool) -> int:
    """Where to end a piece of a long text (the rest begins the next piece): before the last
    line break (else space) that follows a printable ASCII character. Pre-tokenizers split
    there anyway (a word or punctuation run ends, a whitespace run begins, and how far it
    reaches depends only on what follows), so the pieces encode exactly as the whole does."""
    if final:
        return len(data)
    for separator in (b"\n", b" "):
        position = len(data)
        while (position := data.rfind(separator, 0, position)) > 0:
            if 0x21 <= data[position - 1] <= 0x7E:
                return position
    cut = len(data) - 1  # no such place: cut before the last character that starts here
    while cut > 0 and (data[cut] & 0xC0) == 0x80:
        cut -= 1
    return cut


def _text_pieces(stream: io.BufferedIOBase, source: str, block_bytes: int, val_fraction: float) -> Iterator[Piece]:
    """A text file as one document: the whole file, or pieces of about ``block_bytes``."""
    pending = stream.read(block_bytes)
    offset = 0
    val: bool | None = None
    while pending:
        more = stream.read(block_bytes)
        final = not more
        end = _cut(pending, final) or len(pending)
        text = pending[:end]
        if val is None:
            val = is_val(text, val_fraction)
        yield Piece(source, "text", text, offset, ends_document=final and end == len(pending), val=val)
        offset += end
        pending = pending[end:] + more


def _jsonl_pieces(
    stream: io.BufferedIOBase, source: str, block_bytes: int, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[Piece]:
    """Runs of whole JSONL lines of about ``block_bytes``; a line longer than
    ``max_line_bytes`` is refused (DataError) before more of it is held in memory."""
    carry = b""
    number = 1
    while True:
        chunk = stream.read(block_bytes)
        data = carry + chunk
        if not chunk:
            if data.strip():
                yield Piece(source, "jsonl", data, number)
            return
        end = data.rfind(b"\n") + 1
        if end == 0:  # a line longer than a block: read on
            if len(data) > max_line_bytes:
                raise _line_too_long(source, number, max_line_bytes)
            carry = data
            continue
        yield Piece(source, "jsonl", data[:end], number)
        number += data.count(b"\n", 0, end)
        carry = data[end:]


def _row_pieces(
    file: InputFile, field: str, rows_done: list[int], block_bytes: int, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[Piece]:
    """A Parquet or Arrow input's text column, one record batch at a time (Arrow files are
    memory-mapped: a batch is not read until its rows are), as pieces of rows of about
    ``block_bytes`` of text; nulls are empty texts. ``rows_done[0]`` counts the rows read. A row
    longer than ``max_line_bytes`` is refused (DataError), as a JSONL line is."""
    pa = require_pyarrow(f"input {file.path}")
    source = str(file.path)
    row = 0
    for batch in _open_table(file, block_bytes)[1](field):
        for column in _decoded_slices(batch.column(0), block_bytes, max_line_bytes, source, row):
            yield from _column_pieces(pa, column, source, row, rows_done, block_bytes, max_line_bytes)
            row += len(column)


def _decoded_slices(column, block_bytes: int, max_line_bytes: int, source: str, row: int):
    """``column`` in slices of about ``block_bytes`` of text each (at least one row). A dictionary
    column (Parquet is read with its text column as one) is measured before it is decoded: its rows
    may all name one long value, and decoding a batch whole would hold rows x that value."""
    pa = require_pyarrow(f"input {source}")
    if not pa.types.is_dictionary(column.type):
        yield column
        return
    import pyarrow.compute as pc  # noqa: PLC0415 - with pyarrow, only for Parquet and Arrow inputs

    values = pc.binary_length(column.dictionary.cast(pa.large_string()))
    lengths = pc.fill_null(values.take(column.indices), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    if len(lengths) and int(lengths.max()) > max_line_bytes:
        number = row + int(np.argmax(lengths))
        raise _row_too_long(source, number, int(lengths.max()), max_line_bytes)
    ends = np.concatenate(([0], np.cumsum(lengths)))
    start = 0
    while start < len(lengths):
        end = max(start + 1, int(np.searchsorted(ends, ends[start] + block_bytes, side="right")) - 1)
        end = min(end, len(lengths))
        yield column.slice(start, end - start).dictionary_decode()
        start = end


def _row_too_long(source: str, number: int, longest: int, max_line_bytes: int) -> DataError:
    return DataError(
        f"input {source} row {number} holds {longest:,} bytes of text, more than {max_line_bytes:,} "
        f"(--max-line-bytes); raise --max-line-bytes for such documents, or leave the file out"
    )


def _column_pieces(pa, column, source: str, row: int, rows_done: list[int], block_bytes: int, max_line_bytes: int):
    """One decoded slice of a text column as pieces of whole rows of about ``block_bytes``."""
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        column = column.cast(pa.large_string())
    if column.null_count:
        column = column.fill_null("")
    count = len(column)
    if not count:
        return
    buffers = column.buffers()
    offsets = np.frombuffer(buffers[1], dtype=np.int64 if pa.types.is_large_string(column.type) else np.int32)
    offsets = offsets[column.offset : column.offset + count + 1].astype(np.int64)
    longest = int(np.diff(offsets).max())
    if longest > max_line_bytes:
        raise _row_too_long(source, row + int(np.argmax(np.diff(offsets))), longest, max_line_bytes)
    start = 0
    while start < count:  # pieces of about block_bytes: whole rows, at least one
        limit = int(offsets[start]) + block_bytes
        end = max(start + 1, min(count, int(np.searchsorted(offsets, limit, side="right")) - 1))
        first, last = int(offsets[start]), int(offsets[end])
        data = buffers[2].slice(first, last - first).to_pybytes() if buffers[2] is not None and last > first else b""
        yield Piece(source, "rows", data, row + start, lengths=tuple(np.diff(offsets[start : end + 1]).tolist()))
        start = end
        rows_done[0] = row + start


def _table_rows(file: InputFile) -> int:
    pa = require_pyarrow(f"input {file.path}")
    if file.kind == "parquet":
        return max(1, pa.parquet.ParquetFile(file.path).metadata.num_rows)
    return 0  # an Arrow stream says its rows only at its end: progress moves per file


def iter_blocks(
    files: list[InputFile],
    *,
    val_fraction: float,
    block_bytes: int = BLOCK_BYTES,
    max_line_bytes: int = MAX_LINE_BYTES,
    field: str | None = None,
) -> Iterator[Block]:
    """The inputs as blocks of about ``block_bytes`` of text, in order (``field``: the column
    of a Parquet or Arrow input's text)."""
    pieces: list[Piece] = []
    size = 0
    reported = 0
    finished = 0
    for file in files:
        if file.kind in ("parquet", "arrow"):
            assert field is not None  # discover_inputs refuses such an input without --field
            rows_done, total_rows = [0], _table_rows(file)
            for piece in _row_pieces(file, field, rows_done, block_bytes, max_line_bytes):
                pieces.append(piece)
                size += len(piece.data)
                if size >= block_bytes:
                    position = finished + (file.size * rows_done[0] // total_rows if total_rows else 0)
                    position = max(position, reported)
                    yield Block(tuple(pieces), position - reported)
                    reported, pieces, size = position, [], 0
            finished += file.size
            continue
        stream, raw = _open_binary(file)
        with raw, stream:
            source = str(file.path)
            if file.kind == "jsonl":
                file_pieces = _jsonl_pieces(stream, source, block_bytes, max_line_bytes)
            else:
                file_pieces = _text_pieces(stream, source, block_bytes, val_fraction)
            for piece in file_pieces:
                pieces.append(piece)
                size += len(piece.data)
                if size >= block_bytes:
                    position = finished + min(raw.tell(), file.size)
                    yield Block(tuple(pieces), position - reported)
                    reported, pieces, size = position, [], 0
        finished += file.size
    if pieces or finished > reported:
        yield Block(tuple(pieces), finished - reported)
