"""prepare-data on a real corpus (the Python standard library's own source), through the real CLI.

A BPE is trained in the test, the dataset is opened with the reader the training loop uses,
and every document is decoded back and compared with the file it came from.
"""

from __future__ import annotations

import gzip
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import hpc

from hpc_hsdp.cli import main
from hpc_hsdp.data.prepare import FAULT_SIGNAL, PrepareSpec, is_val, prepare
from hpc_hsdp.data.tokenizer import BYTE_EOS_ID, ByteTokenizer, load_dataset_tokenizer
from hpc_hsdp.data.tokens import DataError, check_for_training, open_dataset

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# a deterministic subset of the standard library: about 1 MB of Python source
CORPUS_PACKAGES = ("json", "email", "http", "urllib")
VOCAB = 1024


def corpus_dirs() -> list[Path]:
    return [STDLIB / name for name in CORPUS_PACKAGES]


def corpus_files() -> list[Path]:
    """The files prepare-data reads from corpus_dirs() with --glob '*.py', in its order."""
    files = []
    for folder in corpus_dirs():
        for root, dirs, names in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files += [Path(root) / n for n in sorted(names) if n.endswith(".py") and (Path(root) / n).stat().st_size]
    return files


def cli(*args: str) -> tuple[int, str, str]:
    """Run ``hpc-hsdp ARGS`` in a subprocess: (exit code, stdout, stderr)."""
    out = hpc(*args)
    return out.returncode, out.stdout, out.stderr


def documents_of(ds) -> list[np.ndarray]:
    offsets = ds.document_offsets()
    tokens = ds.read(0, ds.num_tokens)
    return [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.fixture(scope="module")
def stdlib_dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "stdlib"
    code, stdout, stderr = cli(
        "prepare-data",
        *map(str, corpus_dirs()),
        "--glob",
        "*.py",
        "-o",
        str(out),
        "--train-tokenizer",
        str(VOCAB),
        "--val-fraction",
        "0.2",
    )
    assert code == 0, stderr
    assert f"wrote {out}" in stdout and "tokens/s" in stderr  # the summary, and the progress line
    return out


def test_stdlib_with_a_trained_bpe_decodes_back_to_the_source(stdlib_dataset):
    train, val = open_dataset(stdlib_dataset), open_dataset(stdlib_dataset, split="val")
    assert train.vocab_size == VOCAB and train.dtype == np.uint16 and train.tokenizer["kind"] == "bpe-trained"
    tokenizer = load_dataset_tokenizer(train.tokenizer, train.tokenizer_base)
    assert train.eos_id == tokenizer.eos_id == 0
    texts = [p.read_text(encoding="utf-8") for p in corpus_files()]
    expected = {
        "train": [t for t in texts if not is_val(t.encode(), 0.2)],
        "val": [t for t in texts if is_val(t.encode(), 0.2)],
    }
    assert len(expected["val"]) >= 3 and len(expected["train"]) > 2 * len(expected["val"])
    for ds, split in ((train, "train"), (val, "val")):
        docs = documents_of(ds)
        assert ds.num_documents == len(docs) == len(expected[split])
        for doc, text in zip(docs, expected[split]):
            assert doc[-1] == ds.eos_id and ds.eos_id not in doc[:-1]
            assert tokenizer.decode(doc[:-1]) == text
        # exactly what the tokenizers library makes of the text, nothing added or lost
        library = tokenizer.library_tokenizer
        assert docs[3][:-1].tolist() == library.encode(expected[split][3], add_special_tokens=False).ids
    assert train.max_token_id < VOCAB and train.num_tokens < sum(len(t.encode()) for t in texts) / 2  # BPE compresses
    check_for_training(train, model_vocab_size=VOCAB, seq_len=64, global_batch=8)
    with pytest.raises(DataError, match="holds token id"):
        check_for_training(train, model_vocab_size=256, seq_len=64, global_batch=8)
    manifest = json.loads((stdlib_dataset / "dataset.json").read_text())
    assert manifest["num_documents"] == {"train": len(expected["train"]), "val": len(expected["val"])}
    assert sorted(p.name for p in stdlib_dataset.parent.iterdir()) == ["stdlib"]  # no leftovers


def test_jsonl_gz_and_text_with_a_tokenizer_file(stdlib_dataset, tmp_path):
    texts = [p.read_text(encoding="utf-8") for p in corpus_files()[:40]]
    records = [json.dumps({"id": i, "text": t}) for i, t in enumerate(texts[:30])]
    records.insert(5, json.dumps({"id": -1, "text": ""}))  # an empty document is left out
    records.insert(9, "")
    (tmp_path / "docs.jsonl").write_text("\n".join(records) + "\n")
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(records))
    (tmp_path / "more").mkdir()
    for i, text in enumerate(texts[30:]):
        (tmp_path / "more" / f"{i:02d}.txt").write_text(text)
    tokenizer_json = stdlib_dataset / "tokenizer" / "tokenizer.json"
    outputs = {}
    for name, inputs in (("plain", ["docs.jsonl", "more"]), ("gz", ["docs.jsonl.gz", "more"])):
        code, _, stderr = cli(
            "prepare-data",
            *[str(tmp_path / i) for i in inputs],
            "--field",
            "text",
            "--tokenizer",
            str(tokenizer_json),
            "-o",
            str(tmp_path / name),
            "-q",
        )
        assert code == 0 and stderr == "", stderr
        outputs[name] = open_dataset(tmp_path / name)
    plain, gz = outputs["plain"], outputs["gz"]
    assert plain.read(0, plain.num_tokens).tolist() == gz.read(0, gz.num_tokens).tolist()
    assert plain.tokenizer["kind"] == "tokenizers" and plain.tokenizer["eos_token"] == "<|endoftext|>"
    assert (tmp_path / "plain" / "tokenizer" / "tokenizer.json").read_bytes() == tokenizer_json.read_bytes()
    tokenizer = load_dataset_tokenizer(plain.tokenizer, plain.tokenizer_base)
    assert [tokenizer.decode(doc[:-1]) for doc in documents_of(plain)] == texts


