"""``hpc-hsdp prepare-data``: text in, a token dataset directory out.

The pipeline streams: the input is read in blocks of about a MiB of text (many small
files, or pieces of a large one cut at line breaks), each block is encoded into the
token dtype (by a pool of worker processes, or in this process by the ``tokenizers``
library's own threads), and the blocks are appended, in input order, to the shards of
the train and val splits. Memory holds a bounded number of blocks, whatever the input's
size. Every document ends with the end-of-document token; a document's split is decided
by a hash of its text, so it does not depend on the order, the block size or the workers.

Everything a user can get wrong is checked before the first byte is written; the output
is built in ``DIR.tmp-XXXX`` and renamed to ``DIR`` only when it is complete.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import signal
import threading
import time
from collections import deque
from collections.abc import Generator, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, TypedDict

import numpy as np

from hpc_hsdp._version import __version__
from hpc_hsdp.data.inputs import (
    BLOCK_BYTES,
    MAX_LINE_BYTES,
    Block,
    InputFile,
    discover_inputs,
    is_val,
    iter_blocks,
    jsonl_text,
)
from hpc_hsdp.data.progress import Progress
from hpc_hsdp.data.tokenizer import (
    BYTE,
    TOKENIZER_DIR,
    ByteTokenizer,
    HFTokenizer,
    check_trained_vocab,
    copy_tokenizer_files,
    load_tokenizer_file,
    require_tokenizers,
    tokenizer_from_worker_state,
    train_bpe,
)
from hpc_hsdp.data.tokens import (
    DATASET_MANIFEST,
    TOKEN_DTYPES,
    DataError,
    TokenFileWriter,
    token_dtype_for,
    write_dataset_manifest,
)
from hpc_hsdp.plan.units import human_bytes, human_count

DEFAULT_SHARD_TOKENS = 100_000_000
SPLITS = ("train", "val")
ENGINES = ("auto", "processes", "threads")
DECODE_ERRORS = ("strict", "replace")
FAULT_SIGNAL = "HPC_HSDP_FAULT_PREPARE_SIGNAL"
"""Test hook: ``<blocks>:<SIGNAL>``; the run sends itself SIGNAL after writing that many blocks."""


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class PrepareSpec:
    """What ``hpc-hsdp prepare-data`` was asked to do."""

    inputs: tuple[str, ...]
    """Text files, JSONL files (``--field``), directories of them (recursive), any of them gzip'd
    or zstandard-compressed; Parquet files (``--field``: the text column) and ``datasets``
    directories written by ``save_to_disk`` (one split's)."""
    output: str
    """The dataset directory to create."""
    field: str | None = None
    """The JSONL key, or the Parquet or datasets column, that holds a document's text."""
    tokenizer: str = BYTE
    """``byte``, or a tokenizer.json / transformers tokenizer directory."""
    train_tokenizer: int | None = None
    """Train a byte-level BPE of this many ids on the input instead."""
    eos_token: str | None = None
    val_fraction: float = 0.0
    glob: str | None = None
    """In directories, only files whose name matches (e.g. ``*.txt``)."""
    workers: int = dataclass_field(default_factory=available_cores)
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    decode_errors: str = "strict"
    engine: str = "auto"
    force: bool = False
    max_line_bytes: int = MAX_LINE_BYTES
    """The longest JSONL line read; a longer one is refused (memory stays bounded)."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise DataError("prepare-data needs at least one INPUT (a text or JSONL file, or a directory of them)")
        if not isinstance(self.val_fraction, (int, float)) or not 0.0 <= self.val_fraction < 1.0:
            raise DataError(
                f"--val-fraction {self.val_fraction} is outside [0, 1); give the held-out share of "
                f"documents, e.g. --val-fraction 0.01"
            )
        if isinstance(self.max_line_bytes, bool) or not isinstance(self.max_line_bytes, int) or self.max_line_bytes < 1:
            raise DataError(f"--max-line-bytes {self.max_line_bytes}: give a positive number of bytes")
        if self.workers < 1:
            raise DataError(f"--workers {self.workers}: give at least 1")
        if self.shard_tokens < 1:
            raise DataError(f"--shard-tokens {self.shard_tokens}: give at least 1, e.g. --shard-tokens 100000000")
        if self.train_tokenizer is not None:
            if self.tokenizer != BYTE:
                raise DataError(f"--train-tokenizer and --tokenizer {self.tokenizer} exclude each other; give one")
            check_trained_vocab(self.train_tokenizer)
        if self.decode_errors not in DECODE_ERRORS:
            raise DataError(f"--decode-errors {self.decode_errors!r}: give one of {', '.join(DECODE_ERRORS)}")
        if self.engine not in ENGINES:
            raise DataError(f"--engine {self.engine!r}: give one of {', '.join(ENGINES)}")
        if self.field is not None and not self.field:
            raise DataError("--field is empty; give the JSONL key that holds the text, e.g. --field text")


# ---------------------------------------------------------------------------- encoding a block


@dataclass(frozen=True)
class EncodedBlock:
    """A block's tokens, per split, in the output dtype, end-of-document tokens in place."""

    tokens: dict[str, np.ndarray]
    lengths: dict[str, np.ndarray]
    """Per split: the tokens in this block of each document that ends in it."""
    continues: dict[str, bool]
    """Per split: the block ends inside a document (a long text continued by the next)."""
    documents: int
    empty_documents: int
    text_bytes: int
    disk_bytes: int

    @property
    def num_tokens(self) -> int:
        return sum(t.size for t in self.tokens.values())


class EncoderSettings(TypedDict):
    """A :class:`BlockEncoder`'s keyword arguments, as a worker process receives them."""

    field: str | None
    val_fraction: float
    decode_errors: str
    dtype: str


class BlockEncoder:
    """Block -> EncodedBlock: decode, parse, split, tokenize (one batch per block)."""

    def __init__(
        self,
        tokenizer: ByteTokenizer | HFTokenizer,
        *,
        field: str | None,
        val_fraction: float,
        decode_errors: str,
        dtype: str,
    ):
        self.tokenizer = tokenizer
        self.field = field
        self.val_fraction = val_fraction
        self.decode_errors = decode_errors
        self.dtype = TOKEN_DTYPES[dtype]

    def documents(self, block: Block) -> tuple[list[str], list[bool], list[bool], int]:
        """(texts, is-val of each, ends-a-document of each, empty JSONL documents left out)."""
        texts: list[str] = []
        vals: list[bool] = []
        ends: list[bool] = []
        empty = 0
        for piece in block.pieces:
            if piece.kind == "text":
                try:
                    texts.append(piece.data.decode("utf-8", errors=self.decode_errors))
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"input {piece.source} is not UTF-8 text (byte {piece.start + exc.start} is "
                        f"{piece.data[exc.start : exc.start + 1]!r}); leave it out (e.g. with --glob) or "
                        f"pass --decode-errors replace"
                    ) from None
                vals.append(piece.val)
                ends.append(piece.ends_document)
                continue
            if piece.kind == "rows":  # Parquet or Arrow: the column's UTF-8 texts, one after the other
                position = 0
                for number, length in enumerate(piece.lengths, start=piece.start):
                    data = piece.data[position : position + length]
                    position += length
                    if not length:
                        empty += 1
                        continue
                    try:
                        text = data.decode("utf-8", errors=self.decode_errors)
                    except UnicodeDecodeError:
                        raise DataError(
                            f"input {piece.source} row {number} is not UTF-8 text; pass --decode-errors replace"
                        ) from None
                    texts.append(text)
                    vals.append(is_val(text.encode("utf-8", errors="surrogatepass"), self.val_fraction))
                    ends.append(True)
                continue
            for number, line in enumerate(piece.data.split(b"\n"), start=piece.start):
                if not line.strip():
                    continue
                text = jsonl_text(line, self.field, piece.source, number)
                if not text:
                    empty += 1
                    continue
                texts.append(text)
                vals.append(is_val(text.encode("utf-8", errors="surrogatepass"), self.val_fraction))
                ends.append(True)
        return texts, vals, ends, empty

    def __call__(self, block: Block) -> EncodedBlock:
        texts, vals, ends, empty = self.documents(block)
        ids = self.tokenizer.encode_batch(texts) if texts else []
        eos = self.tokenizer.eos_id
        tokens: dict[str, np.ndarray] = {}
        lengths: dict[str, np.ndarray] = {}
        continues: dict[str, bool] = {}
        for split in SPLITS:
            chosen = [i for i, val in enumerate(vals) if val == (split == "val")]
            out = np.empty(sum(ids[i].size + ends[i] for i in chosen), dtype=self.dtype)
            split_lengths: list[int] = []
            position = 0
            open_tokens = 0
            for i in chosen:
                piece = ids[i]
                out[position : position + piece.size] = piece
                position += piece.size
                open_tokens += piece.size
                if ends[i]:
                    out[position] = eos
                    position += 1
                    split_lengths.append(open_tokens + 1)
                    open_tokens = 0
            tokens[split] = out
            lengths[split] = np.asarray(split_lengths, dtype=np.int64)
            continues[split] = bool(chosen) and not ends[chosen[-1]]
        return EncodedBlock(
            tokens=tokens,
            lengths=lengths,
            continues=continues,
            documents=sum(ends),
            empty_documents=empty,
            text_bytes=sum(len(p.data) for p in block.pieces),
            disk_bytes=block.disk_bytes,
        )


