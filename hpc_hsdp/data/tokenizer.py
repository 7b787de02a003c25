"""Tokenizers for ``prepare-data``: the built-in byte-level one, a Hugging Face ``tokenizers``
file (``tokenizer.json``, alone or in a transformers tokenizer directory), and a byte-level
BPE trained on the input.

Only local files are read: a name that is neither a file nor a directory is an error,
never a download. The ``tokenizers`` library is imported only when such a tokenizer is
used; transformers and torch never are.

A tokenizer's *description* (a JSON object stored in every sidecar and in dataset.json)
says how to rebuild it; its ``path``, when there is one, is relative to the JSON file
that holds the description.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hpc_hsdp.data.tokens import DataError
from hpc_hsdp.files import read_json

BYTE = "byte"
BYTE_EOS_ID = 256
BYTE_VOCAB_SIZE = 257
BPE_EOS_TOKEN = "<|endoftext|>"
MIN_TRAINED_VOCAB = BYTE_VOCAB_SIZE + 1
MAX_TRAINED_VOCAB = 1 << 20
TOKENIZER_DIR = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
# files of a transformers tokenizer directory copied beside the data with tokenizer.json
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# end-of-document tokens of common tokenizers, in the order they are looked for
KNOWN_EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 as the end-of-document id: no files, no training."""

    vocab_size = BYTE_VOCAB_SIZE
    eos_id = BYTE_EOS_ID

    def description(self) -> dict[str, Any]:
        return {
            "kind": BYTE,
            "vocab_size": BYTE_VOCAB_SIZE,
            "eos_id": BYTE_EOS_ID,
            "about": "UTF-8 bytes as ids 0-255; 256 ends a document",
        }

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids)
        return ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def worker_state(self) -> tuple[str, Any]:
        return (BYTE, None)


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with its end-of-document id."""

    def __init__(self, tokenizer: Any, *, eos_token: str, description: dict[str, Any]):
        self._tokenizer = tokenizer
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise DataError(
                f"end-of-document token {eos_token!r} is not in the tokenizer's vocabulary; give one it "
                f"has with --eos-token"
            )
        self.eos_token = eos_token
        self.eos_id: int = eos_id
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
        self._description = {**description, "vocab_size": self.vocab_size, "eos_token": eos_token, "eos_id": eos_id}

    @property
    def library_tokenizer(self) -> Any:
        return self._tokenizer

    def description(self) -> dict[str, Any]:
        return dict(self._description)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.array(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def worker_state(self) -> tuple[str, Any]:
        return ("tokenizers", (self._tokenizer.to_str(), self.eos_token, self._description))

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._tokenizer.save(str(directory / TOKENIZER_FILE))


def tokenizer_from_worker_state(state: tuple[str, Any]) -> ByteTokenizer | HFTokenizer:
    """Rebuild a tokenizer in a worker process from ``worker_state()``."""
    kind, payload = state
    if kind == BYTE:
        return ByteTokenizer()
    from tokenizers import Tokenizer  # noqa: PLC0415 - tokenizers is an optional extra

    text, eos_token, description = payload
    return HFTokenizer(Tokenizer.from_str(text), eos_token=eos_token, description=description)


def require_tokenizers(why: str):
    try:
        import tokenizers  # noqa: PLC0415 - tokenizers is an optional extra
    except ImportError:
        raise DataError(
            f"{why} needs the `tokenizers` library, which is not installed; install it with "
            f"pip install 'hpc-hsdp[data]', or use --tokenizer byte"
        ) from None
    return tokenizers


# ---------------------------------------------------------------------------- a tokenizer file


def tokenizer_json_of(path_text: str) -> Path:
    """The ``tokenizer.json`` that ``--tokenizer PATH`` names; DataError when there is none
    (a hub name is refused: nothing is ever downloaded)."""
    path = Path(path_text).expanduser()
    if path.is_dir():
        candidate = path / TOKENIZER_FILE
        if not candidate.is_file():
            slow = [p.name for p in path.iterdir() if p.suffix in (".model", ".vocab") or p.name == "vocab.json"]
            hint = (
                (
                    f" (it has {', '.join(sorted(slow))}: a slow tokenizer; save it as tokenizer.json with "
                    f"transformers' AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
                )
                if slow
                else ""
            )
            raise DataError(
                f"--tokenizer {path_text}: the directory has no {TOKENIZER_FILE}{hint}; give a "
                f"directory with a tokenizer.json, the file itself, or --tokenizer byte"
            )
        return candidate
    if path.is_file():
        return path
    if not path_text.startswith((".", "/", "~")) and _HUB_NAME.match(path_text) and not path.suffix == ".json":
        raise DataError(
            f"--tokenizer {path_text}: no such file or directory, and prepare-data never downloads "
            f"from the Hugging Face Hub; download it first (huggingface-cli download {path_text} "
            f"--local-dir DIR) and give DIR"
        )
    raise DataError(
        f"--tokenizer {path_text}: no such file or directory; give a tokenizer.json, a tokenizer "
        f"directory, or --tokenizer byte"
    )


MAX_CONFIG_BYTES = 64 << 20
"""The most a tokenizer's companion file (its config, its special tokens) may hold."""