def test_byte_tokenizer_round_trip_and_shards(tmp_path):
    texts = ["héllo wörld ✓ 🎉\n", "plain ascii", "x" * 5000, "ünïcödé " * 300]
    for i, text in enumerate(texts):
        (tmp_path / f"{i}.txt").write_text(text, encoding="utf-8")
    code, _, stderr = cli(
        "prepare-data",
        *[str(tmp_path / f"{i}.txt") for i in range(4)],
        "-o",
        str(tmp_path / "out"),
        "--shard-tokens",
        "1000",
    )
    assert code == 0, stderr
    ds = open_dataset(tmp_path / "out")
    assert (ds.vocab_size, ds.eos_id, ds.dtype) == (257, BYTE_EOS_ID, np.uint16)
    assert [f.num_documents for f in ds.files] == [3, 1]  # a shard ends with the document that fills it
    expected = [t for text in texts for t in [*text.encode("utf-8"), BYTE_EOS_ID]]
    assert ds.read(0, ds.num_tokens).tolist() == expected
    assert [ByteTokenizer().decode(doc) for doc in documents_of(ds)] == texts
    with pytest.raises(DataError, match="no 'val' split"):
        open_dataset(tmp_path / "out", split="val")


@pytest.mark.parametrize("engine", ["processes", "threads"])
def test_long_text_in_pieces_encodes_as_a_whole_and_output_is_deterministic(stdlib_dataset, tmp_path, engine):
    big = "".join(p.read_text(encoding="utf-8") for p in corpus_files()[:30])
    (tmp_path / "big.txt").write_text(big)
    (tmp_path / "small.txt").write_text("def f():\n    return 1\n")
    tokenizer_dir = str(stdlib_dataset / "tokenizer")
    runs = []
    for workers in (1, 2):
        spec = PrepareSpec(
            inputs=(str(tmp_path / "big.txt"), str(tmp_path / "small.txt")),
            output=str(tmp_path / f"{engine}-{workers}"),
            tokenizer=tokenizer_dir,
            workers=workers,
            engine=engine,
            shard_tokens=5000,
        )
        result = prepare(spec, block_bytes=8192)  # dozens of pieces of the big file
        runs.append(open_dataset(result.output))
    one, two = runs
    assert one.read(0, one.num_tokens).tolist() == two.read(0, two.num_tokens).tolist()
    assert [f.num_documents for f in one.files] == [1, 1]  # shards end between documents
    assert len(big) > 40 * 8192
    library = load_dataset_tokenizer(one.tokenizer, one.tokenizer_base).library_tokenizer
    whole = library.encode(big, add_special_tokens=False).ids
    assert documents_of(one)[0].tolist() == [*whole, one.eos_id]