_WORKER_ENCODER: BlockEncoder | None = None


def _init_worker(tokenizer_state: tuple[str, Any], settings: EncoderSettings, parent_pid: int) -> None:
    global _WORKER_ENCODER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _WORKER_ENCODER = BlockEncoder(tokenizer_from_worker_state(tokenizer_state), **settings)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()


def _exit_with_parent(parent_pid: int) -> None:
    while True:  # a parent killed with SIGKILL cannot stop its pool; the workers notice
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(1)


def _encode_in_worker(block: Block) -> EncodedBlock:
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER(block)


def _encode_in_processes(
    blocks: Iterator[Block], encoder: BlockEncoder, workers: int, settings: EncoderSettings
) -> Generator[EncodedBlock, None, None]:
    """Blocks encoded by ``workers`` processes, in order, at most 2 per worker in flight."""
    with _tokenizers_parallelism_off():  # the fork happens here; workers encode on one thread each
        pool = ProcessPoolExecutor(
            workers,
            mp_context=_worker_context(),
            initializer=_init_worker,
            initargs=(encoder.tokenizer.worker_state(), settings, os.getpid()),
        )
        try:
            pool.submit(time.sleep, 0).result()  # start the workers now, inside the context
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    try:
        pending: deque = deque()
        for block in blocks:
            pending.append(pool.submit(_encode_in_worker, block))
            while len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BrokenProcessPool:
        raise RuntimeError("a prepare-data worker process died (out of memory?); try fewer --workers") from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _worker_context() -> multiprocessing.context.BaseContext:
    # fork: a worker needs no re-import of the caller's __main__ (spawn would run a script's
    # or a REPL's main again); the tokenizers library makes forking after its threads safe
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


