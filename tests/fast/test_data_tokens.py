"""The token-file format: writing, reading across shards, and every bad input as one DataError line."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from hpc_hsdp.data.tokens import (
    DataError,
    TokenDataset,
    TokenFileWriter,
    check_for_training,
    open_dataset,
    open_eval_dataset,
    token_dtype_for,
    write_token_file,
)
from hpc_hsdp.errors import SpecError
from tests.data_helpers import BYTE_TOKENIZER, EOS, documents, make_dataset


@pytest.mark.parametrize(
    ("vocab", "dtype"), [(1, "uint16"), (256, "uint16"), (65536, "uint16"), (65537, "uint32"), (151_936, "uint32")]
)
def test_dtype_is_the_smallest_that_holds_the_vocabulary(vocab, dtype):
    assert token_dtype_for(vocab) == dtype


def test_one_file_round_trip_and_sidecar(tmp_path):
    tokens = np.array([5, 70000, 3, EOS, 8, EOS, 1], dtype=np.int64)
    info = write_token_file(tmp_path / "a.bin", tokens, vocab_size=70001, tokenizer={"kind": "x"}, eos_id=EOS)
    assert info.dtype == "uint32" and info.num_tokens == 7 and info.num_documents == 3 and info.max_token_id == 70000
    sidecar = json.loads((tmp_path / "a.json").read_text())
    assert sidecar["format"] == "hpc-hsdp-tokens" and sidecar["version"] == 1 and sidecar["eos_id"] == EOS
    assert sidecar["tokenizer"] == {"kind": "x"} and sidecar["document_index"] == "a.idx"
    assert (tmp_path / "a.bin").stat().st_size == 7 * 4
    # the raw file is what nanoGPT's np.memmap reads
    assert np.fromfile(tmp_path / "a.bin", dtype="<u4").tolist() == tokens.tolist()
    ds = open_dataset(tmp_path / "a.bin")
    assert (ds.num_tokens, ds.vocab_size, ds.dtype, ds.eos_id, ds.max_token_id) == (7, 70001, np.uint32, EOS, 70000)
    assert ds.read(0, 7).tolist() == tokens.tolist() and ds.read(2, 3).tolist() == [3, EOS, 8]
    assert ds.document_offsets().tolist() == [0, 4, 6, 7]
    assert [f.name for f in tmp_path.iterdir() if ".tmp" in f.name] == []
    # the sidecar path opens the same file
    assert open_dataset(tmp_path / "a.json").read(0, 7).tolist() == tokens.tolist()


def test_reads_across_shards_equal_the_concatenation(tmp_path):
    shards = [documents(1, 3), documents(2, 1), documents(3, 5)]
    make_dataset(tmp_path / "ds", shards={"train": shards, "val": [documents(4, 2)]})
    everything = np.concatenate([np.concatenate(s) for s in shards])
    ds = open_dataset(tmp_path / "ds")
    assert ds.num_tokens == everything.size and ds.num_documents == 9 and ds.dtype == np.uint16
    rng = np.random.default_rng(0)
    for _ in range(300):
        start = int(rng.integers(0, everything.size))
        length = int(rng.integers(0, everything.size - start + 1))
        assert ds.read(start, length).tolist() == everything[start : start + length].tolist()
    assert ds.read(0, everything.size).tolist() == everything.tolist()
    assert ds.read(everything.size, 0).size == 0
    offsets = ds.document_offsets()
    assert offsets[-1] == everything.size and (everything[offsets[1:] - 1] == EOS).all()
    for bad in [(-1, 2), (0, everything.size + 1), (everything.size, 1)]:
        with pytest.raises(IndexError):
            ds.read(*bad)
    # pickles without its maps (a background loader), and reads the same after
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.read(5, 50).tolist() == everything[5:55].tolist()
    val = open_dataset(tmp_path / "ds", split="val")
    assert val.num_tokens == sum(len(d) for d in documents(4, 2)) and val.split == "val"
    assert open_eval_dataset(tmp_path / "ds").num_tokens == val.num_tokens
    # a directory of shards without a manifest is a dataset too
    assert open_dataset(tmp_path / "ds" / "train").read(0, everything.size).tolist() == everything.tolist()


def test_writer_appends_chunks_and_leaves_nothing_on_abort(tmp_path):
    docs = documents(7, 10)
    with TokenFileWriter(tmp_path / "w.bin", vocab_size=100, eos_id=EOS) as writer:
        writer.append(np.concatenate(docs[:4]), [len(d) for d in docs[:4]])
        writer.append(np.concatenate(docs[4:]), [len(d) for d in docs[4:]])
        assert not (tmp_path / "w.bin").exists() and not (tmp_path / "w.json").exists()
    assert open_dataset(tmp_path / "w.bin").read(0, sum(map(len, docs))).tolist() == np.concatenate(docs).tolist()
    with pytest.raises(RuntimeError), TokenFileWriter(tmp_path / "x.bin", vocab_size=100) as writer:
        writer.append(np.arange(10), [10])
        raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.bin", "w.idx", "w.json"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write_token_file(tmp_path / "y.bin", [1, 100], vocab_size=100)
    assert not list(tmp_path.glob("y.*"))


# --------------------------------------------------------------------------- bad input, one table


def _good(tmp_path: Path, tokens=(1, 2, 3, EOS, 4, 5, EOS), vocab=100) -> Path:
    write_token_file(tmp_path / "d.bin", np.array(tokens), vocab_size=vocab, tokenizer=BYTE_TOKENIZER, eos_id=EOS)
    return tmp_path / "d.bin"


def _edit_sidecar(path: Path, **changes) -> Path:
    side = path.with_suffix(".json")
    data = json.loads(side.read_text())
    data.update(changes)
    side.write_text(json.dumps(data))
    return path


def _truncate(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:-1])
    return path


def _cut_to_whole_token(path: Path) -> Path:
    path.write_bytes(path.read_bytes()[:-2])
    return path


def _remove_sidecar(path: Path) -> Path:
    path.with_suffix(".json").unlink()
    return path


def _empty(path: Path) -> Path:
    path.write_bytes(b"")
    return _edit_sidecar(path, num_tokens=0, num_documents=0)


def _manifest_without_val(tmp_path: Path) -> Path:
    return make_dataset(tmp_path / "ds", shards={"train": [documents(1, 2)]})


def _manifest_with_other_vocab(tmp_path: Path) -> Path:
    root = make_dataset(tmp_path / "ds", shards={"train": [documents(1, 2)]})
    data = json.loads((root / "dataset.json").read_text())
    (root / "dataset.json").write_text(json.dumps({**data, "vocab_size": 5000}))
    return root


def _shards_of_two_tokenizers(tmp_path: Path) -> Path:
    (tmp_path / "mix").mkdir()
    write_token_file(tmp_path / "mix" / "a.bin", [1, 2], vocab_size=100)
    write_token_file(tmp_path / "mix" / "b.bin", [1, 2], vocab_size=70000)
    return tmp_path / "mix"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _unfinished_prepare_dir(tmp_path: Path) -> Path:
    (tmp_path / "out.tmp-1234").mkdir()
    return tmp_path / "out.tmp-1234"


BAD_FILES = [
    (
        "not a whole number of tokens",
        lambda p: _truncate(_good(p)),
        "not a whole number of uint16 tokens (2 bytes each)",
    ),
    ("missing sidecar", lambda p: _remove_sidecar(_good(p)), "has no sidecar d.json beside it"),
    (
        "sidecar count disagrees",
        lambda p: _cut_to_whole_token(_good(p)),
        "holds 6 uint16 tokens but its sidecar says num_tokens 7",
    ),
    (
        "sidecar dtype disagrees",
        lambda p: _edit_sidecar(_good(p, tokens=range(8)), dtype="uint32"),
        "holds 4 uint32 tokens but its sidecar says num_tokens 8",
    ),
    ("sidecar dtype too narrow", lambda p: _edit_sidecar(_good(p), vocab_size=70000), "dtype uint16 cannot hold"),
    (
        "sidecar max id beyond its vocab",
        lambda p: _edit_sidecar(_good(p), max_token_id=100),
        "max_token_id 100 >= vocab_size 100",
    ),
    ("sidecar not json", lambda p: _write(_good(p).with_suffix(".json"), "{oops") and p / "d.bin", "is not valid JSON"),
    ("sidecar of another format", lambda p: _edit_sidecar(_good(p), format="megatron"), "has format 'megatron'"),
    ("sidecar of a newer version", lambda p: _edit_sidecar(_good(p), version=2), "upgrade hpc-hsdp"),
    ("sidecar lacks a key", lambda p: _edit_sidecar(_good(p), num_tokens=None), "num_tokens is None"),
    ("unknown dtype", lambda p: _edit_sidecar(_good(p), dtype="int8"), "dtype 'int8' is not one of uint16, uint32"),
    ("empty file", lambda p: _empty(_good(p)), "is empty (0 bytes, num_tokens 0)"),
    ("missing document index", lambda p: (_good(p).with_suffix(".idx").unlink(), p / "d.bin")[1], "document index"),
    ("path does not exist", lambda p: p / "nothing", "does not exist"),
    ("not a token file", lambda p: _write(p / "notes.txt", "hi"), "neither a .bin token file"),
    ("empty directory", lambda p: (p / "e").mkdir() or p / "e", "neither dataset.json nor .bin files"),
    ("unfinished prepare-data output", _unfinished_prepare_dir, "an unfinished prepare-data run"),
    ("manifest and shard disagree", _manifest_with_other_vocab, "manifest and shards disagree"),
    ("shards of different tokenizers", _shards_of_two_tokenizers, "shards disagree on dtype"),
]


@pytest.mark.parametrize(("make", "message"), [pytest.param(m, msg, id=name) for name, m, msg in BAD_FILES])
def test_bad_token_data_is_one_line_with_the_fix(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(DataError) as info:
        open_dataset(path)
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert isinstance(info.value, SpecError)
    # every message ends with what to do about it
    assert any(word in text for word in ("prepare", "give", "upgrade", "check", "write")), text


def test_a_missing_split_says_how_to_make_one(tmp_path):
    root = _manifest_without_val(tmp_path)
    with pytest.raises(DataError, match=r"has no 'val' split \(it has: train\); prepare it with --val-fraction"):
        open_dataset(root, split="val")
    write_token_file(tmp_path / "one.bin", [1, 2, 3], vocab_size=100)
    with pytest.raises(DataError, match="one token file with no held-out split; give --val-data"):
        open_eval_dataset(tmp_path / "one.bin")
    assert open_eval_dataset(root, tmp_path / "one.bin").num_tokens == 3


def _dataset(tmp_path: Path, tokens: int, max_id: int = 50) -> TokenDataset:
    ids = np.arange(tokens) % (max_id + 1)
    write_token_file(tmp_path / "t.bin", ids, vocab_size=max_id + 1)
    return open_dataset(tmp_path / "t.bin")


@pytest.mark.parametrize(
    ("tokens", "max_id", "model_vocab", "seq_len", "global_batch", "message"),
    [
        (
            1000,
            50,
            50,
            8,
            4,
            "holds token id 50 but the model's vocabulary has 50 ids (0..49); use a model with at least 51",
        ),
        (1000, 300, 256, 8, 4, "holds token id 300"),
        (64, 50, 51, 8, 8, "64 tokens: 7 samples of --seq-len 8, fewer than one global batch of 8 (needs 65 tokens)"),
        (10, 5, 6, 32, 1, "10 tokens: 0 samples of --seq-len 32"),
    ],
)
def test_check_for_training_rejects(tmp_path, tokens, max_id, model_vocab, seq_len, global_batch, message):
    ds = _dataset(tmp_path, tokens, max_id)
    with pytest.raises(DataError) as info:
        check_for_training(ds, model_vocab_size=model_vocab, seq_len=seq_len, global_batch=global_batch)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("tokens", "seq_len", "global_batch"), [(65, 8, 8), (1000, 8, 4), (33, 32, 1)])
def test_check_for_training_accepts_exactly_enough(tmp_path, tokens, seq_len, global_batch):
    ds = _dataset(tmp_path, tokens)
    check_for_training(ds, model_vocab_size=51, seq_len=seq_len, global_batch=global_batch)
    last = ((tokens - 1) // seq_len - 1) * seq_len
    assert ds.read(last, seq_len + 1).size == seq_len + 1  # the sampler's last sample fits