def test_interrupted_run_leaves_nothing_that_looks_complete(tmp_path):
    lines = [json.dumps({"text": f"document {i} " + "lorem ipsum dolor sit amet " * 40}) for i in range(4000)]
    (tmp_path / "big.jsonl").write_text("\n".join(lines))  # ~4.5 MB: several blocks
    out = tmp_path / "data" / "ds"
    base = [
        "prepare-data",
        str(tmp_path / "big.jsonl"),
        "--field",
        "text",
        "-o",
        str(out),
        "-q",
        "--workers",
        "1",
    ]
    killed = hpc(*base, env={FAULT_SIGNAL: "2:KILL"}, timeout=120)
    assert killed.returncode == -9
    leftovers = list(out.parent.iterdir())
    assert not out.exists() and len(leftovers) == 1 and ".tmp-" in leftovers[0].name
    assert not (leftovers[0] / "dataset.json").exists()
    with pytest.raises(DataError, match="unfinished prepare-data run"):
        open_dataset(leftovers[0])
    assert list(leftovers[0].rglob("*.bin.tmp-*")) and not list(leftovers[0].rglob("*.json"))  # killed mid-shard
    terminated = hpc(*base, env={FAULT_SIGNAL: "2:TERM"}, timeout=120)
    assert terminated.returncode == 128 + 15 and "terminated" in terminated.stderr
    assert list(out.parent.iterdir()) == leftovers  # cleaned up after itself
    done = hpc(*base, timeout=120)
    assert done.returncode == 0, done.stderr
    assert open_dataset(out).num_documents == 4000
    # --force replaces a dataset (and only a dataset)
    again = hpc(*base, "--force", timeout=120)
    assert again.returncode == 0 and open_dataset(out).num_documents == 4000
    assert sorted(p.name for p in out.parent.iterdir() if ".old-" in p.name) == []


# --------------------------------------------------------------------------- bad input: one line, exit 2