@contextmanager
def _tokenizers_parallelism_off() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM=false while the workers fork (silences the library's fork
    warning and keeps each worker on one thread); restored afterwards."""
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


class _ReaderFailed:
    def __init__(self, error: BaseException):
        self.error = error


def _prefetched(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """``items`` produced by a background thread, at most ``depth`` ahead."""
    done = object()
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put(item):
                    return
        except BaseException as exc:  # handed to the consumer
            put(_ReaderFailed(exc))
        finally:
            put(done)

    thread = threading.Thread(target=produce, name="prepare-data-reader", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is done:
                return
            if isinstance(item, _ReaderFailed):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()


@contextmanager
def _library_threads(workers: int) -> Iterator[None]:
    """The tokenizers library's thread pool size for this process (read when it starts)."""
    previous = os.environ.get("RAYON_NUM_THREADS")
    if previous is None:
        os.environ["RAYON_NUM_THREADS"] = str(workers)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("RAYON_NUM_THREADS", None)


def _encode_in_threads(
    blocks: Iterator[Block], encoder: BlockEncoder, workers: int
) -> Generator[EncodedBlock, None, None]:
    with _library_threads(workers):
        for block in _prefetched(blocks):
            yield encoder(block)


def choose_engine(spec: PrepareSpec) -> str:
    if spec.engine != "auto":
        return spec.engine
    return "processes" if spec.workers > 1 else "threads"


# ---------------------------------------------------------------------------- output


