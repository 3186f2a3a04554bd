"""Data inputs refused before work, each naming what to fix: a source whose records are all empty (it trained on
document ends alone); a mixture's or a named validation set's source too small for one window (the message named
no source, and a validation set was advised data.val_fraction); a tokenizer path that is a folder (the advice
trained a tokenizer "to" the folder); and a run whose ``plots`` path is a file (it failed after its work was done).
A validation set that is a training source, or a ``.bin`` under a BPE, is refused by the config
(``tests/data/test_mixture.py``)."""

import json

import pytest

import train
from data.cache import load_tokens
from data.tokenizer import load_tokenizer, train_bpe, write_tokenizer
from data.tokenizer import main as tokenizer_cli
from tests.training.test_data_loss import TINY


def one_error(capsys, message):
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("error:") == 1, err


def test_a_source_of_empty_records_is_refused_in_one_process_and_in_workers(tmp_path):
    corpus = tmp_path / "empty"
    corpus.mkdir()
    for name in ("a.jsonl", "b.jsonl"):  # records whose text is empty: their document ends alone were trained on
        (corpus / name).write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
    for workers in (1, 2):
        with pytest.raises(ValueError, match=r"no text in its 2 file\(s\) \(empty files, no records, or records "
                                             r"whose text is empty\)"):
            load_tokens(str(corpus), tmp_path / "cache", workers=workers)
        assert not list((tmp_path / "cache").rglob("*.bin")) and not list((tmp_path / "cache").glob(".*partial"))
    (corpus / "c.jsonl").write_text(json.dumps({"text": "ab"}) + "\n")  # one record of text: the stream as ever
    tokens = load_tokens(str(corpus), tmp_path / "cache")
    assert bytes(tokens.astype("uint8")) == b"\n\n" * 4 + b"ab\n\n"


def test_a_too_small_source_of_a_mixture_or_validation_set_is_named(tmp_path, capsys):
    (tmp_path / "big.txt").write_bytes(bytes(range(32, 127)) * 100)
    (tmp_path / "tiny.txt").write_text("a few bytes")
    sources = f"[{{path: {tmp_path / 'big.txt'}}}, {{path: {tmp_path / 'tiny.txt'}, name: tiny}}]"
    common = [*TINY, f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.2", "train.steps=1"]
    assert train.main(["--run-dir", str(tmp_path / "r1"), "--set", *common, f"data.sources={sources}"]) == 2
    one_error(capsys, f"data.sources[tiny] ({tmp_path / 'tiny.txt'}): the training split has 11 tokens, fewer than "
                      "model.seq_len + 1 = 33; use a larger source,")
    assert train.main(["--run-dir", str(tmp_path / "r2"), "--set", *common, f"data.source={tmp_path / 'big.txt'}",
                       f"data.validation=[{{path: {tmp_path / 'tiny.txt'}, name: tiny}}]"]) == 2
    one_error(capsys, f"data.validation[tiny] ({tmp_path / 'tiny.txt'}) has 13 tokens, fewer than model.seq_len + 1 "
                      "= 33; give a longer validation text, or a smaller model.seq_len")


def test_a_tokenizer_path_that_is_a_folder_gets_advice_that_keeps_the_folder(tmp_path, capsys):
    folder = tmp_path / "tok"
    folder.mkdir()
    with pytest.raises(ValueError, match=rf"data\.tokenizer='{folder}' is a folder, not a tokenizer\.json; give a "
                                         rf"tokenizer\.json file \(train one into it with .* --out {folder}/tokenizer"):
        load_tokenizer(str(folder), 300)
    write_tokenizer(train_bpe(["some text to fit " * 20], 270), folder / "tokenizer.json")
    with pytest.raises(ValueError, match=rf"give the one in it: data\.tokenizer='{folder}/tokenizer\.json'"):
        load_tokenizer(str(folder), 300)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert tokenizer_cli(["train", "--vocab-size", "260", "--source", str(folder / "tokenizer.json"),
                          "--out", str(empty)]) == 2
    one_error(capsys, f"--out {empty} is a folder; give the path of the tokenizer.json to write")
    assert not list(empty.iterdir())


def test_a_run_whose_plots_path_is_a_file_is_refused_before_it_starts(tmp_path, capsys, monkeypatch):
    import training.loop
    monkeypatch.setattr(training.loop, "build_model", lambda *a, **k: pytest.fail("built the model"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "plots").write_text("not a folder")
    assert train.main(["--run-dir", str(run), "--set", *TINY, "logging.plots=true", "train.steps=1"]) == 2
    one_error(capsys, f"{run / 'plots'} is not a folder, and the run writes its figures there at the end")
    assert (run / "plots").read_text() == "not a folder" and not (run / "metrics.jsonl").exists()
