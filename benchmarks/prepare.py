"""Token-cache preparation speed and memory: a generated jsonl.zst corpus tokenised with bytes and with a BPE.

A corpus of ``--mb`` MiB of jsonl (records cut from the running Python's standard-library sources, so it is
real text, with no download), in 16 MiB shards, zstd-compressed, is tokenised into a fresh cache by a fresh
process for each row (``data.cache.load_tokens``, as a run or ``python -m data.prepare`` does), and each row
reports tokens/s, input MiB/s and the process's peak resident memory (VmHWM, which starts afresh at exec).
Rows: bytes, and a byte-level BPE (``--tokenizer``; default: one of 8,192 ids trained here on the standard library),
each with ``data.workers`` 1 and 2 (processes tokenising shards in parallel, ``data/workers.py``); the ``tokenizers``
library's own thread pool is held to one thread (``RAYON_NUM_THREADS=1``) so the rows compare processes alone.
A measurement, never a pass/fail test.

    python benchmarks/prepare.py [--mb 256] [--tokenizer PATH] [--dir PATH] [--rows bytes bpe]

``--rows`` picks the tokenizers measured (a BPE takes hours on a corpus of several GB on 2 cores, bytes minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zstandard  # noqa: E402

from data.tokenizer import main as tokenizer_cli  # noqa: E402

SHARD_BYTES = 16 << 20
CHILD = """
import sys, time
from data.cache import load_tokens
start = time.perf_counter()
tokens = load_tokens(sys.argv[1], sys.argv[2], tokenizer=sys.argv[3], workers=int(sys.argv[4]))
elapsed = time.perf_counter() - start
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
print(len(tokens), elapsed, peak)
"""


def generate(folder: Path, mib: int) -> int:
    """jsonl.zst shards of about ``mib`` MiB of records; returns the uncompressed bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in sources]
    written, shard, buffer = 0, 0, []
    pending = 0
    while written + pending < mib << 20:
        for text in texts:
            for start in range(0, len(text), 2000):  # records of ~2 KB, as short web documents are
                line = json.dumps({"text": text[start:start + 2000]}) + "\n"
                buffer.append(line)
                pending += len(line)
                if pending >= SHARD_BYTES or written + pending >= mib << 20:
                    data = "".join(buffer).encode()
                    packed = zstandard.ZstdCompressor(level=3).compress(data)
                    (folder / f"part-{shard:04d}.jsonl.zst").write_bytes(packed)
                    written, shard, buffer, pending = written + len(data), shard + 1, [], 0
                    if written >= mib << 20:
                        return written
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="MiB of uncompressed jsonl to generate")
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer.json (default: train one)")
    parser.add_argument("--dir", type=Path, default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--rows", nargs="+", choices=("bytes", "bpe"), default=["bytes", "bpe"],
                        help="which tokenizers to measure, each with 1 and 2 workers")
    args = parser.parse_args()
    work = args.dir or Path(tempfile.mkdtemp(prefix="prepare-bench-"))
    corpus = work / "corpus"
    size = generate(corpus, args.mb)
    tokenizer = args.tokenizer
    if tokenizer is None and "bpe" in args.rows:
        tokenizer = work / "bpe-8192.json"
        tokenizer_cli(["train", "--vocab-size", "8192", "--out", str(tokenizer)])
    print(f"corpus: {size / 2**20:,.0f} MiB of jsonl in {len(list(corpus.iterdir()))} zstd shards "
          f"({sum(p.stat().st_size for p in corpus.iterdir()) / 2**20:,.0f} MiB on disk)")
    print(f"{'tokenizer':<28} {'tokens':>14} {'s':>8} {'tokens/s':>12} {'MiB/s':>8} {'peak MiB':>9}")
    rows = [(f"{kind}, {workers} worker{'s' if workers > 1 else ''}", spec, workers)
            for kind, spec in (("bytes", "bytes"), ("BPE", str(tokenizer))) if kind.lower() in args.rows
            for workers in (1, 2)]
    for label, spec, workers in rows:
        env = dict(os.environ, RAYON_NUM_THREADS="1")
        cache = work / f"cache-{time.monotonic_ns()}"
        out = subprocess.run([sys.executable, "-c", CHILD, str(corpus), str(cache), spec, str(workers)], cwd=ROOT,
                             env=env, capture_output=True, text=True, check=True)
        tokens, elapsed, peak = out.stdout.split()
        tokens, elapsed = int(tokens), float(elapsed)
        print(f"{label:<28} {tokens:>14,} {elapsed:>8.1f} {tokens / elapsed:>12,.0f} "
              f"{size / 2**20 / elapsed:>8.1f} {int(peak) / 1024:>9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
