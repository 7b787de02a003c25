"""``hpc-hsdp prepare-data``: text files and JSONL in, a token dataset directory out (no torch)."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys

import click

from hpc_hsdp.data.prepare import (
    DECODE_ERRORS,
    DEFAULT_SHARD_TOKENS,
    ENGINES,
    MAX_LINE_BYTES,
    PrepareSpec,
    Progress,
    available_cores,
    prepare,
)


class _Terminated(SystemExit):
    pass


def _exit_on_sigterm(signum, frame) -> None:
    raise _Terminated(128 + signum)


def _steady_allocator() -> None:
    """glibc raises its mmap threshold to the largest block freed so far, after which the
    1 MiB text blocks come from the heap and fragment it: RSS crept up with the input size
    (43 -> 54 -> 67 MiB for 1x/4x/16x). A fixed threshold returns them to the system on
    free (40 -> 47 -> 48 MiB). Workers fork from this process and inherit it."""
    name = ctypes.util.find_library("c")
    if sys.platform.startswith("linux") and name:
        try:
            ctypes.CDLL(name).mallopt(-3, 1 << 17)  # M_MMAP_THRESHOLD = 128 KiB, fixed
        except (OSError, AttributeError):
            pass  # not glibc


@click.command("prepare-data")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option(
    "-o",
    "--output",
    required=True,
    metavar="DIR",
    help="Dataset directory to create (dataset.json, train/, val/, tokenizer/).",
)
@click.option(
    "--field",
    default=None,
    metavar="KEY",
    help="JSONL inputs: the key that holds a document's text; Parquet and datasets inputs: the column.",
)
@click.option(
    "--tokenizer",
    default="byte",
    show_default=True,
    metavar="byte|PATH",
    help="byte (UTF-8 bytes, 257 ids), or a local tokenizer.json or transformers tokenizer directory "
    "(never downloaded).",
)
@click.option(
    "--train-tokenizer",
    type=click.IntRange(min=1),
    default=None,
    metavar="VOCAB",
    help="Train a byte-level BPE of VOCAB ids on the train split (stored in DIR/tokenizer).",
)
@click.option(
    "--eos-token",
    default=None,
    metavar="TOKEN",
    help="--tokenizer PATH: the end-of-document token.  [default: from tokenizer_config.json or the vocabulary]",
)
@click.option(
    "--val-fraction",
    type=float,
    default=0.0,
    show_default=True,
    help="Share of documents held out as the val split (chosen by a hash of each document).",
)
@click.option(
    "--glob", default=None, metavar="PATTERN", help="In directories, only files whose name matches, e.g. '*.txt'."
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=None,
    help="Processes (or tokenizer threads) that encode.  [default: the usable cores]",
)
@click.option(
    "--shard-tokens",
    type=click.IntRange(min=1),
    default=DEFAULT_SHARD_TOKENS,
    show_default=True,
    help="Tokens per output shard (a shard ends at a document boundary after this many).",
)
@click.option(
    "--decode-errors",
    type=click.Choice(DECODE_ERRORS),
    default="strict",
    show_default=True,
    help="Text that is not UTF-8: stop with an error, or replace the bad bytes.",
)
@click.option(
    "--engine",
    type=click.Choice(ENGINES),
    default="auto",
    show_default=True,
    help="Encode in worker processes, or in this process with the tokenizers library's threads.",
)
@click.option(
    "--max-line-bytes",
    type=int,
    default=MAX_LINE_BYTES,
    show_default=True,
    help="JSONL inputs: the longest line (one document) read; a longer one is refused.",
)
@click.option("--force", is_flag=True, help="Replace DIR if it exists and is not empty.")
@click.option("-q", "--quiet", is_flag=True, help="No progress line.")
def prepare_data(
    inputs,
    output,
    field,
    tokenizer,
    train_tokenizer,
    eos_token,
    val_fraction,
    glob,
    workers,
    shard_tokens,
    decode_errors,
    engine,
    max_line_bytes,
    force,
    quiet,
) -> None:
    """Tokenize text into a dataset of token files for `hpc-hsdp run --data DIR`.

    INPUT: text files (one document each), JSONL files (one document per line, with
    --field), directories of them (recursive, sorted), gzip'd (.gz) or zstandard (.zst)
    ones; Parquet files (.parquet, one document per row of the --field column) and a
    datasets directory written by save_to_disk (one split's; read with pyarrow, offline).
    Parquet, datasets and .zst need the `data` extra. Each document
    ends with the end-of-document token. Output is written to DIR.tmp-XXXX and renamed
    to DIR when complete.

    \b
    hpc-hsdp prepare-data corpus/ -o data/corpus --train-tokenizer 8192 --val-fraction 0.01
    hpc-hsdp prepare-data dump.jsonl.gz --field text --tokenizer ./llama-tokenizer -o data/dump
    hpc-hsdp prepare-data fineweb/sample/ --field text --tokenizer ./llama-tokenizer -o data/web
    hpc-hsdp prepare-data book.txt -o data/book          # byte-level, no tokenizer needed
    """
    spec = PrepareSpec(
        inputs=tuple(inputs),
        output=output,
        field=field,
        tokenizer=tokenizer,
        train_tokenizer=train_tokenizer,
        eos_token=eos_token,
        val_fraction=val_fraction,
        glob=glob,
        workers=workers or available_cores(),
        shard_tokens=shard_tokens,
        decode_errors=decode_errors,
        engine=engine,
        force=force,
        max_line_bytes=max_line_bytes,
    )
    _steady_allocator()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        result = prepare(spec, progress=Progress(enabled=not quiet))
    except _Terminated:
        click.echo(f"hpc-hsdp: prepare-data terminated; {output} was not written", err=True)
        raise
    except KeyboardInterrupt:
        click.echo(f"\nhpc-hsdp: prepare-data interrupted; {output} was not written", err=True)
        sys.exit(130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    click.echo(result.summary())
