"""Fault cases of the command lines: each bad input is one clear message on stderr, a known exit status, and no
traceback, before any work (issue 15). Seconds each; the ``train.py`` cases run in this process through
``train.main`` with a tiny model, the CLIs and torchrun as subprocesses where the process's own exit is the point.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import train
from tests.training.test_data_loss import TINY

ROOT = Path(__file__).resolve().parents[1]


def refused(capsys, argv, message, status=2):
    """``train.main(argv)`` exits ``status`` with one message holding ``message`` and no traceback."""
    assert train.main(argv) == status
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err


def run_cli(*args, status=2, message=""):
    """``python -m ...args`` exits ``status`` with ``message`` on stderr and no traceback; its stderr."""
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


# --- data: refused when the data is opened, before the model exists ---------------------------------------------


def corpus(tmp_path, size):
    folder = tmp_path / "corpus"
    folder.mkdir(exist_ok=True)
    (folder / "a.txt").write_bytes((bytes(range(32, 127)) * (size // 95 + 1))[:size])
    return folder


def test_a_validation_split_shorter_than_a_window_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import training.loop
    monkeypatch.setattr(training.loop, "build_model", lambda *a, **k: pytest.fail("built the model"))
    # 20,000 tokens: 100 of them validation, fewer than seq_len + 1 = 129; the training split would do
    refused(capsys, ["--run-dir", str(tmp_path / "r"), "--set", *TINY, "model.seq_len=128",
                     f"data.source={corpus(tmp_path, 19998)}", "data.val_fraction=0.005"],
            "the validation split has 100 tokens, fewer than model.seq_len + 1 = 129")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_a_seq_len_far_beyond_the_data_is_refused_before_training(tmp_path, capsys, monkeypatch):
    import training.loop
    monkeypatch.setattr(training.loop, "build_model", lambda *a, **k: pytest.fail("built the model"))
    refused(capsys, ["--run-dir", str(tmp_path / "r"), "--set", *TINY, "model.seq_len=100000",
                     f"data.source={corpus(tmp_path, 5000)}"],
            "the training split has 4,977 tokens, fewer than model.seq_len + 1 = 100,001")


def test_token_ids_beyond_the_vocabulary_are_refused_naming_file_id_and_vocab_and_scanned_once(tmp_path, capsys,
                                                                                               monkeypatch):
    import training.loop
    monkeypatch.setattr(training.loop, "build_model", lambda *a, **k: pytest.fail("built the model"))
    ids = np.arange(20000, dtype=np.uint16) % 300
    ids[7777] = 4321
    source = tmp_path / "tokens.bin"
    ids.tofile(source)
    argv = ["--run-dir", str(tmp_path / "r"), "--set", *TINY, f"data.source={source}",
            f"data.cache_dir={tmp_path / 'cache'}"]
    message = f"{source} holds token id 4321, outside model.vocab_size=256"
    refused(capsys, argv, message)
    assert len(list((tmp_path / "cache").glob("maxid-*.json"))) == 1
    monkeypatch.setattr(np.memmap, "max", lambda *a, **k: pytest.fail("scanned the file again"))
    refused(capsys, argv, message)  # the cached largest id
    assert not (tmp_path / "r" / "metrics.jsonl").exists()
