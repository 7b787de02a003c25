"""prepare-data throughput against the tokenizers library's own encode_batch, and its peak memory as the input grows.

    python benchmarks/bench_data.py [--runs N] [--megabytes MB] [--vocab V] [--formats text,jsonl,parquet,...]

Corpus: the Python standard library's .py files (sorted; the first MB megabytes), "1x";
"4x" is four copies of it. A byte-level BPE of V ids is trained on 1x first (not timed).
Each measurement is a fresh process, run N times interleaved (median):

  encode_batch     tokenizers.Tokenizer.encode_batch(texts) on all of 1x, texts already in memory,
                   the library's own thread pool over every core: the baseline (compute only)
  prepare-data     hpc-hsdp prepare-data DIR --glob '*.py' --tokenizer tokenizer.json (its click command,
                   in the measuring process): reading, encoding, writing the shards, --engine
                   processes / threads

``--formats``: the same documents also as one JSONL file per copy (``jsonl``), zstandard-compressed
JSONL (``zst``), a Parquet file per copy in row groups of 2,048 documents (``parquet``) or a
``datasets`` save_to_disk directory per copy (``datasets``), read with ``--field text``; the
conversion is not timed, and a verdict compares each format's tokens/s with JSONL's.

It prints tokens/s with the ratio to encode_batch on the same input (target >= 0.8), and
the peak RSS (ru_maxrss) of the prepare-data process and of its largest worker per size
(target: flat as the input grows), beside encode_batch's, which holds every text and
encoding at once. `--sizes 1,4,16 --only processes` shows where prepare-data's levels off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

TARGET_RATIO = 0.8

BASELINE = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(sys.argv[1])
    texts = [p.read_text(encoding="utf-8") for d in sys.argv[2:] for p in sorted(Path(d).rglob("*.py"))]
    start = time.perf_counter()
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(e.ids) for e in encodings) + len(texts)  # + one end-of-document token each, as prepare-data
    print(json.dumps({"tokens": tokens, "seconds": seconds,
                      "rss_main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_worker": 0}))
""")

PREPARE = textwrap.dedent("""
    import json, resource, sys, time
    from pathlib import Path
    from hpc_hsdp.cli import main
    tokenizer, output, engine, fmt, *inputs = sys.argv[1:]
    how = ["--glob", "*.py"] if fmt == "text" else ["--field", "text"]
    start = time.perf_counter()
    try:
        main(["prepare-data", *inputs, *how, "--tokenizer", tokenizer, "--engine", engine, "-o", output, "-q"])
    except SystemExit as exc:
        assert exc.code in (0, None), exc.code
    seconds = time.perf_counter() - start
    manifest = json.loads((Path(output) / "dataset.json").read_text())
    print(json.dumps({"tokens": sum(manifest["num_tokens"].values()), "seconds": seconds,
                      "rss_main": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "rss_worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
""")


def stdlib_corpus(megabytes: float) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or not path.is_file() or not path.stat().st_size:
            continue  # prepare-data leaves empty files in directories out
        try:
            path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(path)
        total += path.stat().st_size
        if total >= megabytes * 1e6:
            break
    return files