def _text(folder: Path, name: str = "a.txt", text: str = "some text\n") -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _bytes(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


def _jsonl(folder: Path, lines: list[str], name: str = "d.jsonl") -> Path:
    return _text(folder, name, "\n".join(lines) + "\n")


def _tokenizer_dir_without_json(folder: Path) -> Path:
    _text(folder / "tok", "vocab.json", "{}")
    return folder / "tok"


def _not_a_dataset_dir(folder: Path) -> Path:
    _text(folder / "out", "notes.txt")
    return folder / "out"


GOOD = "a.txt"
BAD_INPUTS = [
    ("missing input", lambda d: ["nothing.txt", "-o", "out"], "input nothing.txt does not exist"),
    ("empty input", lambda d: [str(_bytes(d, "e.txt", b"")), "-o", "out"], "is empty; leave it out"),
    (
        "empty gzip",
        lambda d: [str(_bytes(d, "e.txt.gz", gzip.compress(b""))), "-o", "out"],
        "is empty after decompression",
    ),
    ("not gzip", lambda d: [str(_bytes(d, "x.txt.gz", b"plain")), "-o", "out"], "not a valid gzip file"),
    ("binary file", lambda d: [str(_bytes(d, "b.txt", b"\x80\x81binary")), "-o", "out"], "is not UTF-8 text (byte 0"),
    (
        "not UTF-8 past the first bytes",
        lambda d: [str(_bytes(d, "late.txt", b"ok\n" * 3000 + b"\xff")), "-o", "out"],
        "late.txt is not UTF-8 text (byte 9000 is b'\\xff')",
    ),
    ("missing directory", lambda d: [str(_text(d)), str(d / "sub"), "-o", "out"], "sub does not exist"),
    (
        "no file matches the glob",
        lambda d: [str(_text(d / "docs").parent), "--glob", "*.md", "-o", "out"],
        "holds no non-empty file matching '*.md'",
    ),
    (
        "jsonl without --field",
        lambda d: [str(_jsonl(d, ['{"text": "a"}'])), "-o", "out"],
        "say which key holds the text with --field",
    ),
    (
        "jsonl line without the key",
        lambda d: [str(_jsonl(d, ['{"body": "a"}'])), "--field", "text", "-o", "out"],
        "d.jsonl line 1 has no 'text' key (it has: 'body'); give the key that holds the text with --field",
    ),
    (
        "jsonl later line without the key",
        lambda d: [str(_jsonl(d, ['{"text": "a"}', "", '{"txt": "b"}'])), "--field", "text", "-o", "out"],
        "d.jsonl line 3 has no 'text' key",
    ),
    ("jsonl not json", lambda d: [str(_jsonl(d, ["{oops"])), "--field", "text", "-o", "out"], "line 1 is not JSON"),
    (
        "jsonl value not text",
        lambda d: [str(_jsonl(d, ['{"text": 3}'])), "--field", "text", "-o", "out"],
        "holds a int, not text",
    ),
    (
        "--field for text",
        lambda d: [str(_text(d)), "--field", "text", "-o", "out"],
        "--field text is for JSONL, Parquet or datasets inputs",
    ),
    (
        "val fraction 1",
        lambda d: [str(_text(d)), "--val-fraction", "1", "-o", "out"],
        "--val-fraction 1.0 is outside [0, 1)",
    ),
    ("val fraction negative", lambda d: [str(_text(d)), "--val-fraction", "-0.1", "-o", "out"], "is outside [0, 1)"),
    (
        "val fraction not a number",
        lambda d: [str(_text(d)), "--val-fraction", "lots", "-o", "out"],
        "'lots' is not a valid float",
    ),
    (
        "val split would be empty",
        lambda d: [str(_text(d)), "--val-fraction", "1e-9", "-o", "out"],
        "chose none of the 1 documents",
    ),
    (
        "tokenizer path missing",
        lambda d: [str(_text(d)), "--tokenizer", "./tok.json", "-o", "out"],
        "--tokenizer ./tok.json: no such file",
    ),
    (
        "tokenizer hub name",
        lambda d: [str(_text(d)), "--tokenizer", "gpt2", "-o", "out"],
        "never downloads from the Hugging Face Hub",
    ),
    (
        "tokenizer hub org/name",
        lambda d: [str(_text(d)), "--tokenizer", "meta-llama/Llama-3.1-8B", "-o", "out"],
        "never downloads",
    ),
    (
        "tokenizer dir without json",
        lambda d: [str(_text(d)), "--tokenizer", str(_tokenizer_dir_without_json(d)), "-o", "out"],
        "has no tokenizer.json (it has vocab.json: a slow tokenizer",
    ),
    (
        "tokenizer file not a tokenizer",
        lambda d: [str(_text(d)), "--tokenizer", str(_text(d, "t.json", "{}")), "-o", "out"],
        "is not a tokenizers file",
    ),
    ("train vocab too small", lambda d: [str(_text(d)), "--train-tokenizer", "100", "-o", "out"], "needs 258 to"),
    (
        "train and tokenizer",
        lambda d: [str(_text(d)), "--train-tokenizer", "512", "--tokenizer", "x", "-o", "out"],
        "exclude each other",
    ),
    (
        "eos token for byte",
        lambda d: [str(_text(d)), "--eos-token", "</s>", "-o", "out"],
        "--eos-token is for --tokenizer PATH",
    ),
    (
        "output not empty",
        lambda d: [str(_text(d)), "-o", str(_text(d / "full").parent)],
        "exists and is not empty; choose a new",
    ),
    ("output is a file", lambda d: [str(_text(d)), "-o", str(_text(d, "f.txt"))], "is a file; give a directory"),
    (
        "force on a non-dataset",
        lambda d: [str(_text(d)), "-o", str(_not_a_dataset_dir(d)), "--force"],
        "--force replaces only those",
    ),
    (
        "output inside input",
        lambda d: [str(_text(d / "docs").parent), "-o", str(d / "docs" / "out")],
        "lies inside input directory",
    ),
]


@pytest.mark.parametrize(("make", "message"), [pytest.param(m, msg, id=name) for name, m, msg in BAD_INPUTS])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, monkeypatch, capsys, make, message):
    monkeypatch.chdir(tmp_path)
    args = make(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as exited:
        main(["prepare-data", "-q", *args])
    captured = capsys.readouterr()
    assert exited.value.code == 2, captured.err
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith("hpc-hsdp: error: ") and message in captured.err, captured.err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written, nothing left


def test_a_source_directory_skips_its_binary_files_and_says_how_many(tmp_path, monkeypatch, capsys):
    """A Python source tree holds __pycache__/*.pyc: left out with a count, not the first one fatal
    (a binary file named itself is still refused: BAD_INPUTS)."""
    monkeypatch.chdir(tmp_path)
    source = tmp_path / "src"
    _text(source, "a.py", "def f(x):\n    return x\n" * 50)
    (source / "__pycache__").mkdir()
    _bytes(source / "__pycache__", "a.cpython-311.pyc", b"\xa7\r\r\n\x00\x00\x00\x00" + bytes(range(256)))
    with pytest.raises(SystemExit) as exited:
        main(["prepare-data", "-q", str(source), "-o", "out"])
    out = capsys.readouterr().out
    assert exited.value.code == 0, out
    assert "1 input files (left out of the directories: 1 binary)" in out, out


def test_a_tokenizer_without_an_end_of_document_token_needs_eos_token(tmp_path, monkeypatch, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "<doc>": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "wl.json"))
    _text(tmp_path, "in.txt", "a a b a")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["prepare-data", "in.txt", "--tokenizer", "wl.json", "-o", "out", "-q"])
    assert exited.value.code == 2 and "found no end-of-document token" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["prepare-data", "in.txt", "--tokenizer", "wl.json", "--eos-token", "</s>", "-o", "out", "-q"])
    assert exited.value.code == 2 and "'</s>' is not in the tokenizer's vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        main(["prepare-data", "in.txt", "--tokenizer", "wl.json", "--eos-token", "<doc>", "-o", "out", "-q"])
    assert exited.value.code == 0
    assert open_dataset(tmp_path / "out").read(0, 5).tolist() == [1, 1, 0, 1, 2]


