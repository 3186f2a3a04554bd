"""A ``.zst`` corpus cut short (a copy or a download stopped) is refused by name, for training and for tokenizer
fitting: ``zstandard``'s stream reader ended at the cut without a word, so the part that decompressed was trained on
(or, cut inside the first frame, the corpus was called one of "no records"). Whole files of several frames still
read as they are."""

import json

import numpy as np
import pytest
import zstandard

from data.cache import load_tokens
from data.tokenizer import main as tokenizer_cli

RECORDS = [{"text": f"record {i}: " + "some words " * 20} for i in range(300)]
RAW = b"".join(json.dumps(record).encode() + b"\n" for record in RECORDS)


def frames(data: bytes, parts: int = 3) -> bytes:
    """``data`` as ``parts`` zstd frames, one after another (what ``zstd`` of concatenated files gives)."""
    step = -(-len(data) // parts)
    return b"".join(zstandard.ZstdCompressor().compress(data[i:i + step]) for i in range(0, len(data), step))


def test_a_whole_file_of_several_frames_reads_every_record(tmp_path):
    (tmp_path / "c.jsonl.zst").write_bytes(frames(RAW))
    tokens = load_tokens(str(tmp_path / "c.jsonl.zst"), tmp_path / "cache")
    expected = b"".join(record["text"].encode() + b"\n\n" for record in RECORDS)
    np.testing.assert_array_equal(tokens, np.frombuffer(expected, dtype=np.uint8))


@pytest.mark.parametrize("cut", [0.5, 0.95], ids=["inside-a-middle-frame", "inside-the-last-frame"])
def test_a_truncated_file_is_refused_for_training_and_for_the_tokenizer(tmp_path, capsys, cut):
    whole = frames(RAW)
    path = tmp_path / "c.jsonl.zst"
    path.write_bytes(whole[:int(len(whole) * cut)])
    with pytest.raises(ValueError, match=r"c\.jsonl\.zst: not valid zstd data \(the data ends inside a frame"):
        load_tokens(str(path), tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("*.bin"))
    out = tmp_path / "bpe.json"
    assert tokenizer_cli(["train", "--source", str(path), "--vocab-size", "300", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "not valid zstd data (the data ends inside a frame" in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_file_cut_inside_its_one_frame_is_not_called_empty(tmp_path):
    whole = zstandard.ZstdCompressor().compress(RAW)
    (tmp_path / "c.jsonl.zst").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ValueError, match="ends inside a frame") as error:
        load_tokens(str(tmp_path / "c.jsonl.zst"), tmp_path / "cache")
    assert "no records" not in str(error.value)
