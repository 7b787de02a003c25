"""The inputs of ``prepare-data``: which files, checked up front, read as blocks of text.

A text file is one document; a JSONL file holds one per line. A block is about
``BLOCK_BYTES`` of text: many small files, or a piece of a long one, cut where the
tokenizer's pre-tokenizer splits anyway, so that the pieces encode as the whole would.
"""

from __future__ import annotations

import codecs
import fnmatch
import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hpc_hsdp.data.tokens import DataError

BLOCK_BYTES = 1 << 20
PEEK_BYTES = 1 << 12
JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class InputFile:
    path: Path
    kind: str
    """``text`` (the file is one document) or ``jsonl`` (one document per line)."""
    compressed: bool
    size: int
    """Bytes on disk."""


def _kind_of(path: Path) -> tuple[str, bool]:
    compressed = path.suffix == ".gz"
    stem = path.with_suffix("") if compressed else path
    return ("jsonl" if stem.suffix in JSONL_SUFFIXES else "text"), compressed


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
) -> tuple[list[InputFile], int]:
    """The input files in order (each directory walked recursively, sorted, hidden names
    skipped), and how many empty files inside directories were left out. Raises DataError."""
    files: list[InputFile] = []
    skipped_empty = 0
    for given in inputs:
        path = Path(given)
        if not path.exists():
            raise DataError(f"input {given} does not exist; check the path")
        if path.is_dir():
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
                        skipped_empty += 1
                        continue
                    files.append(_checked_input(file, decode_errors))
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
    jsonl = [f for f in files if f.kind == "jsonl"]
    if jsonl and field is None:
        raise DataError(f"input {jsonl[0].path} is JSONL: say which key holds the text with --field, e.g. --field text")
    if field is not None and not jsonl:
        raise DataError(
            f"--field {field} is for JSONL inputs (.jsonl, .ndjson, .gz of them) but none was given; "
            f"leave --field out for text files"
        )
    for file in jsonl:
        _check_first_jsonl_line(file, field, max_line_bytes)
    return files, skipped_empty


def _open_binary(file: InputFile) -> tuple[IO[bytes], IO[bytes]]:
    """(the decompressed stream, the file on disk) of an input."""
    raw = open(file.path, "rb")
    return (gzip.GzipFile(fileobj=raw, mode="rb") if file.compressed else raw), raw


def _checked_input(path: Path, decode_errors: str) -> InputFile:
    """An input that exists, is readable, holds something, and (strict) starts as UTF-8 text."""
    kind, compressed = _kind_of(path)
    file = InputFile(path=path, kind=kind, compressed=compressed, size=path.stat().st_size)
    try:
        stream, raw = _open_binary(file)
        with raw, stream:
            first = stream.read(PEEK_BYTES)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(f"input {path} is not a valid gzip file ({exc}); fix or leave it out") from None
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise DataError(
            f"cannot read input {path} ({reason}); check that it is a readable{' gzip' if compressed else ''} file"
        ) from None
    if not first:
        raise DataError(f"input {path} is empty{' after decompression' if compressed else ''}; leave it out")
    if decode_errors == "strict":
        try:
            codecs.getincrementaldecoder("utf-8")().decode(first, final=False)
        except UnicodeDecodeError as exc:
            raise DataError(
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
    """Text: byte offset of ``data`` in the file; JSONL: the number of its first line."""
    ends_document: bool = True
    """Text: the document (file) ends with this piece."""
    val: bool = False
    """Text: the document belongs to the val split."""


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


def _text_pieces(stream: IO[bytes], source: str, block_bytes: int, val_fraction: float) -> Iterator[Piece]:
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
    stream: IO[bytes], source: str, block_bytes: int, max_line_bytes: int = MAX_LINE_BYTES
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


def iter_blocks(
    files: list[InputFile], *, val_fraction: float, block_bytes: int = BLOCK_BYTES, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[Block]:
    """The inputs as blocks of about ``block_bytes`` of text, in order."""
    pieces: list[Piece] = []
    size = 0
    reported = 0
    finished = 0
    for file in files:
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
