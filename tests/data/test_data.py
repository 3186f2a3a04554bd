"""Tests for data/cache.py and data/sampler.py: corpus building and caching, splits, the training sampler, eval batches.

Expectations are computed here independently (listing files with pathlib, concatenating bytes, drawing
the permutation straight from the spec) rather than by calling the module's own helpers.
"""

import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy.testing import assert_array_equal

from data import cache as token_cache
from data.cache import load_tokens
from data.sampler import TokenSampler, eval_batches, split_tokens

SEP = b"\n\n"


def expected_stream(root: Path, rel_paths: list[str]) -> np.ndarray:
    joined = b"".join((root / rel).read_bytes() + SEP for rel in rel_paths)
    return np.frombuffer(joined, dtype=np.uint8).astype(np.uint16)


def write(path: Path, content: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "lib" / "python3.x"
    write(root / "os.py", b"import sys\n\ndef f():\n    return 1\n")
    write(root / "a_b.py", b"X = 1\n")
    write(root / "json" / "__init__.py", b"from .decoder import JSONDecoder\n")
    write(root / "json" / "decoder.py", b"class JSONDecoder:\n    pass\n")
    write(root / "README.txt", b"not python")
    write(root / "site-packages" / "thirdparty.py", b"THIRD = 1\n")
    write(root / "json" / "dist-packages" / "vendored.py", b"VENDORED = 1\n")
    fake_stdlib_path(monkeypatch, root)
    return root


def fake_stdlib_path(monkeypatch, root: Path) -> None:
    """Point only the "stdlib" entry of sysconfig's paths at ``root``; other callers keep the rest."""
    real_get_paths = sysconfig.get_paths

    def get_paths(*args, **kwargs) -> dict[str, str]:
        return {**real_get_paths(*args, **kwargs), "stdlib": str(root)}

    monkeypatch.setattr(sysconfig, "get_paths", get_paths)


def test_stdlib_corpus_is_sorted_py_files_each_followed_by_separator(fake_stdlib, tmp_path):
    tokens = load_tokens("stdlib", tmp_path / "cache")
    rel_paths = sorted(p.relative_to(fake_stdlib).as_posix() for p in fake_stdlib.rglob("*.py"))
    rel_paths = [r for r in rel_paths if "site-packages" not in r and "dist-packages" not in r]
    assert rel_paths == ["a_b.py", "json/__init__.py", "json/decoder.py", "os.py"]
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and tokens.ndim == 1
    assert_array_equal(tokens, expected_stream(fake_stdlib, rel_paths))


def test_stdlib_cache_is_reused_and_invalidated_by_a_changed_file(fake_stdlib, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = load_tokens("stdlib", cache)
    cache_file = Path(first.filename)
    mtime = cache_file.stat().st_mtime_ns
    # no temp file left behind; the files were written just now, so their digests are kept to re-check
    assert sorted(p.name for p in cache.iterdir()) == sorted([cache_file.name, cache_file.stem + ".racy.json"])

    def must_not_rebuild(*args, **kwargs):
        raise AssertionError("the cached corpus was rebuilt")

    with monkeypatch.context() as patch:
        patch.setattr(token_cache, "_write_tokens", must_not_rebuild)
        again = load_tokens("stdlib", cache)
    assert Path(again.filename) == cache_file and cache_file.stat().st_mtime_ns == mtime
    assert_array_equal(again, first)

    write(fake_stdlib / "os.py", b"import sys  # grew\n")
    changed = load_tokens("stdlib", cache)
    assert Path(changed.filename) != cache_file and len(list(cache.glob("*.bin"))) == 2
    assert bytes(changed.astype(np.uint8)).startswith(b"X = 1\n\n\n")


def test_empty_stdlib_raises_naming_data_source(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    fake_stdlib_path(monkeypatch, tmp_path / "empty")
    with pytest.raises(ValueError, match=r"data\.source='stdlib': no text in its 0 file"):
        load_tokens("stdlib", tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.fixture(scope="module")
def real_stdlib(tmp_path_factory) -> tuple[np.memmap, Path]:
    cache = tmp_path_factory.mktemp("stdlib-cache")
    return load_tokens("stdlib", cache), cache


def test_real_stdlib_corpus_counts_every_file_and_is_python(real_stdlib):
    tokens, _ = real_stdlib
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if p.is_file() and not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    ]
    assert len(files) > 500
    assert len(tokens) == sum(p.stat().st_size for p in files) + len(SEP) * len(files)
    assert int(tokens.max()) < 256
    head = bytes(tokens[:2_000_000].astype(np.uint8)).decode("utf-8", errors="replace")
    assert "def " in head and "import " in head


def test_real_stdlib_second_call_maps_the_same_cache(real_stdlib, monkeypatch):
    tokens, cache = real_stdlib
    mtime = Path(tokens.filename).stat().st_mtime_ns
    monkeypatch.setattr(token_cache, "_write_tokens", lambda *a, **k: pytest.fail("rebuilt the stdlib cache"))
    again = load_tokens("stdlib", cache)
    assert again.filename == tokens.filename and Path(again.filename).stat().st_mtime_ns == mtime
    assert len(again) == len(tokens)


def test_text_folder_refuses_binary_files_unless_skipped_and_leaves_hidden_files_out(tmp_path):
    folder = tmp_path / "corpus"
    write(folder / "b.txt", b"second file")
    write(folder / "a" / "z.md", "first file, caf\u00e9".encode())
    write(folder / "image.png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    write(folder / "late_nul.txt", b"x" * 9000 + b"\x00tail")  # NUL past the 8 KiB sniff: kept as text
    write(folder / ".git" / "config", b"[core]")
    write(folder / ".notes", b"hidden")
    with pytest.raises(ValueError, match=r"1 file\(s\) in no format taken here: image\.png\. Formats taken: .*skip"):
        load_tokens(str(folder), tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # refused before any work
    tokens = load_tokens(str(folder), tmp_path / "cache", skip=["*.png"])
    assert_array_equal(tokens, expected_stream(folder, ["a/z.md", "b.txt", "late_nul.txt"]))


def test_single_text_file_and_an_unreadable_file_is_an_error_naming_it(tmp_path, monkeypatch):
    path = tmp_path / "book.txt"
    write(path, b"Call me Ishmael.")
    assert_array_equal(load_tokens(str(path), tmp_path / "c1"), expected_stream(tmp_path, ["book.txt"]))

    folder = tmp_path / "docs"
    write(folder / "ok.txt", b"readable")
    write(folder / "secret.txt", b"unreadable")
    real_open = open

    def open_or_deny(file, *args, **kwargs):
        if Path(file).name == "secret.txt":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(token_cache, "open", open_or_deny, raising=False)
    with pytest.raises(ValueError, match=r"data\.source: cannot read .*secret\.txt \(Permission denied\)"):
        load_tokens(str(folder), tmp_path / "c2")
    assert [p.name for p in (tmp_path / "c2").iterdir()] == []  # no partial cache


def test_folder_of_only_binary_or_empty_files_is_refused_naming_them(tmp_path):
    write(tmp_path / "corpus" / "blob", b"\x00\x01\x02")
    with pytest.raises(ValueError, match=r"data\.source='.*corpus': 1 file\(s\) in no format taken here: blob"):
        load_tokens(str(tmp_path / "corpus"), tmp_path / "cache")
    write(tmp_path / "empty" / "a.jsonl", b"\n\n")  # no record at all
    with pytest.raises(ValueError, match=r"data\.source='.*empty': no text in its 1 file\(s\)"):
        load_tokens(str(tmp_path / "empty"), tmp_path / "cache")


def test_bin_is_memory_mapped_in_place(tmp_path):
    path = tmp_path / "tokens.bin"
    values = (np.arange(1000) * 37 % 50_000).astype(np.uint16)
    values.tofile(path)
    with pytest.raises(ValueError, match=r"pre-tokenised, but data\.token_dtype=None; state the dtype"):
        load_tokens(str(path), tmp_path / "cache")
    tokens = load_tokens(str(path), tmp_path / "cache", token_dtype="uint16")
    assert isinstance(tokens, np.memmap) and Path(tokens.filename) == path
    assert_array_equal(tokens, values)
    assert not (tmp_path / "cache").exists()  # nothing copied or cached


@pytest.mark.parametrize("content", [b"", b"\x01\x02\x03"], ids=["empty", "odd"])
def test_bin_with_impossible_size_raises(tmp_path, content):
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"data\.source='{path}': .*{len(content)} bytes.*uint16"):
        load_tokens(str(path), tmp_path / "cache", token_dtype="uint16")


@pytest.mark.parametrize("name", ["missing", "missing.bin"])
def test_missing_source_names_data_source_and_valid_choices(tmp_path, name):
    source = str(tmp_path / name)
    with pytest.raises(ValueError) as error:
        load_tokens(source, tmp_path / "cache", token_dtype="uint16")
    message = str(error.value)
    assert f"data.source='{source}': no such file or folder" in message
    assert "'stdlib'" in message and ".bin" in message


def test_split_tokens_returns_head_and_tail_views():
    tokens = np.arange(1000, dtype=np.uint16)
    train, val = split_tokens(tokens, 0.1)
    assert_array_equal(train, np.arange(900))
    assert_array_equal(val, np.arange(900, 1000))
    assert np.shares_memory(train, tokens) and np.shares_memory(val, tokens)
    with pytest.raises(ValueError, match="data.val_fraction"):
        split_tokens(tokens, 1.5)
    with pytest.raises(ValueError, match="data.val_fraction"):
        split_tokens(tokens[:5], 0.1)  # 0 validation tokens


# A stream whose token values are their positions, so a window reveals where it starts.
SEQ = 8
WINDOWS = 37
STREAM = np.arange(WINDOWS * SEQ + 1, dtype=np.uint16)


def starts_of(inputs: torch.Tensor) -> list[int]:
    return inputs[:, 0].tolist()


def test_sampler_windows_are_token_stream_slices_with_shifted_targets():
    inputs, targets = TokenSampler(STREAM, SEQ, seed=3).next_batch(6)
    assert inputs.shape == targets.shape == (6, SEQ) and inputs.dtype == targets.dtype == torch.int64
    for row_in, row_target in zip(inputs, targets, strict=True):
        start = int(row_in[0])
        assert start % SEQ == 0
        assert row_in.tolist() == STREAM[start : start + SEQ].tolist()
        assert row_target.tolist() == STREAM[start + 1 : start + SEQ + 1].tolist()


def test_sampler_order_is_seeded_permutation_per_epoch_without_repeats():
    sampler = TokenSampler(STREAM, SEQ, seed=5)
    starts = []
    for _ in range(WINDOWS):  # 2 * WINDOWS samples; batch 18 straddles the epoch boundary
        starts += starts_of(sampler.next_batch(2)[0])
    epoch0, epoch1 = starts[:WINDOWS], starts[WINDOWS:]
    assert sorted(epoch0) == sorted(epoch1) == [w * SEQ for w in range(WINDOWS)]
    assert epoch0 == (np.random.default_rng((5, 0)).permutation(WINDOWS) * SEQ).tolist()
    assert epoch1 == (np.random.default_rng((5, 1)).permutation(WINDOWS) * SEQ).tolist()
    assert epoch0 != epoch1


def test_sampler_is_deterministic_per_seed():
    a, b, c = (TokenSampler(STREAM, SEQ, seed=s) for s in (1, 1, 2))
    for _ in range(3):
        batch_a, batch_b, batch_c = a.next_batch(4), b.next_batch(4), c.next_batch(4)
        assert torch.equal(batch_a[0], batch_b[0]) and torch.equal(batch_a[1], batch_b[1])
    assert not torch.equal(batch_a[0], batch_c[0])


def test_dp_ranks_partition_the_global_batch():
    single = TokenSampler(STREAM, SEQ, seed=0)
    ranks = [TokenSampler(STREAM, SEQ, seed=0, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(12):  # crosses an epoch boundary
        whole_in, whole_target = single.next_batch(6)
        parts = [rank.next_batch(6) for rank in ranks]
        assert all(p[0].shape == (3, SEQ) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), whole_in)
        assert torch.equal(torch.cat([p[1] for p in parts]), whole_target)
    with pytest.raises(ValueError, match="global_batch_size=5"):
        ranks[0].next_batch(5)


def test_state_dict_resume_continues_exactly_even_with_another_dp_size():
    uninterrupted = TokenSampler(STREAM, SEQ, seed=7)
    expected = [starts_of(uninterrupted.next_batch(4)[0]) for _ in range(20)]

    before = TokenSampler(STREAM, SEQ, seed=7)
    for _ in range(8):
        before.next_batch(4)
    state = before.state_dict()
    assert state == {"samples_seen": 32, "seed": 7, "seq_len": SEQ}

    resumed = TokenSampler(STREAM, SEQ, seed=7)
    resumed.load_state_dict(dict(state))
    assert [starts_of(resumed.next_batch(4)[0]) for _ in range(12)] == expected[8:]

    ranks = [TokenSampler(STREAM, SEQ, seed=7, dp_rank=r, dp_size=4) for r in range(4)]
    for rank in ranks:
        rank.load_state_dict(dict(state))
    got = [sum((starts_of(rank.next_batch(4)[0]) for rank in ranks), []) for _ in range(12)]
    assert got == expected[8:]


@pytest.mark.parametrize("field", ["seed", "seq_len"])
def test_load_state_dict_rejects_a_different_seed_or_seq_len(field):
    state = TokenSampler(STREAM, SEQ, seed=7).state_dict()
    state[field] += 1
    with pytest.raises(ValueError, match=rf"sampler state {field}="):
        TokenSampler(STREAM, SEQ, seed=7).load_state_dict(state)


def test_sampler_rejects_a_split_shorter_than_one_window():
    with pytest.raises(ValueError, match=r"training split has 8 tokens.*model\.seq_len"):
        TokenSampler(STREAM[:SEQ], SEQ, seed=0)
    assert TokenSampler(STREAM[: SEQ + 1], SEQ, seed=0).num_windows == 1


def test_eval_batches_are_fixed_windows_that_wrap_on_a_short_split():
    val = STREAM[: 5 * SEQ + 3]  # 5 windows
    batches = list(eval_batches(val, SEQ, batch_size=4, num_batches=3))
    assert [starts_of(inputs) for inputs, _ in batches] == [
        [w % 5 * SEQ for w in range(b * 4, b * 4 + 4)] for b in range(3)
    ]
    for inputs, targets in batches:
        assert torch.equal(targets, inputs + 1) and inputs.dtype == torch.int64
    again = list(eval_batches(val, SEQ, batch_size=4, num_batches=3))
    for (inputs, targets), (inputs_again, targets_again) in zip(batches, again, strict=True):
        assert torch.equal(inputs, inputs_again) and torch.equal(targets, targets_again)

    per_rank = [list(eval_batches(val, SEQ, 4, 3, dp_rank=r, dp_size=2)) for r in range(2)]
    for b, (inputs, _) in enumerate(batches):
        assert torch.equal(torch.cat([per_rank[0][b][0], per_rank[1][b][0]]), inputs)


def test_eval_batches_spread_over_the_whole_split():
    val = STREAM[: 20 * SEQ + 1]  # 20 windows, 4 needed: every fifth
    batches = list(eval_batches(val, SEQ, batch_size=2, num_batches=2))
    assert [starts_of(inputs) for inputs, _ in batches] == [[0, 5 * SEQ], [10 * SEQ, 15 * SEQ]]


def test_eval_batches_checks_arguments_before_iteration():
    with pytest.raises(ValueError, match="validation split has 5 tokens"):
        eval_batches(STREAM[:5], SEQ, batch_size=2, num_batches=1)
    with pytest.raises(ValueError, match="global_batch_size=3"):
        eval_batches(STREAM, SEQ, batch_size=3, num_batches=1, dp_rank=0, dp_size=2)


def test_cache_files_are_readable_by_other_users(fake_stdlib, tmp_path):
    tokens = load_tokens("stdlib", tmp_path / "cache")
    assert os.stat(tokens.filename).st_mode & 0o777 == 0o644
