"""A model is read with the tokenizer it learned (``config/tokenizer_identity.py``): ``moe-evaluate`` and
``moe-generate`` after the run's tokenizer was retrained in place, and ``train.py --init-from FILE`` of a model
trained with another tokenizer, are refused naming both fingerprints; the checkpoint and the exported file hold
the fingerprint."""

import pytest
from safetensors import safe_open

import train
from config.tokenizer_identity import tokenizer_fingerprint
from data.tokenizer import train_bpe, write_tokenizer
from inference.evaluate import main as evaluate_main
from inference.generate import main as generate_main
from interop.export import export_checkpoint
from tests.inference.conftest import TINY

TEXT = "def square(x):\n    return x * x\n\nclass Point:\n    x: int = 0\n" * 20


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A 1-step run read with a 270-token BPE, its export, and the tokenizer's first fingerprint."""
    root = tmp_path_factory.mktemp("tokenizer_identity")
    tokenizer, corpus = root / "tok.json", root / "corpus.txt"
    corpus.write_text(TEXT)
    write_tokenizer(train_bpe([TEXT], 270), tokenizer)
    run = root / "run"
    assert train.main(["--run-dir", str(run), "--set", *TINY, "train.steps=1", "model.vocab_size=270",
                       f"data.tokenizer={tokenizer}", f"data.source={corpus}", f"data.cache_dir={root / 'cache'}",
                       "data.val_fraction=0.2"]) == 0
    export = root / "model.safetensors"
    export_checkpoint(run / "checkpoints", export)
    return run, tokenizer, export, tokenizer_fingerprint(str(tokenizer))


def test_the_checkpoint_and_the_export_record_the_fingerprint(bpe_run):
    run, tokenizer, export, first = bpe_run
    with safe_open(str(export), framework="pt") as handle:
        assert handle.metadata()["tokenizer"] == first == tokenizer_fingerprint(str(tokenizer))
    assert first.startswith("sha256:")


def test_evaluate_and_generate_refuse_a_tokenizer_retrained_in_place(bpe_run, tmp_path, capsys):
    run, tokenizer, export, first = bpe_run
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT[:200])
    assert evaluate_main([str(run), "--text", str(text)]) == 0  # the tokenizer it learned: accepted
    original = tokenizer.read_bytes()
    try:
        write_tokenizer(train_bpe(["completely other words, other merges\n" * 30], 270), tokenizer)
        second = tokenizer_fingerprint(str(tokenizer))
        capsys.readouterr()
        for command, argv in ((evaluate_main, [str(run), "--text", str(text)]),
                              (generate_main, [str(run), "--prompt", "def", "--max-new-tokens", "2"]),
                              (evaluate_main, [str(export), "--text", str(text)])):
            assert command(argv) == 2
            err = capsys.readouterr().err
            assert f"trained with the tokenizer {first}" in err and f"{tokenizer} ({second})" in err, err
            assert "retrained in place" in err and "Traceback" not in err
    finally:
        tokenizer.write_bytes(original)
    # a copy of the model's own tokenizer given with --tokenizer is the same tokenizer; bytes is another
    copy = tmp_path / "copy.json"
    copy.write_bytes(original)
    assert generate_main([str(run), "--prompt", "def", "--max-new-tokens", "2", "--tokenizer", str(copy)]) == 0
    capsys.readouterr()
    assert generate_main([str(run), "--prompt", "def", "--max-new-tokens", "2", "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err
    assert f"trained with the tokenizer {first}, and would be read here with bytes" in err, err


def test_init_from_a_file_of_another_tokenizer_is_refused_before_any_work(bpe_run, tmp_path, capsys):
    run, tokenizer, export, first = bpe_run
    other = tmp_path / "other.json"
    write_tokenizer(train_bpe(["other text entirely, other merges\n" * 30], 270), other)
    for spec in (str(other), "bytes"):
        out = tmp_path / f"run-{spec[-4:]}"
        assert train.main(["--run-dir", str(out), "--init-from", str(export), "--set", *TINY, "train.steps=1",
                           "model.vocab_size=270", f"data.tokenizer={spec}"]) == 2
        err = capsys.readouterr().err
        assert f"--init-from {export} was trained with the tokenizer {first}" in err and spec in err, err
        assert "Traceback" not in err and not out.exists()
