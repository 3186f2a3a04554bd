"""Tests for data/formats.py through the token cache: each format read against a reference built here.

The references read the same records with ``json``, ``gzip``, ``zstandard`` and ``pyarrow`` directly and join
each record's text with the byte separator, so a format that is misread (JSON syntax trained on, a record lost,
a file skipped) shows as a different stream. Byte tokens keep the comparison exact.
"""

import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from numpy.testing import assert_array_equal

from config.errors import ConfigError
from config.run import load_config
from data.cache import check_source, load_tokens
from data.corpus import document_texts, list_corpus

SEP = b"\n\n"
RECORDS = [{"text": "first record", "id": 1}, {"text": "second\nwith a newline and caf\u00e9", "id": 2},
           {"text": 'quotes " and braces {}', "id": 3}]


def stream_of(texts: list[str]) -> np.ndarray:
    return np.frombuffer(b"".join(t.encode() + SEP for t in texts), dtype=np.uint8).astype(np.uint16)


def write_jsonl(path: Path, records: list[dict]) -> bytes:
    data = b"".join(json.dumps(r).encode() + b"\n" for r in records)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


def write_arrow_stream(path: Path, texts: list[str | None], column: str = "text") -> None:
    table = pa.table({column: pa.array(texts, pa.string()), "n": pa.array(range(len(texts)), pa.int64())})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=2):
            writer.write_batch(batch)


def test_jsonl_json_parquet_and_compressed_read_the_text_field_against_direct_readers(tmp_path):
    folder = tmp_path / "corpus"
    raw = write_jsonl(folder / "a.jsonl", RECORDS)
    (folder / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (folder / "d.json").write_text(json.dumps(RECORDS[::-1]))
    table = pa.table({"text": [r["text"] for r in RECORDS], "id": [r["id"] for r in RECORDS]})
    pq.write_table(table, folder / "e.parquet", row_group_size=2)
    (folder / "f.parquet.zst").write_bytes(zstandard.ZstdCompressor().compress((folder / "e.parquet").read_bytes()))
    (folder / "g.txt.gz").write_bytes(gzip.compress(b"plain text, compressed"))

    expected: list[str] = []
    expected += [json.loads(line)["text"] for line in raw.decode().splitlines()]
    expected += [json.loads(line)["text"] for line in gzip.decompress((folder / "b.jsonl.gz").read_bytes())
                 .decode().splitlines()]
    expected += [json.loads(line)["text"] for line in zstandard.ZstdDecompressor().stream_reader(
        (folder / "c.jsonl.zst").read_bytes()).read().decode().splitlines()]
    expected += [r["text"] for r in json.loads((folder / "d.json").read_text())]
    expected += pq.read_table(folder / "e.parquet", columns=["text"]).column("text").to_pylist() * 2
    expected += ["plain text, compressed"]
    tokens = load_tokens(str(folder), tmp_path / "cache")
    assert_array_equal(tokens, stream_of(expected))
    assert b'"text":' not in bytes(np.asarray(tokens, dtype=np.uint8))  # no JSON syntax trained on
    # the tokenizer trainer reads the same documents
    assert [text for text in document_texts(list_corpus(str(folder))) if text] == expected


def test_text_key_picks_the_field_and_changes_the_cache(tmp_path):
    path = tmp_path / "q.jsonl"
    write_jsonl(path, [{"question": "why?", "text": "because"}])
    assert_array_equal(load_tokens(str(path), tmp_path / "cache", text_key="question"), stream_of(["why?"]))
    assert_array_equal(load_tokens(str(path), tmp_path / "cache"), stream_of(["because"]))
    assert len(list((tmp_path / "cache").glob("*.bin"))) == 2


def test_datasets_save_to_disk_folder_reads_its_arrow_files_in_order(tmp_path):
    # the layout datasets' save_to_disk writes: Arrow IPC stream shards, state.json and dataset_info.json
    folder = tmp_path / "ds"
    folder.mkdir()
    shards = [["one", "two", "three"], ["four", "five"]]
    for i, texts in enumerate(shards):
        write_arrow_stream(folder / f"data-{i:05d}-of-00002.arrow", texts)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": f"data-{i:05d}-of-00002.arrow"}
                                                                   for i in range(2)]}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    expected = []
    for i in range(2):
        with pa.OSFile(str(folder / f"data-{i:05d}-of-00002.arrow")) as source:
            expected += pa.ipc.open_stream(source).read_all().column("text").to_pylist()
    assert_array_equal(load_tokens(str(folder), tmp_path / "cache"), stream_of(expected))

    (tmp_path / "dd").mkdir()
    folder.rename(tmp_path / "dd" / "train")
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(ValueError, match=r"a datasets DatasetDict with splits train; name one split's folder"):
        load_tokens(str(tmp_path / "dd"), tmp_path / "cache")


def test_an_arrow_ipc_file_and_compressed_csv_read_too(tmp_path):
    table = pa.table({"text": ["alpha", "beta", "gamma"]})
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)  # the random-access format (Feather v2), not the stream
    assert_array_equal(load_tokens(str(tmp_path / "t.arrow"), tmp_path / "cache"),
                       stream_of(pa.ipc.open_file(str(tmp_path / "t.arrow")).read_all().column("text").to_pylist()))
    (tmp_path / "rows.csv.gz").write_bytes(gzip.compress(b"a,b\n1,2\n"))  # text, compressed
    assert_array_equal(load_tokens(str(tmp_path / "rows.csv.gz"), tmp_path / "cache"), stream_of(["a,b\n1,2\n"]))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_is_read_in_its_stated_dtype(tmp_path, dtype):
    values = (np.arange(999) * 7919 % 70_000).astype(dtype)
    path = tmp_path / "t.bin"
    values.tofile(path)
    assert_array_equal(load_tokens(str(path), tmp_path / "cache", token_dtype=dtype), values)
    if dtype == "uint32":
        path.write_bytes(path.read_bytes()[:-2])
        with pytest.raises(ValueError, match=r"3994 bytes; a token file must be non-empty uint32 \(a multiple of 4"):
            load_tokens(str(path), tmp_path / "cache", token_dtype=dtype)