def _eos_from_config(directory: Path) -> str | None:
    for name in COMPANION_FILES:
        config = directory / name
        if not config.is_file():
            continue
        try:
            companion: Any = read_json(config.resolve(), max_bytes=MAX_CONFIG_BYTES)
            value = companion.get("eos_token")  # of another shape: the AttributeError below
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str) and value:
            return value
    return None


def _eos_from_vocabulary(tokenizer: Any) -> str | None:
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    for token in KNOWN_EOS_TOKENS:
        if token in added:
            return token
    for token in KNOWN_EOS_TOKENS:
        if tokenizer.token_to_id(token) is not None:
            return token
    return None


def load_tokenizer_file(path_text: str, *, eos_token: str | None = None) -> HFTokenizer:
    """``--tokenizer PATH``: load the tokenizer.json with the ``tokenizers`` library and find
    its end-of-document token (``--eos-token``, the directory's tokenizer_config.json, or a
    well-known special token)."""
    file = tokenizer_json_of(path_text)
    tokenizers = require_tokenizers(f"--tokenizer {path_text}")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # the library raises its own exception types
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"--tokenizer {path_text}: {file} is not a tokenizers file ({first_line}); give a "
            f"tokenizer.json saved by the tokenizers or transformers library"
        ) from None
    eos = eos_token or _eos_from_config(file.parent) or _eos_from_vocabulary(tokenizer)
    if eos is None:
        raise DataError(
            f"--tokenizer {path_text}: found no end-of-document token (tried tokenizer_config.json and "
            f"{', '.join(KNOWN_EOS_TOKENS)}); name it with --eos-token TOKEN"
        )
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    description = {
        "kind": "tokenizers",
        "source": str(file.resolve()),
        "sha256": digest,
        "path": f"{TOKENIZER_DIR}/{TOKENIZER_FILE}",
    }
    return HFTokenizer(tokenizer, eos_token=eos, description=description)


def copy_tokenizer_files(path_text: str, destination: Path) -> None:
    """Copy tokenizer.json (and a transformers directory's configs) to ``destination``."""
    file = tokenizer_json_of(path_text)
    destination.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(file, destination / TOKENIZER_FILE)
    for name in COMPANION_FILES:
        if (file.parent / name).is_file():
            shutil.copyfile(file.parent / name, destination / name)


# ---------------------------------------------------------------------------- a trained BPE


def check_trained_vocab(vocab_size: int) -> None:
    if not MIN_TRAINED_VOCAB <= vocab_size <= MAX_TRAINED_VOCAB:
        raise DataError(
            f"--train-tokenizer {vocab_size}: a byte-level BPE needs {MIN_TRAINED_VOCAB} to "
            f"{MAX_TRAINED_VOCAB} ids (256 bytes, the end-of-document token, merges); give e.g. "
            f"--train-tokenizer 8192"
        )


def train_bpe(texts: Iterable[str], *, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style pre-tokenization, every byte in the alphabet, so any
    text encodes) trained on ``texts`` with the ``tokenizers`` library; id 0 is <|endoftext|>."""
    check_trained_vocab(vocab_size)
    tokenizers = require_tokenizers(f"--train-tokenizer {vocab_size}")
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415 - tokenizers is an optional extra

    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BPE_EOS_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer)
    description = {
        "kind": "bpe-trained",
        "path": f"{TOKENIZER_DIR}/{TOKENIZER_FILE}",
        "requested_vocab": vocab_size,
        "about": "byte-level BPE trained by prepare-data on the train split",
    }
    return HFTokenizer(tokenizer, eos_token=BPE_EOS_TOKEN, description=description)


# ---------------------------------------------------------------------------- reading it back


def load_dataset_tokenizer(description: dict[str, Any], base: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a dataset was made with, from its description; ``base`` is the
    directory of the JSON file that holds it (``ds.tokenizer_base``)."""
    kind = description.get("kind")
    if kind == BYTE:
        return ByteTokenizer()
    if kind in ("tokenizers", "bpe-trained") and description.get("path"):
        file = Path(base) / description["path"]
        if not file.is_file():
            raise DataError(
                f"the dataset's tokenizer {file} is missing; copy the dataset's tokenizer/ directory with it"
            )
        tokenizers = require_tokenizers("decoding this dataset")
        return HFTokenizer(
            tokenizers.Tokenizer.from_file(str(file)), eos_token=description["eos_token"], description=description
        )
    raise DataError(f"cannot rebuild a tokenizer from {description!r}; it was not written by prepare-data")