def test_a_transformers_tokenizer_directory_gives_its_eos_token(stdlib_dataset, tmp_path, monkeypatch, capsys):
    """A directory as transformers' save_pretrained writes it: tokenizer.json, and the
    end-of-document token named in tokenizer_config.json (here not a well-known one)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(stdlib_dataset / "tokenizer" / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|doc_end|>"])
    (tmp_path / "tok").mkdir()
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    config = {"eos_token": {"content": "<|doc_end|>", "special": True}, "tokenizer_class": "PreTrainedTokenizerFast"}
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    _text(tmp_path, "in.txt", "def f(x):\n    return x\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exited:
        main(["prepare-data", "in.txt", "--tokenizer", "tok", "-o", "out", "-q"])
    assert exited.value.code == 0, capsys.readouterr().err
    ds = open_dataset(tmp_path / "out")
    assert ds.eos_id == tokenizer.token_to_id("<|doc_end|>") == VOCAB and ds.vocab_size == VOCAB + 1
    assert ds.read(ds.num_tokens - 1, 1).tolist() == [VOCAB]
    assert sorted(p.name for p in (tmp_path / "out" / "tokenizer").iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (
        load_dataset_tokenizer(ds.tokenizer, ds.tokenizer_base).decode(ds.read(0, ds.num_tokens - 1))
        == "def f(x):\n    return x\n"
    )
