"""Evaluation against hand computations: a model whose logits are all zero predicts every token with probability
1/V, so its loss is ln V exactly; a trained model's loss equals a per-token loop written out with log_softmax; the
figure does not depend on the batch size; bits per byte is the total in bits over the text's bytes."""

import math

import numpy as np
import pytest
import torch

from config.errors import ConfigError
from inference import load_model
from inference.evaluate import evaluate_tokens, main, windows

TEXT = "def square(x):\n    return x * x\n\n" * 3 + "print(square(4))  # é\n"  # 122 bytes, one 2-byte char


def test_windows_predict_every_token_but_the_first_exactly_once():
    spans = windows(10, 4)
    assert spans == [(0, 5), (4, 9), (8, 10)]
    predicted = [t for start, end in spans for t in range(start + 1, end)]
    assert predicted == list(range(1, 10))


def test_zero_logits_give_ln_v_and_bits_per_byte_by_hand(trained_run):
    model = load_model(trained_run).model
    with torch.no_grad():
        model.output.weight.zero_()  # untied (model.tie_embeddings is false): every logit is 0
    tokens = np.frombuffer(TEXT.encode(), dtype=np.uint8).astype(np.int64)
    result = evaluate_tokens(model, tokens, batch_size=3, text_bytes=len(TEXT.encode()))
    assert len(tokens) == len(TEXT.encode()) == 122 and result.predicted_tokens == 121
    assert result.loss == pytest.approx(math.log(256), rel=1e-6)
    assert result.perplexity == pytest.approx(256, rel=1e-5)
    # 121 predictions of 8 bits each (ln 256 / ln 2), over 122 bytes
    assert result.bits_per_byte == pytest.approx(121 * 8 / 122, rel=1e-6)


def test_a_trained_models_loss_equals_a_per_token_loop_and_ignores_the_batch_size(trained_run):
    model = load_model(trained_run).model
    seq_len = model.rope_cos.shape[0]
    tokens = np.frombuffer(TEXT.encode(), dtype=np.uint8).astype(np.int64)
    # the reference: token t predicted from the tokens of its window before it (windows start every seq_len)
    nats = []
    with torch.no_grad():
        for t in range(1, len(tokens)):
            start = (t - 1) // seq_len * seq_len
            logits = model(torch.from_numpy(tokens[start:t]).unsqueeze(0))[0, -1]
            nats.append(-float(torch.log_softmax(logits.double(), dim=-1)[tokens[t]]))
    expected = sum(nats) / len(nats)
    for batch_size in (1, 2, 8):
        assert evaluate_tokens(model, tokens, batch_size).loss == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ConfigError, match="at least 2 are needed"):
        evaluate_tokens(model, tokens[:1])


def test_the_command_reports_the_figures_and_refuses_bad_input_with_status_2(trained_run, tmp_path, capsys):
    text = tmp_path / "held_out.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert main([str(trained_run), "--text", str(text)]) == 0
    out = capsys.readouterr().out
    expected = evaluate_tokens(load_model(trained_run).model, np.frombuffer(TEXT.encode(), np.uint8).astype(np.int64),
                               text_bytes=122)
    assert out.strip() == expected.describe() and "bits per byte" in out
    assert main([str(trained_run), "--source", str(text), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert "perplexity" in capsys.readouterr().out
    binary = tmp_path / "latin1.txt"
    binary.write_bytes(b"caf\xe9 " * 10)
    for argv, message in [([str(trained_run), "--text", str(tmp_path / "nope.txt")], "nope.txt"),
                          ([str(trained_run), "--text", str(binary)], "not UTF-8 text"),
                          ([str(trained_run), "--text", str(text), "--batch-size", "0"], "--batch-size"),
                          ([str(tmp_path / "norun"), "--text", str(text)], "no such file or folder")]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (argv, err)