class SplitWriter:
    """One split's shards: ``DIR/<split>/00000.bin`` and on, each about ``shard_tokens``."""

    def __init__(
        self,
        root: Path,
        split: str,
        *,
        vocab_size: int,
        dtype: str,
        eos_id: int,
        tokenizer: dict[str, Any],
        shard_tokens: int,
    ):
        self.root = root
        self.split = split
        self.vocab_size = vocab_size
        self.dtype = dtype
        self.eos_id = eos_id
        self.tokenizer = dict(tokenizer)
        if "path" in self.tokenizer:  # relative to the sidecar, one level below the dataset
            self.tokenizer["path"] = f"../{self.tokenizer['path']}"
        self.shard_tokens = shard_tokens
        self.shards: list[str] = []
        self.num_tokens = 0
        self.num_documents = 0
        self._writer: TokenFileWriter | None = None

    def append(self, tokens: np.ndarray, lengths: np.ndarray, continues: bool) -> None:
        """Append a chunk (see TokenFileWriter.append); a shard ends with the first document
        that brings it to ``shard_tokens``."""
        ends = np.cumsum(lengths)
        while tokens.size or lengths.size:
            if self._writer is None:
                self._open_shard()
            assert self._writer is not None
            room = self.shard_tokens - self._writer.num_tokens
            last = int(np.searchsorted(ends, room, side="left"))  # the document that fills the shard
            if last >= lengths.size:
                self._writer.append(tokens, lengths, continues=continues)
                return
            cut = int(ends[last])
            self._writer.append(tokens[:cut], lengths[: last + 1])
            self._finish_shard()
            tokens, lengths, ends = tokens[cut:], lengths[last + 1 :], ends[last + 1 :] - cut

    def _open_shard(self) -> None:
        name = f"{self.split}/{len(self.shards):05d}.bin"
        (self.root / self.split).mkdir(exist_ok=True)
        self._writer = TokenFileWriter(
            self.root / name,
            vocab_size=self.vocab_size,
            tokenizer=self.tokenizer,
            eos_id=self.eos_id,
            dtype=self.dtype,
            extra={"split": self.split},
        )
        self.shards.append(name)

    def _finish_shard(self) -> None:
        assert self._writer is not None
        info = self._writer.close()
        self.num_tokens += info.num_tokens
        self.num_documents += info.num_documents
        self._writer = None

    def close(self) -> None:
        if self._writer is not None:
            self._finish_shard()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()
            self._writer = None


def _check_output(spec: PrepareSpec, files: list[InputFile]) -> Path:
    output = Path(spec.output).expanduser()
    if output.exists() and not output.is_dir():
        raise DataError(f"-o {spec.output} is a file; give a directory to create")
    if output.is_dir() and any(output.iterdir()):
        if not spec.force:
            raise DataError(
                f"-o {spec.output} exists and is not empty; choose a new directory, or add --force to replace it"
            )
        if not (output / DATASET_MANIFEST).is_file():
            raise DataError(
                f"-o {spec.output} is not a dataset written by prepare-data (no {DATASET_MANIFEST}); "
                f"--force replaces only those: choose a new directory"
            )
    resolved = output.resolve()
    for given in spec.inputs:
        folder = Path(given).resolve()
        if folder.is_dir() and (resolved == folder or folder in resolved.parents):
            raise DataError(f"-o {spec.output} lies inside input directory {given}; write the dataset elsewhere")
    parent = resolved.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DataError(f"-o {spec.output}: cannot create it in {parent} (not writable); choose another directory")
    return output


def _publish(tmp: Path, output: Path) -> None:
    """Rename the finished ``tmp`` to ``output``, replacing what ``--force`` allowed."""
    if output.exists():
        old = output.with_name(f"{output.name}.old-{os.urandom(3).hex()}")
        os.rename(output, old)
        os.rename(tmp, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, output)


def _fault_after_blocks() -> tuple[int, int] | None:
    value = os.environ.get(FAULT_SIGNAL, "").strip()
    if not value:
        return None
    blocks, _, name = value.partition(":")
    return int(blocks), int(getattr(signal, f"SIG{name.upper().removeprefix('SIG')}"))


# ---------------------------------------------------------------------------- the whole run