@pytest.mark.parametrize(("name", "content", "message"), [
    ("bad.jsonl", b'{"text": "ok"}\n\n{"text": oops}\n', r"bad\.jsonl, line 3: not a JSON record"),
    ("bad.jsonl", b'{"text": "ok"}\n{"body": "x", "id": 2}\n', r"line 2: no 'text' field \(its fields: 'body', 'id'\)"
                                                               r"; set data\.text_key"),
    ("bad.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', r"bad\.jsonl, line 2: not UTF-8"),
    ("bad.jsonl", b'{"text": 5}\n', r"line 1: field 'text' is a int, not text"),
    ("bad.jsonl", b'["text"]\n', r"line 1: a list, not a record"),
    ("bad.json", b'{"text": "one object"}', r"bad\.json: a JSON dict, not an array of records"),
    ("bad.json", b'[{"text": "a"}, {"txt": "b"}]', r"bad\.json, record 1: no 'text' field"),
    ("bad.jsonl.gz", b"\x1f\x8b\x08\x00garbage", r"bad\.jsonl\.gz: not valid gzip data"),
    ("bad.jsonl.zst", b"not zstd at all", r"bad\.jsonl\.zst: not valid zstd data"),
    ("bad.parquet", b"PAR1 not really", r"bad\.parquet: not a readable parquet file"),
])
def test_malformed_records_name_file_and_line_or_row(tmp_path, name, content, message):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_tokens(str(tmp_path / "c"), tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*.bin"))  # no cache from a corpus that failed


def test_parquet_without_the_column_or_with_a_null_row_names_it(tmp_path):
    pq.write_table(pa.table({"body": ["a"]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a\.parquet: no column 'text' \(its columns: body\); set data\.text_key"):
        load_tokens(str(tmp_path / "a.parquet"), tmp_path / "cache")
    pq.write_table(pa.table({"text": ["a", "b", None]}), tmp_path / "b.parquet", row_group_size=1)
    with pytest.raises(ValueError, match=r"b\.parquet, row 2: column 'text' is null"):
        load_tokens(str(tmp_path / "b.parquet"), tmp_path / "cache")


def test_unrecognised_files_are_refused_together_unless_skipped_and_the_skip_is_listed(tmp_path):
    folder = tmp_path / "c"
    write_jsonl(folder / "ok.jsonl", RECORDS[:1])
    for name in ("a.zip", "b.tar", "c.xz", "tokens.bin"):
        (folder / name).write_bytes(b"PK\x03\x04")
    (folder / "img" / "x.png").parent.mkdir()
    (folder / "img" / "x.png").write_bytes(b"\x89PNG\x00\x00")
    with pytest.raises(ValueError) as error:
        check_source(str(folder), "bytes", 256)
    message = str(error.value)
    assert "5 file(s) in no format taken here: a.zip; b.tar; c.xz; img/x.png; tokens.bin (a pre-tokenised" in message
    assert ".jsonl" in message and ".parquet" in message and "data.skip" in message
    note, end = check_source(str(folder), "bytes", 256, skip=["*.zip", "*.tar", "*.xz", "img/*", "tokens.bin"])
    assert note == f"data.skip: left out 5 file(s) of {folder}: a.zip, b.tar, c.xz, img/x.png, tokens.bin"
    assert end == "\n\n"
    tokens = load_tokens(str(folder), tmp_path / "cache", skip=["*.zip", "*.tar", "*.xz", "*.png", "*.bin"])
    assert_array_equal(tokens, stream_of([RECORDS[0]["text"]]))


def test_config_states_a_bin_dtype_and_refuses_it_elsewhere():
    assert load_config("moe-8x", ["data.source=t.bin", "data.token_dtype=uint32"]).data.token_dtype == "uint32"
    with pytest.raises(ConfigError, match=r"a pre-tokenised \.bin source needs its dtype stated"):
        load_config("moe-8x", ["data.source=t.bin"])
    with pytest.raises(ConfigError, match=r"data\.token_dtype: 'int8' is not one of 'uint16', 'uint32'"):
        load_config("moe-8x", ["data.source=t.bin", "data.token_dtype=int8"])
    with pytest.raises(ConfigError, match=r"only a \.bin takes one"):
        load_config("moe-8x", ["data.token_dtype=uint16"])
    assert load_config("moe-8x", ["data.text_key=body", "data.skip=['*.png']"]).data.skip == ["*.png"]


def test_the_tokenizer_trainer_reads_records_not_their_json(tmp_path):
    from tokenizers import Tokenizer

    from data.tokenizer import main as tokenizer_cli

    path = tmp_path / "r.jsonl.gz"
    # the key is far more frequent than any text: read as raw JSON, "qq" would be the first merge
    path.write_bytes(gzip.compress(b"".join(json.dumps({"qqqqqqqqqqqqqqqq": "zyzzyva"}).encode() + b"\n"
                                            for _ in range(200))))
    out = tmp_path / "bpe.json"
    assert tokenizer_cli(["train", "--source", str(path), "--text-key", "qqqqqqqqqqqqqqqq", "--vocab-size", "300",
                          "--out", str(out)]) == 0
    merged = [token for token in Tokenizer.from_file(str(out)).get_vocab() if len(token) > 1]
    assert "zyzzyva" in merged and not any("q" in token for token in merged)
