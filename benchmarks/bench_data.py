"""prepare-data throughput against the tokenizers library's own encode_batch, and its peak memory as the input grows.

    python benchmarks/bench_data.py [--runs N] [--megabytes MB] [--vocab V]

Corpus: the Python standard library's .py files (sorted; the first MB megabytes), "1x";
"4x" is four copies of it. A byte-level BPE of V ids is trained on 1x first (not timed).
Each measurement is a fresh process, run N times interleaved (median):

  encode_batch     tokenizers.Tokenizer.encode_batch(texts) on all of 1x, texts already in memory,
                   the library's own thread pool over every core: the baseline (compute only)
  prepare-data     hpc-hsdp prepare-data DIR --glob '*.py' --tokenizer tokenizer.json, end to end:
                   start-up, reading, encoding, writing the shards (--engine processes / threads)

and prints tokens/s with the ratio to encode_batch (target >= 0.8), then the peak RSS
(ru_maxrss) of the prepare-data process and of its largest worker at 1x and 4x (target:
flat), beside encode_batch's, which holds every text and encoding at once.
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
TARGET_MEMORY_GROWTH = 1.25

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
    from hpc_hsdp.data.prepare import PrepareSpec, prepare
    tokenizer, output, engine, *inputs = sys.argv[1:]
    start = time.perf_counter()
    result = prepare(PrepareSpec(inputs=tuple(inputs), output=output, tokenizer=tokenizer, glob="*.py", engine=engine))
    seconds = time.perf_counter() - start
    print(json.dumps({"tokens": sum(result.num_tokens.values()), "seconds": seconds, "engine": result.engine,
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


def train_tokenizer(work: Path, inputs: list[str], vocab: int) -> Path:
    out = work / "trained"
    subprocess.run([sys.executable, "-m", "hpc_hsdp", "prepare-data", *inputs, "--glob", "*.py", "-o", str(out),
                    "--train-tokenizer", str(vocab), "-q"], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        files = stdlib_corpus(args.megabytes)
        one_x = build_inputs(work / "1x", files, 1)
        four_x = build_inputs(work / "4x", files, 4)
        size = sum(p.stat().st_size for p in files)
        tokenizer = train_tokenizer(work, one_x, args.vocab)
        print(f"corpus 1x: {len(files)} standard-library files, {size / 1e6:.1f} MB; 4x: {4 * size / 1e6:.1f} MB; "
              f"BPE {args.vocab}; {os.cpu_count()} CPUs; runs {args.runs}, interleaved")  # fmt: skip
        variants = {
            "encode_batch": lambda inputs: run_json(BASELINE, [str(tokenizer), *inputs]),
            "prepare-data (processes)": lambda inputs: _prepare(work, tokenizer, "processes", inputs),
            "prepare-data (threads)": lambda inputs: _prepare(work, tokenizer, "threads", inputs),
        }
        results: dict[tuple[str, str], list[dict]] = {}
        for _ in range(args.runs):
            for size_name, inputs in (("1x", one_x), ("4x", four_x)):
                for name, run in variants.items():
                    results.setdefault((name, size_name), []).append(run(inputs))
    base = statistics.median(r["tokens"] / r["seconds"] for r in results[("encode_batch", "1x")])
    print(f"\n{'variant':<26} {'tokens':>11} {'tokens/s 1x':>12} {'ratio':>6} {'tokens/s 4x':>12} "
          f"{'peak RSS 1x':>12} {'peak RSS 4x':>12} {'growth':>7}")  # fmt: skip
    verdicts = []
    for name in variants:
        rate = {s: statistics.median(r["tokens"] / r["seconds"] for r in results[(name, s)]) for s in ("1x", "4x")}
        rss = {s: statistics.median(max(r["rss_main"], r["rss_worker"]) for r in results[(name, s)]) for s in ("1x", "4x")}
        tokens = results[(name, "1x")][0]["tokens"]
        growth = rss["4x"] / rss["1x"]
        print(f"{name:<26} {tokens:>11,} {rate['1x'] / 1e6:>10.3f} M {rate['1x'] / base:>6.2f} {rate['4x'] / 1e6:>10.3f} M "
              f"{megabytes(rss['1x']):>12} {megabytes(rss['4x']):>12} {growth:>6.2f}x")  # fmt: skip
        if name.startswith("prepare-data"):
            main_rss = {s: statistics.median(r["rss_main"] for r in results[(name, s)]) for s in ("1x", "4x")}
            print(f"{'':<26} (main process alone: {megabytes(main_rss['1x'])} -> {megabytes(main_rss['4x'])})")
            verdicts.append((name, rate["1x"] / base, growth))
    for name, ratio, growth in verdicts:
        speed = "ok" if ratio >= TARGET_RATIO else "BELOW TARGET"
        memory = "flat" if growth <= TARGET_MEMORY_GROWTH else "GROWS"
        print(f"{name}: {ratio:.2f}x encode_batch (target >= {TARGET_RATIO}): {speed}; "
              f"peak memory 4x/1x = {growth:.2f} (target <= {TARGET_MEMORY_GROWTH}): {memory}")
    return 0


def _prepare(work: Path, tokenizer: Path, engine: str, inputs: list[str]) -> dict:
    output = work / f"out-{engine}"
    shutil.rmtree(output, ignore_errors=True)
    result = run_json(PREPARE, [str(tokenizer), str(output), engine, *inputs])
    shutil.rmtree(output, ignore_errors=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