@dataclass(frozen=True)
class PrepareResult:
    output: Path
    tokenizer: dict[str, Any]
    vocab_size: int
    dtype: str
    num_tokens: dict[str, int]
    num_documents: dict[str, int]
    shards: dict[str, list[str]]
    input_files: int
    input_bytes: int
    text_bytes: int
    empty_documents: int
    skipped_files: dict[str, int]
    """Files inside input directories left out: ``{"empty": n, "binary": m}``."""
    engine: str
    seconds: float

    def summary(self) -> str:
        splits = "; ".join(
            f"{split} {self.num_tokens[split]:,} tokens in {self.num_documents[split]:,} documents "
            f"({len(self.shards[split])} shard{'s' * (len(self.shards[split]) != 1)})"
            for split in SPLITS
            if self.shards[split]
        )
        rate = sum(self.num_tokens.values()) / max(self.seconds, 1e-9)
        left_out = ", ".join(f"{n} {kind}" for kind, n in self.skipped_files.items() if n)
        return (
            f"wrote {self.output}: {splits}; tokenizer {self.tokenizer.get('kind')} ({self.vocab_size} ids, "
            f"{self.dtype}); {self.input_files} input files"
            + (f" (left out of the directories: {left_out})" if left_out else "")
            + f", {human_bytes(self.text_bytes)} of text in {self.seconds:.1f} s ({human_count(rate)} tokens/s)"
        )


def prepare(spec: PrepareSpec, *, progress: Progress | None = None, block_bytes: int = BLOCK_BYTES) -> PrepareResult:
    """Run prepare-data. Raises DataError before writing anything for every input it can
    check up front; on any later failure the half-built directory is removed."""
    began = time.monotonic()
    progress = progress or Progress(enabled=False)
    files, skipped_files = discover_inputs(
        spec.inputs,
        glob=spec.glob,
        field=spec.field,
        decode_errors=spec.decode_errors,
        max_line_bytes=spec.max_line_bytes,
    )
    tokenizer = _given_tokenizer(spec)
    output = _check_output(spec, files)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}-{os.urandom(3).hex()}")
    tmp.mkdir()
    writers: dict[str, SplitWriter] = {}
    encoded_blocks: Generator[EncodedBlock, None, None] | None = None
    published = False
    total_disk = sum(f.size for f in files)
    engine = choose_engine(spec)
    try:
        if tokenizer is None:
            assert spec.train_tokenizer is not None  # _given_tokenizer gives None only for it
            progress.start("training tokenizer", total_disk)
            tokenizer = train_bpe(_training_texts(files, spec, progress, block_bytes), vocab_size=spec.train_tokenizer)
            progress.finish()
            tokenizer.save(tmp / TOKENIZER_DIR)
        elif isinstance(tokenizer, HFTokenizer):
            copy_tokenizer_files(spec.tokenizer, tmp / TOKENIZER_DIR)
        description = tokenizer.description()
        dtype = token_dtype_for(tokenizer.vocab_size)
        writers = {
            split: SplitWriter(
                tmp,
                split,
                vocab_size=tokenizer.vocab_size,
                dtype=dtype,
                eos_id=tokenizer.eos_id,
                tokenizer=description,
                shard_tokens=spec.shard_tokens,
            )
            for split in SPLITS
        }
        settings: EncoderSettings = {
            "field": spec.field,
            "val_fraction": spec.val_fraction,
            "decode_errors": spec.decode_errors,
            "dtype": dtype,
        }
        encoder = BlockEncoder(tokenizer, **settings)
        blocks = iter_blocks(
            files,
            val_fraction=spec.val_fraction,
            block_bytes=block_bytes,
            max_line_bytes=spec.max_line_bytes,
            field=spec.field,
        )
        if engine == "processes":
            encoded_blocks = _encode_in_processes(blocks, encoder, spec.workers, settings)
        else:
            encoded_blocks = _encode_in_threads(blocks, encoder, spec.workers)
        progress.start("tokenizing", total_disk)
        text_bytes, empty_documents = _write_blocks(encoded_blocks, writers, progress)
        progress.finish()
        _check_splits(writers, spec)
        shards = {split: writers[split].shards for split in SPLITS}
        num_tokens = {split: writers[split].num_tokens for split in SPLITS}
        num_documents = {split: writers[split].num_documents for split in SPLITS}
        write_dataset_manifest(
            tmp,
            vocab_size=tokenizer.vocab_size,
            dtype=dtype,
            tokenizer=description,
            splits={split: names for split, names in shards.items() if names},
            extra={
                "eos_id": tokenizer.eos_id,
                "num_tokens": num_tokens,
                "num_documents": num_documents,
                "val_fraction": spec.val_fraction,
                "inputs": list(spec.inputs),
                "input_files": len(files),
                "created_by": f"hpc-hsdp {__version__} prepare-data",
            },
        )
        _publish(tmp, output)
        published = True
    finally:
        if encoded_blocks is not None:
            encoded_blocks.close()  # stops the worker pool or the reader thread now, not at garbage collection
        if not published:
            for writer in writers.values():
                writer.abort()
            shutil.rmtree(tmp, ignore_errors=True)
    return PrepareResult(
        output=output,
        tokenizer=description,
        vocab_size=tokenizer.vocab_size,
        dtype=dtype,
        num_tokens=num_tokens,
        num_documents=num_documents,
        shards=shards,
        input_files=len(files),
        input_bytes=total_disk,
        text_bytes=text_bytes,
        empty_documents=empty_documents,
        skipped_files=skipped_files,
        engine=engine,
        seconds=time.monotonic() - began,
    )


