"""``moe-prepare`` with ``data.workers``: a builder killed with SIGKILL (which runs none of its cleanup) takes its
workers with it, and no worker's temporary file is left beside the cache. Before, the workers ran on (blocked on the
pool's queue for ever) and the files they had written stayed."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from data.tokenizer import train_bpe, write_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7919 % 1000}\n" for i in range(12000))


def children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux's /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(child) for child in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_killing_the_builder_stops_its_workers_and_leaves_no_temporary_file(tmp_path):
    corpus, cache = tmp_path / "corpus", tmp_path / "cache"
    corpus.mkdir()
    for i in range(6):  # ~0.8 MB each: seconds of BPE in two workers
        (corpus / f"part{i:02d}.txt").write_text(TEXT)
    tokenizer = tmp_path / "bpe.json"
    write_tokenizer(train_bpe([TEXT[:20000]], 300), tokenizer)
    builder = subprocess.Popen(
        [sys.executable, "-m", "data.prepare", "--set", f"data.source={corpus}", f"data.tokenizer={tokenizer}",
         "model.vocab_size=300", f"data.cache_dir={cache}", "data.workers=2"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(cache.glob(".*.file-*.tmp")) and builder.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert builder.poll() is None, "the build ended before the workers wrote: " + builder.stderr.read().decode()
    workers = children(builder.pid)
    assert len(workers) >= 2  # the two workers (and multiprocessing's resource tracker)
    builder.send_signal(signal.SIGKILL)
    builder.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:  # the test's own cleanup: no process outlives it
        os.kill(pid, signal.SIGKILL)
    assert not left, f"worker(s) {left} still running 10 s after their builder was killed"
    assert not list(cache.glob(".*.file-*.tmp"))