def build_inputs(work: Path, files: list[Path], copies: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    folders = []
    for copy in range(copies):
        folder = work / f"copy{copy}"
        for path in files:
            target = folder / path.relative_to(root)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
        folders.append(str(folder))
    return folders


FORMATS = ("text", "jsonl", "zst", "parquet", "datasets")


def convert_inputs(work: Path, folders: list[str], fmt: str) -> list[str]:
    """The documents of each copy folder as one input of ``fmt`` (not timed)."""
    out = []
    for folder in folders:
        texts = [p.read_text(encoding="utf-8") for p in sorted(Path(folder).rglob("*.py"))]
        target = work / fmt / Path(folder).name
        target.parent.mkdir(parents=True, exist_ok=True)
        if fmt in ("jsonl", "zst"):
            data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
            if fmt == "zst":
                import zstandard

                data = zstandard.ZstdCompressor(level=3).compress(data)
            path = target.with_suffix(".jsonl.zst" if fmt == "zst" else ".jsonl")
            path.write_bytes(data)
        elif fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            path = target.with_suffix(".parquet")
            pq.write_table(pa.table({"id": list(range(len(texts))), "text": texts}), path, row_group_size=2048)
        else:
            import datasets

            path = target
            datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
        out.append(str(path))
    return out


def train_tokenizer(work: Path, inputs: list[str], vocab: int) -> Path:
    out = work / "trained"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "hpc_hsdp",
            "prepare-data",
            *inputs,
            "--glob",
            "*.py",
            "-o",
            str(out),
            "--train-tokenizer",
            str(vocab),
            "-q",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return out / "tokenizer" / "tokenizer.json"


def run_json(code: str, args: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"benchmark process failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def megabytes(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--megabytes", type=float, default=8.0, help="size of the 1x corpus")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--sizes", default="1,4", help="input sizes in copies of the 1x corpus, e.g. 1,4,16")
    parser.add_argument("--formats", default="text", help=f"input formats, of {', '.join(FORMATS)}")
    parser.add_argument(
        "--only",
        default="encode_batch,processes,threads",
        help="variants: encode_batch, processes, threads (prepare-data --engine)",
    )
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    wanted = args.only.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        files = stdlib_corpus(args.megabytes)
        inputs = {n: build_inputs(work / f"{n}x", files, n) for n in sizes}
        formats = args.formats.split(",")
        converted = {
            (fmt, n): convert_inputs(work / f"{n}x", inputs[n], fmt) for fmt in formats if fmt != "text" for n in sizes
        }
        size = sum(p.stat().st_size for p in files)
        tokenizer = train_tokenizer(work, inputs[sizes[0]][:1], args.vocab)
        print(
            f"corpus 1x: {len(files)} standard-library files, {size / 1e6:.1f} MB; sizes {args.sizes} x; "
            f"BPE {args.vocab}; {os.cpu_count()} CPUs; runs {args.runs}, interleaved"
        )
        variants = {}
        if "encode_batch" in wanted:
            variants["encode_batch"] = lambda n: run_json(BASELINE, [str(tokenizer), *inputs[n]])
        for engine in ("processes", "threads"):
            if engine not in wanted:
                continue
            for fmt in formats:
                name = engine if fmt == "text" else f"{engine}, {fmt}"
                variants[name] = lambda n, engine=engine, fmt=fmt: _prepare(
                    work, tokenizer, engine, fmt, inputs[n] if fmt == "text" else converted[(fmt, n)]
                )
        results: dict[tuple[str, int], list[dict]] = {}
        for _ in range(args.runs):
            for n in sizes:
                for name, run in variants.items():
                    results.setdefault((name, n), []).append(run(n))
    print(
        f"\n{'variant':<34} {'size':>5} {'tokens':>12} {'tokens/s':>10} {'ratio':>6} {'peak RSS':>9} "
        f"{'main':>8} {'worker':>8}"
    )
    verdicts = []
    for name in variants:
        label = "encode_batch (baseline)" if name == "encode_batch" else f"prepare-data ({name})"
        for n in sizes:
            runs = results[(name, n)]
            rate = statistics.median(r["tokens"] / r["seconds"] for r in runs)
            base_runs = results.get(("encode_batch", n))
            ratio = rate / statistics.median(r["tokens"] / r["seconds"] for r in base_runs) if base_runs else None
            peak = statistics.median(max(r["rss_main"], r["rss_worker"]) for r in runs)
            main_rss = statistics.median(r["rss_main"] for r in runs)
            worker = statistics.median(r["rss_worker"] for r in runs)
            print(
                f"{label:<34} {n:>4}x {runs[0]['tokens']:>12,} {rate / 1e6:>8.3f} M "
                f"{'' if ratio is None else f'{ratio:.2f}':>6} {megabytes(peak):>9} {megabytes(main_rss):>8} "
                f"{megabytes(worker):>8}"
            )
            if ratio is not None and name != "encode_batch":
                verdicts.append(
                    f"prepare-data ({name}) at {n}x: {ratio:.2f}x encode_batch (target >= {TARGET_RATIO}): "
                    f"{'ok' if ratio >= TARGET_RATIO else 'BELOW TARGET'}"
                )
        first = statistics.median(max(r["rss_main"], r["rss_worker"]) for r in results[(name, sizes[0])])
        last = statistics.median(max(r["rss_main"], r["rss_worker"]) for r in results[(name, sizes[-1])])
        verdicts.append(
            f"{label}: input {sizes[-1] / sizes[0]:.0f}x larger, peak RSS {last / first:.2f}x "
            f"({megabytes(first)} -> {megabytes(last)})"
        )
    for name in variants:
        engine, _, fmt = name.partition(", ")
        if fmt and fmt != "jsonl" and f"{engine}, jsonl" in variants:
            for n in sizes:
                rate = statistics.median(r["tokens"] / r["seconds"] for r in results[(name, n)])
                base = statistics.median(r["tokens"] / r["seconds"] for r in results[(f"{engine}, jsonl", n)])
                verdicts.append(
                    f"prepare-data ({engine}) at {n}x: {fmt} {rate / base:.2f}x the tokens/s of the same JSONL"
                )
    print("\n" + "\n".join(verdicts))
    return 0


def _prepare(work: Path, tokenizer: Path, engine: str, fmt: str, inputs: list[str]) -> dict:
    output = work / f"out-{engine}"
    shutil.rmtree(output, ignore_errors=True)
    result = run_json(PREPARE, [str(tokenizer), str(output), engine, fmt, *inputs])
    shutil.rmtree(output, ignore_errors=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