def _given_tokenizer(spec: PrepareSpec) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer ``--tokenizer`` names, checked; None when one is trained on the input."""
    if spec.train_tokenizer is not None:
        if spec.eos_token is not None:
            raise DataError("--eos-token is for --tokenizer PATH; a trained tokenizer's is <|endoftext|>: leave it out")
        require_tokenizers(f"--train-tokenizer {spec.train_tokenizer}")
        return None
    if spec.tokenizer == BYTE:
        if spec.eos_token is not None:
            raise DataError("--eos-token is for --tokenizer PATH; the byte tokenizer's is id 256: leave it out")
        return ByteTokenizer()
    return load_tokenizer_file(spec.tokenizer, eos_token=spec.eos_token)


def _write_blocks(
    encoded_blocks: Iterator[EncodedBlock], writers: dict[str, SplitWriter], progress: Progress
) -> tuple[int, int]:
    """Append every encoded block to its splits' writers, in input order, and close them;
    returns (text bytes, empty documents)."""
    fault = _fault_after_blocks()
    text_bytes = empty_documents = 0
    for count, encoded in enumerate(encoded_blocks, start=1):
        for split in SPLITS:
            writers[split].append(encoded.tokens[split], encoded.lengths[split], encoded.continues[split])
        text_bytes += encoded.text_bytes
        empty_documents += encoded.empty_documents
        progress.update(disk_bytes=encoded.disk_bytes, text_bytes=encoded.text_bytes, tokens=encoded.num_tokens)
        if fault is not None and count == fault[0]:
            os.kill(os.getpid(), fault[1])
    for writer in writers.values():
        writer.close()
    return text_bytes, empty_documents


def _check_splits(writers: dict[str, SplitWriter], spec: PrepareSpec) -> None:
    if not writers["train"].num_documents:
        raise DataError(
            f"no document went to the train split ({writers['val'].num_documents} went to val); "
            f"lower --val-fraction or give more input"
        )
    if spec.val_fraction > 0 and not writers["val"].num_documents:
        raise DataError(
            f"--val-fraction {spec.val_fraction} chose none of the {writers['train'].num_documents} "
            f"documents for the val split; raise it or give more documents"
        )


def _training_texts(files: list[InputFile], spec: PrepareSpec, progress: Progress, block_bytes: int) -> Iterator[str]:
    """The train split's texts, streamed, for training the tokenizer."""
    parser = BlockEncoder(
        ByteTokenizer(),
        field=spec.field,
        val_fraction=spec.val_fraction,
        decode_errors=spec.decode_errors,
        dtype="uint16",
    )
    for block in _prefetched(
        iter_blocks(
            files,
            val_fraction=spec.val_fraction,
            block_bytes=block_bytes,
            max_line_bytes=spec.max_line_bytes,
            field=spec.field,
        )
    ):
        texts, vals, _, _ = parser.documents(block)
        progress.update(disk_bytes=block.disk_bytes, text_bytes=sum(len(p.data) for p in block.pieces))
        yield from (text for text, val in zip(texts, vals) if not val)
