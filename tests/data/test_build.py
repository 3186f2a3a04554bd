"""Building the token cache for corpora larger than memory: bounded memory, resumable, one builder at a time.

The reference stream is built here from the records themselves (json.loads of each line, joined with the byte
separator), not by the cache's code.
"""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from data import build
from data import cache as token_cache
from data.cache import load_tokens

ROOT = Path(__file__).resolve().parents[2]


def write_shards(folder: Path, shards: int, records: int, width: int = 100) -> list[str]:
    """``shards`` jsonl files of ``records`` records each; returns every record's text in corpus order."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = []
    for shard in range(shards):
        lines = []
        for i in range(records):
            text = f"shard {shard} record {i} " + "x" * (width - 20)
            texts.append(text)
            lines.append(json.dumps({"text": text}))
        (folder / f"part-{shard:03d}.jsonl").write_text("\n".join(lines) + "\n")
    return texts


def reference(texts: list[str]) -> np.ndarray:
    return np.frombuffer(b"".join(t.encode() + b"\n\n" for t in texts), dtype=np.uint8).astype(np.uint16)


class Interrupted(BaseException):
    """Stands for KeyboardInterrupt (which pytest would take as the person stopping the test run)."""


def test_an_interrupted_build_resumes_after_its_last_checkpoint_and_serves_the_same_stream(tmp_path, monkeypatch):
    texts = write_shards(tmp_path / "corpus", shards=5, records=50)
    monkeypatch.setattr(token_cache, "CHECKPOINT_SECONDS", 0.0)  # a checkpoint after every file
    real_read, opened, interrupt = token_cache.read_documents, [], [True]

    def interrupted(path, *args, **kwargs):
        opened.append(Path(path).name)
        if Path(path).name == "part-003.jsonl" and interrupt:
            interrupt.pop()
            raise Interrupted  # Ctrl-C (or a killed job) in the middle of the fourth file
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(token_cache, "read_documents", interrupted)
    with pytest.raises(Interrupted):
        load_tokens(str(tmp_path / "corpus"), tmp_path / "cache")
    left = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(left) == 2 and left[0].endswith(".bin.partial") and left[1].endswith(".progress.json")  # no cache
    assert json.loads((tmp_path / "cache" / left[1]).read_text())["files"] == 3

    opened.clear()
    tokens = load_tokens(str(tmp_path / "corpus"), tmp_path / "cache")
    assert opened == ["part-003.jsonl", "part-004.jsonl"]  # the first three files were not read again
    assert_array_equal(tokens, reference(texts))
    cache = Path(tokens.filename)  # and no partial work left (the racy record: the files were just written)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [cache.name, cache.with_suffix(".racy.json").name]


def test_bad_input_discards_the_partial_work(tmp_path, monkeypatch):
    write_shards(tmp_path / "corpus", shards=3, records=5)
    (tmp_path / "corpus" / "part-002.jsonl").write_text('{"text": "fine"}\n{"body": 1}\n')
    monkeypatch.setattr(token_cache, "CHECKPOINT_SECONDS", 0.0)
    with pytest.raises(ValueError, match=r"part-002\.jsonl, line 2: no 'text' field"):
        load_tokens(str(tmp_path / "corpus"), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_concurrent_builders_tokenise_once_and_a_waiter_gives_up_naming_what_it_waited_for(tmp_path, monkeypatch):
    texts = write_shards(tmp_path / "corpus", shards=2, records=20)
    real_write, builds = token_cache._write_tokens, []

    def slow_write(*args, **kwargs):
        builds.append(1)
        time.sleep(0.5)  # long enough for the other thread to find the lock held
        return real_write(*args, **kwargs)

    monkeypatch.setattr(token_cache, "_write_tokens", slow_write)
    results = [None, None]

    def rank(r):
        results[r] = np.array(load_tokens(str(tmp_path / "corpus"), tmp_path / "cache"))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert_array_equal(results[0], reference(texts))
    assert_array_equal(results[1], reference(texts))

    monkeypatch.setattr(build, "WAIT_SECONDS", 0.3)
    with build.build_lock(tmp_path / "cache", "a test") as held:  # another process, building
        assert held
        with pytest.raises(ValueError, match=r"waited \d+ s for another process to finish building a token cache "
                                             r"there \(needed: the tokens of .*other\)"):
            write_shards(tmp_path / "other", shards=1, records=1)
            load_tokens(str(tmp_path / "other"), tmp_path / "cache")


# The peak resident set of this process alone: /proc's VmHWM starts afresh at exec (getrusage's ru_maxrss would
# carry the forking parent's peak over).
PEAK_SCRIPT = """
import sys
from data.cache import load_tokens
def peak_kib():
    return int(next(line for line in open("/proc/self/status") if line.startswith("VmHWM")).split()[1])
before = peak_kib()
tokens = load_tokens(sys.argv[1], sys.argv[2])
print(len(tokens), before, peak_kib())
"""


def test_building_a_cache_takes_memory_independent_of_the_corpus_size(tmp_path):
    """Peak resident memory of a fresh process building caches of 4 MB and 48 MB of jsonl: the same within a few MB
    (a build that held the corpus or the tokens in memory would grow by at least the 48 MB)."""
    growth = {}
    for name, shards in (("small", 1), ("large", 12)):
        texts = write_shards(tmp_path / name, shards=shards, records=40_000)  # 4 MB a shard
        out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / name), str(tmp_path / "cache")],
                             cwd=ROOT, capture_output=True, text=True, check=True, timeout=300)
        count, before, after = map(int, out.stdout.split())
        assert count == sum(len(t) + 2 for t in texts)
        growth[name] = (after - before) / 1024  # MiB
    assert growth["large"] < growth["small"] + 8, growth


def test_prepare_builds_every_source_of_a_config_and_a_run_then_maps_them(tmp_path, capsys, monkeypatch):
    from data.prepare import main as prepare

    a = write_shards(tmp_path / "a", shards=2, records=300)
    b = write_shards(tmp_path / "b", shards=1, records=300)
    settings = ["--set", f"data.sources=[{{path: {tmp_path / 'a'}, weight: 2}}, {{path: {tmp_path / 'b'}}}]",
                f"data.cache_dir={tmp_path / 'cache'}", "model.seq_len=64"]
    assert prepare(settings) == 0
    err = capsys.readouterr().err
    assert f"a: {len(reference(a)):,} tokens (uint16)" in err and f"b: {len(reference(b)):,} tokens (uint16)" in err
    monkeypatch.setattr(token_cache, "_write_tokens", lambda *a, **k: pytest.fail("built again"))
    assert prepare(settings) == 0  # the caches are there: mapped, not built
    assert prepare(["--set", f"data.source={tmp_path / 'missing'}"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
