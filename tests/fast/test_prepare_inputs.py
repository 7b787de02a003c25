"""prepare-data's Parquet, ``datasets`` (save_to_disk) and .jsonl.zst inputs, through the real CLI.

The same documents are written as JSONL, as Parquet by pyarrow (several files, several row
groups each), as a directory by ``datasets`` itself and as zstandard-compressed JSONL (several
frames); every one must give the very tokens of the JSONL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from cli_helpers import hpc

from hpc_hsdp.cli import main
from hpc_hsdp.data.tokens import open_dataset

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def cli(*args: str) -> tuple[int, str, str]:
    out = hpc(*args)
    return out.returncode, out.stdout, out.stderr


@pytest.fixture(scope="module")
def texts() -> list[str]:
    files = sorted((STDLIB / "json").glob("*.py")) + sorted((STDLIB / "email").glob("*.py"))
    out = [f.read_text(encoding="utf-8") for f in files[:40]]
    out.insert(3, "")  # an empty document: left out by every reader alike
    out.insert(7, "héllo wörld ✓ 🎉 — non-ASCII\n")
    return out


@pytest.fixture(scope="module")
def inputs(texts, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inputs")
    lines = [json.dumps({"id": i, "text": t}) for i, t in enumerate(texts)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    # .jsonl.zst in three frames (as `zstd` concatenations and some dumps are): read across them
    third = len(lines) // 3
    with open(root / "docs.jsonl.zst", "wb") as f:
        for part in (lines[:third], lines[third : 2 * third], lines[2 * third :]):
            f.write(zstandard.ZstdCompressor().compress(("\n".join(part) + "\n").encode()))
    # Parquet: a directory of three files, each of several row groups, the text column not first
    (root / "parquet").mkdir()
    for number, start in enumerate(range(0, len(texts), 15)):
        chunk = texts[start : start + 15]
        table = pa.table({"id": list(range(start, start + len(chunk))), "text": chunk, "url": ["u"] * len(chunk)})
        pq.write_table(table, root / "parquet" / f"part-{number:03d}.parquet", row_group_size=4)
    assert pq.ParquetFile(root / "parquet" / "part-000.parquet").metadata.num_row_groups == 4
    # a datasets directory, written by datasets itself in three Arrow shards
    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"id": list(range(len(texts))), "text": texts})
    dataset.save_to_disk(str(root / "hf"), num_shards=3)
    assert len(list((root / "hf").glob("*.arrow"))) == 3
    datasets.DatasetDict({"train": dataset, "test": dataset.select(range(3))}).save_to_disk(str(root / "hfdict"))
    return {
        "jsonl": root / "docs.jsonl",
        "zst": root / "docs.jsonl.zst",
        "parquet": root / "parquet",
        "datasets": root / "hf",
        "dict": root / "hfdict",
    }


def _prepare(source: Path, out: Path, *extra: str) -> list[int]:
    code, stdout, stderr = cli("prepare-data", str(source), "--field", "text", "-o", str(out), "-q", *extra)
    assert code == 0, stderr
    ds = open_dataset(out)
    return ds.read(0, ds.num_tokens).tolist()


@pytest.mark.parametrize("kind", ["parquet", "datasets", "zst"])
def test_parquet_datasets_and_zst_give_the_tokens_of_the_same_jsonl(inputs, texts, tmp_path, kind):
    expected = _prepare(inputs["jsonl"], tmp_path / "jsonl")
    eos = 256
    assert expected == [t for text in texts if text for t in [*text.encode("utf-8"), eos]]
    # processes (2 workers) and small blocks: the parallel path, blocks cut across files and row groups
    got = _prepare(inputs[kind], tmp_path / kind, "--workers", "2", "--engine", "processes")
    assert got == expected
    manifest = json.loads((tmp_path / kind / "dataset.json").read_text())
    assert manifest["num_documents"]["train"] == len([t for t in texts if t])


def test_parquet_with_a_val_split_matches_jsonl(inputs, tmp_path):
    jsonl = _prepare(inputs["jsonl"], tmp_path / "a", "--val-fraction", "0.3")
    parquet = _prepare(inputs["parquet"], tmp_path / "b", "--val-fraction", "0.3")
    assert jsonl == parquet
    a, b = open_dataset(tmp_path / "a", split="val"), open_dataset(tmp_path / "b", split="val")
    assert a.read(0, a.num_tokens).tolist() == b.read(0, b.num_tokens).tolist() and a.num_tokens > 0


def _one_line_exit_2(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["prepare-data", "-q", *args])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_a_missing_column_names_the_columns_there_are(inputs, tmp_path, capsys):
    err = _one_line_exit_2(capsys, [str(inputs["parquet"]), "--field", "body", "-o", str(tmp_path / "o")])
    assert "has no column 'body' (it has: 'id', 'text', 'url')" in err, err
    err = _one_line_exit_2(capsys, [str(inputs["datasets"]), "--field", "content", "-o", str(tmp_path / "o")])
    assert "has no column 'content' (it has: 'id', 'text')" in err, err
    err = _one_line_exit_2(capsys, [str(inputs["parquet"]), "-o", str(tmp_path / "o")])
    assert "say which column holds the text with --field (it has: 'id', 'text', 'url')" in err, err
    err = _one_line_exit_2(capsys, [str(inputs["parquet"]), "--field", "id", "-o", str(tmp_path / "o")])
    assert "column 'id' holds int64, not text" in err, err
    err = _one_line_exit_2(capsys, [str(inputs["dict"]), "--field", "text", "-o", str(tmp_path / "o")])
    assert "is a datasets DatasetDict: give the split to read" in err and "hfdict/train" in err, err
    assert not (tmp_path / "o").exists()


def test_a_broken_zst_or_parquet_file_is_one_line(tmp_path, capsys):
    (tmp_path / "bad.jsonl.zst").write_bytes(b"not zstandard at all")
    err = _one_line_exit_2(capsys, [str(tmp_path / "bad.jsonl.zst"), "--field", "text", "-o", str(tmp_path / "o")])
    assert "is not a valid zstandard file" in err, err
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 but not really")
    err = _one_line_exit_2(capsys, [str(tmp_path / "bad.parquet"), "--field", "text", "-o", str(tmp_path / "o")])
    assert "is not a readable Parquet file" in err, err


def test_without_pyarrow_or_zstandard_the_refusal_names_the_extra(inputs, tmp_path):
    # a fresh interpreter in which the packages cannot be imported (None in sys.modules)
    for module, source in (("pyarrow", inputs["parquet"]), ("zstandard", inputs["zst"])):
        code = (
            f"import sys; sys.modules[{module!r}] = None; from hpc_hsdp.cli import main; "
            f"main(['prepare-data', '-q', {str(source)!r}, '--field', 'text', '-o', {str(tmp_path / 'o')!r}])"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.splitlines()) == 1 and f"needs the `{module}` library" in out.stderr, out.stderr
        assert "pip install 'hpc-hsdp[data]'" in out.stderr


def test_small_blocks_cut_row_groups_into_bounded_pieces_with_the_same_tokens(inputs, texts, tmp_path):
    from hpc_hsdp.data.inputs import _open_table, discover_inputs, iter_blocks
    from hpc_hsdp.data.prepare import PrepareSpec, prepare

    # one big row group: it is read in batches of about block_bytes of text, not whole
    big = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": texts * 4}), big, row_group_size=len(texts) * 4)
    files, _ = discover_inputs((str(big),), field="text")
    batches = list(_open_table(files[0], 16384)[1]("text"))
    assert len(batches) > 10 and sum(len(b) for b in batches) == len(texts) * 4
    longest = max(len(t.encode()) for t in texts)
    assert max(sum(len(x.as_py().encode()) for x in b.column(0)) for b in batches) <= 16384 + 2 * longest
    blocks = list(iter_blocks(files, val_fraction=0.0, block_bytes=4096, field="text"))
    assert max(len(p.data) for b in blocks for p in b.pieces) <= 4096 + longest
    assert sum(b.disk_bytes for b in blocks) == big.stat().st_size  # the progress adds up to the file
    expected = _prepare(inputs["jsonl"], tmp_path / "jsonl")
    for source in (inputs["parquet"], inputs["datasets"]):
        out = tmp_path / f"small-{source.name}"
        prepare(PrepareSpec(inputs=(str(source),), field="text", output=str(out), workers=1), block_bytes=4096)
        ds = open_dataset(out)
        assert ds.read(0, ds.num_tokens).tolist() == expected
