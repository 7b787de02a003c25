"""Helpers shared by tests (moved out of tests/fast/test_data_tokens.py: no test module imports another)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpc_hsdp.data.tokens import (
    token_dtype_for,
    write_dataset_manifest,
    write_token_file,
)

EOS = 99


BYTE_TOKENIZER = {"kind": "byte"}


def documents(seed: int, count: int, vocab: int = 99) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(0, vocab, rng.integers(1, 40)), EOS) for _ in range(count)]


def make_dataset(root: Path, *, shards: dict[str, list[list[np.ndarray]]], vocab_size: int = 100) -> Path:
    """A dataset directory as prepare-data writes it: per split, shards of documents."""
    splits: dict[str, list[str]] = {}
    for split, split_shards in shards.items():
        (root / split).mkdir(parents=True)
        splits[split] = []
        for i, docs in enumerate(split_shards):
            name = f"{split}/{i:05d}.bin"
            write_token_file(
                root / name,
                np.concatenate(docs),
                vocab_size=vocab_size,
                tokenizer=BYTE_TOKENIZER,
                eos_id=EOS,
                document_lengths=[len(d) for d in docs],
            )
            splits[split].append(name)
    write_dataset_manifest(
        root, vocab_size=vocab_size, dtype=token_dtype_for(vocab_size), tokenizer=BYTE_TOKENIZER, splits=splits
    )
    return root
