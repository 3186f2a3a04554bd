"""Real tokenizers: training a BPE, the token cache under a tokenizer.json, and the vocabulary checks.

The oracle is the ``tokenizers`` library itself, called directly on each document's text; our cache must
hold exactly its ids, separated as the byte stream is.
"""

import json
import math
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from numpy.testing import assert_array_equal
from tokenizers import Tokenizer, models, pre_tokenizers

import train
from config.errors import ConfigError
from config.run import load_config
from data import cache as token_cache
from data.cache import load_tokens
from data.tokenizer import document_end_token
from data.tokenizer import main as tokenizer_cli
from training.metrics import read_metrics

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# ~130 KB of varied Python: enough text for a few hundred merges, read in well under a second
SAMPLE_FILES = ["textwrap.py", "string.py", "json/decoder.py", "json/encoder.py", "shlex.py", "fnmatch.py"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    for name in SAMPLE_FILES:
        shutil.copy(STDLIB / name, folder / name.replace("/", "_"))
    (folder / "unicode.txt").write_text("caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \u2014 \U0001f600 ok\n",
                                        encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("tok") / "bpe-512.json"
    assert tokenizer_cli(["train", "--source", str(corpus), "--vocab-size", "512", "--out", str(out)]) == 0
    return out


def reference_stream(tokenizer_file: Path, folder: Path) -> np.ndarray:
    """The tokenizers library on each document (sorted by name) plus the separator, concatenated."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    ids = []
    for path in sorted(folder.iterdir()):
        ids += tokenizer.encode(path.read_text(encoding="utf-8") + "\n\n", add_special_tokens=False).ids
    return np.array(ids)


def test_training_is_deterministic_and_gives_the_vocabulary_asked_for(bpe, corpus, tmp_path):
    again = tmp_path / "again.json"
    assert tokenizer_cli(["train", "--source", str(corpus), "--vocab-size", "512", "--out", str(again)]) == 0
    assert again.read_bytes() == bpe.read_bytes()
    trained = Tokenizer.from_file(str(bpe))
    assert trained.get_vocab_size() == 512
    assert json.loads(bpe.read_text())["model"]["type"] == "BPE"


def test_the_cache_holds_the_tokenizers_ids_and_decodes_back_to_the_text(bpe, corpus, tmp_path):
    tokens = load_tokens(str(corpus), tmp_path / "cache", 512, str(bpe))
    assert tokens.dtype == np.uint16 and Path(tokens.filename).stat().st_size == 2 * len(tokens)
    assert_array_equal(tokens, reference_stream(bpe, corpus))
    texts = "".join(p.read_text(encoding="utf-8") + "\n\n" for p in sorted(corpus.iterdir()))
    assert Tokenizer.from_file(str(bpe)).decode(tokens.tolist()) == texts  # byte-level: a lossless round trip
    assert len(tokens) < len(texts.encode()) / 2  # and a real compression over bytes


def test_the_stream_does_not_depend_on_how_files_are_read(bpe, corpus, tmp_path, monkeypatch):
    """Reads of 7 bytes split lines and multi-byte characters; pieces of 100 characters cut every document."""
    whole = load_tokens(str(corpus), tmp_path / "whole", tokenizer=str(bpe))
    monkeypatch.setattr(token_cache, "CHUNK_BYTES", 7)
    assert_array_equal(load_tokens(str(corpus), tmp_path / "small-reads", tokenizer=str(bpe)), whole)
    monkeypatch.setattr("data.tokenizer.MAX_PIECE_CHARS", 100)
    monkeypatch.setattr("data.tokenizer.BATCH_CHARS", 1000)
    pieces = load_tokens(str(corpus), tmp_path / "pieces", tokenizer=str(bpe))
    monkeypatch.setattr(token_cache, "CHUNK_BYTES", 13)
    assert_array_equal(load_tokens(str(corpus), tmp_path / "pieces-13", tokenizer=str(bpe)), pieces)
    # cut pieces tokenise differently at their cuts, but hold the same text
    tokenizer = Tokenizer.from_file(str(bpe))
    assert len(pieces) != len(whole) and tokenizer.decode(pieces.tolist()) == tokenizer.decode(whole.tolist())


def test_each_tokenizer_has_its_own_cache(bpe, corpus, tmp_path, monkeypatch):
    other = tmp_path / "bpe-300.json"
    assert tokenizer_cli(["train", "--source", str(corpus), "--vocab-size", "300", "--out", str(other)]) == 0
    cache = tmp_path / "cache"
    streams = {spec: np.array(load_tokens(str(corpus), cache, tokenizer=spec)) for spec in ("bytes", str(bpe),
                                                                                         str(other))}
    assert len(list(cache.glob("*.bin"))) == 3
    raw = b"".join(p.read_bytes() + b"\n\n" for p in sorted(corpus.iterdir()))
    assert_array_equal(streams["bytes"], np.frombuffer(raw, dtype=np.uint8))
    assert_array_equal(streams[str(other)], reference_stream(other, corpus))
    monkeypatch.setattr(token_cache, "_write_tokens", lambda *a, **k: pytest.fail("rebuilt a cache"))
    for spec, stream in streams.items():
        assert_array_equal(load_tokens(str(corpus), cache, tokenizer=spec), stream)
    # the same name with other content is another tokenizer
    shutil.copy(other, bpe.parent / "renamed.json")
    monkeypatch.undo()
    assert_array_equal(load_tokens(str(corpus), cache, tokenizer=str(bpe.parent / "renamed.json")),
                       streams[str(other)])
    assert len(list(cache.glob("*.bin"))) == 3  # the same bytes: the same cache, whatever the path


@pytest.fixture
def wide_vocabulary(tmp_path) -> Path:
    """A word-level tokenizer whose ids run to 70,000: more than uint16 holds."""
    vocab = {"[UNK]": 0} | {f"w{i}": i for i in range(1, 70_001)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = tmp_path / "wide.json"
    tokenizer.save(str(path))
    return path


def test_a_vocabulary_over_65536_is_cached_as_uint32(wide_vocabulary, tmp_path):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("w1 w70000 w65536 w65535 nonsense w2")
    tokens = load_tokens(str(tmp_path / "text"), tmp_path / "cache", 70_001, str(wide_vocabulary))
    assert tokens.dtype == np.uint32 and Path(tokens.filename).stat().st_size == 4 * len(tokens)
    assert tokens.tolist() == [1, 70_000, 65_536, 65_535, 0, 2]
    with pytest.raises(ValueError, match=r"vocabulary of 70,001 ids, more than model.vocab_size=65,536"):
        load_tokens(str(tmp_path / "text"), tmp_path / "cache", 65_536, str(wide_vocabulary))


def test_bad_tokenizers_fail_before_any_work_with_what_to_do(bpe, corpus, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"data.tokenizer='.*bpe-512.json' has a vocabulary of 512 ids, more than "
                                         r"model.vocab_size=300; set model.vocab_size to at least 512"):
        load_tokens(str(corpus), cache, 300, str(bpe))
    missing = str(tmp_path / "none.json")
    with pytest.raises(ValueError, match=rf"data.tokenizer='{missing}': no such file; train a BPE on this corpus "
                                         rf"with `python -m data.tokenizer train --source stdlib --vocab-size 4096 "
                                         rf"--out {missing}`"):
        load_tokens("stdlib", cache, 4096, missing)
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(ValueError, match=r"data.tokenizer='.*corrupt.json': not a valid tokenizer.json"):
        load_tokens(str(corpus), cache, 512, str(corrupt))
    assert not cache.exists()  # nothing was tokenised
    with pytest.raises(ConfigError, match=r"a .bin is already tokenised, so no tokenizer applies to it"):
        load_config("moe-8x", ["data.source=tokens.bin", "data.token_dtype=uint16", f"data.tokenizer={bpe}"])
    assert tokenizer_cli(["train", "--vocab-size", "100", "--out", str(tmp_path / "t.json")]) == 2
    for empty in ("", "  "):  # an empty path would train on the current directory
        assert tokenizer_cli(["train", "--source", empty, "--vocab-size", "300", "--out", str(tmp_path / "t.json")]
                             ) == 2
        assert not (tmp_path / "t.json").exists()


TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64", "model.ffn_hidden=128",
        "moe.num_experts=4", "moe.expert_hidden=64", "train.global_batch_size=8", "train.warmup_steps=5",
        "train.precision=fp32", "logging.wandb=disabled", "logging.log_interval=5", "train.eval_batches=2",
        "train.eval_interval=0", "data.val_fraction=0.05"]


def test_a_run_trains_on_a_bpe_vocabulary_and_refuses_one_too_large(bpe, corpus, tmp_path, capsys):
    common = ["--config", "moe-8x-bpe", "--set", *TINY, f"data.source={corpus}", f"data.tokenizer={bpe}",
              f"data.cache_dir={tmp_path / 'cache'}"]
    assert train.main([*common, "model.vocab_size=512", "train.steps=40", "--run-dir", str(tmp_path / "run")]) == 0
    losses = [r["train/loss"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert losses[0] > 0.8 * math.log(512)  # a model that knows nothing of 512 ids starts near ln(512)
    assert losses[-1] < losses[0] - 0.5  # measured: 6.18 over steps 1-5, 5.26 over steps 36-40
    assert f"tokenizer: {bpe}" in (tmp_path / "run" / "config.yaml").read_text()
    capsys.readouterr()
    assert train.main([*common, "model.vocab_size=500", "--run-dir", str(tmp_path / "small")]) == 2
    assert "has a vocabulary of 512 ids, more than model.vocab_size=500" in capsys.readouterr().err
    assert not (tmp_path / "small").exists()


# --- document ends (issue 25 §2) ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_with_eos(tmp_path_factory, bpe) -> Path:
    """The corpus BPE plus the special tokens a published tokenizer has: an end-of-text token and another."""
    tokenizer = Tokenizer.from_file(str(bpe))
    tokenizer.add_special_tokens(["<|pad|>", "<|endoftext|>"])
    out = tmp_path_factory.mktemp("tok") / "bpe-eos.json"
    tokenizer.save(str(out))
    return out


def reference_with_token(tokenizer_file: Path, folder: Path, end: str) -> np.ndarray:
    """Each document's ids from the tokenizers library, then the id it gives the end token, concatenated."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    end_id = tokenizer.token_to_id(end)
    ids = []
    for path in sorted(folder.iterdir()):
        ids += tokenizer.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids + [end_id]
    return np.array(ids)


def test_documents_end_with_the_tokenizers_end_of_text_token_by_default(bpe_with_eos, corpus, tmp_path):
    tokens = load_tokens(str(corpus), tmp_path / "cache", 600, str(bpe_with_eos))
    assert_array_equal(tokens, reference_with_token(bpe_with_eos, corpus, "<|endoftext|>"))
    eos = Tokenizer.from_file(str(bpe_with_eos)).token_to_id("<|endoftext|>")
    assert int((np.asarray(tokens) == eos).sum()) == len(list(corpus.iterdir()))  # one per document, no more
    # another added token named explicitly; a text that is no token is encoded, as "\n\n" always was
    ending = lambda end: load_tokens(str(corpus), tmp_path / "cache", 600, str(bpe_with_eos),  # noqa: E731
                                     document_end_spec=end)
    assert_array_equal(ending("<|pad|>"), reference_with_token(bpe_with_eos, corpus, "<|pad|>"))
    assert_array_equal(ending("\n\n"), reference_stream(bpe_with_eos, corpus))
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 3  # each end its own cache


def test_bytes_and_a_tokenizer_without_one_end_with_the_text_separator_or_the_text_asked_for(bpe, corpus, tmp_path):
    assert_array_equal(load_tokens(str(corpus), tmp_path / "cache", 512, str(bpe)), reference_stream(bpe, corpus))
    texts = b"".join(p.read_bytes() + b"<END>" for p in sorted(corpus.iterdir()))
    assert_array_equal(load_tokens(str(corpus), tmp_path / "cache", document_end_spec="<END>"),
                       np.frombuffer(texts, dtype=np.uint8))


def test_the_run_config_holds_the_resolved_document_end(bpe_with_eos, bpe, corpus):
    def resolved(*settings: str) -> str:
        args = train.parse_args(["--config", "moe-8x-bpe", "--set", f"data.source={corpus}", *settings])
        return train.check(args)[0].data.document_end

    assert resolved(f"data.tokenizer={bpe_with_eos}", "model.vocab_size=600") == "<|endoftext|>"
    assert resolved(f"data.tokenizer={bpe}", "model.vocab_size=512") == "\n\n"
    assert resolved("data.tokenizer=bytes", "model.vocab_size=512") == "\n\n"
    assert resolved(f"data.tokenizer={bpe_with_eos}", "model.vocab_size=600", "data.document_end=<|pad|>") == "<|pad|>"
    with pytest.raises(ConfigError, match="data.document_end is empty"):
        load_config("moe-8x", ["data.document_end="])


def test_document_masking_needs_one_end_token_and_says_which_to_set(bpe_with_eos, bpe, corpus):
    def masked(*settings: str) -> dict:
        args = train.parse_args(["--config", "moe-8x-bpe", "--set", f"data.source={corpus}", "data.document_mask=true",
                                 *settings])
        return train.check(args)[0].to_dict()["data"]

    eos = Tokenizer.from_file(str(bpe_with_eos)).token_to_id("<|endoftext|>")
    assert document_end_token(str(bpe_with_eos), "auto") == eos
    # the run's config holds the setting
    assert masked(f"data.tokenizer={bpe_with_eos}", "model.vocab_size=600")["document_mask"] is True
    assert document_end_token("bytes", "\x1e") == 0x1E
    assert masked("data.tokenizer=bytes", "model.vocab_size=512", 'data.document_end="\\x1e"')["document_end"] == "\x1e"
    with pytest.raises(ConfigError, match=r"'\\n\\n' is 2 bytes with data.tokenizer='bytes'; set data.document_end "
                                          r"to one character that no document holds, such as \"\\x1e\""):
        masked("data.tokenizer=bytes", "model.vocab_size=512")
    with pytest.raises(ConfigError, match="is a text, not one of its added tokens .* set data.document_end to an added "
                                          "token"):  # a text end of a tokenizer.json can merge with the text before it
        masked(f"data.tokenizer={bpe}", "model.vocab_size=512")


# --- several workers (issue 25 §4) ----------------------------------------------------------------------------------


def test_two_workers_write_the_stream_one_process_writes_and_a_bad_record_names_its_file(bpe_with_eos, corpus,
                                                                                          tmp_path):
    mixed = tmp_path / "mixed"
    shutil.copytree(corpus, mixed)
    records = [{"text": f"record {i}: caf\u00e9 " * (i + 1)} for i in range(30)]
    (mixed / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    one = load_tokens(str(mixed), tmp_path / "one", 600, str(bpe_with_eos))
    two = load_tokens(str(mixed), tmp_path / "two", 600, str(bpe_with_eos), workers=2)
    assert_array_equal(two, one)
    # and the reference: the tokenizers library on each document (files by name, records in order), end token after
    tokenizer = Tokenizer.from_file(str(bpe_with_eos))
    eos = tokenizer.token_to_id("<|endoftext|>")
    texts = []
    for path in sorted(mixed.iterdir()):
        texts += [r["text"] for r in records] if path.suffix == ".jsonl" else [path.read_text(encoding="utf-8")]
    want = [i for text in texts for i in tokenizer.encode(text, add_special_tokens=False).ids + [eos]]
    assert_array_equal(two, want)
    assert sorted(p.name for p in (tmp_path / "two").iterdir() if p.name.startswith(".")) == []  # no parts left

    (mixed / "records.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(ValueError, match=r"records\.jsonl, line 2: no 'text' field"):
        load_tokens(str(mixed), tmp_path / "bad", 600, str(bpe_with_eos), workers=2)
    assert list((tmp_path / "bad").iterdir()) == []
