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


# Layouts of 2 ranks a run could train under: tensor parallelism with vocabulary-sharded logits, and FSDP with the
# experts spread over its ranks (windows dealt over the data-parallel ranks, one rank given none in the last batch).
LAYOUTS = [["parallel.tp=2", "parallel.dp_shard=1", "parallel.vocab_parallel=true"],
           ["parallel.dp_shard=2", "parallel.ep=2"],
           # each window's positions cut over 2 ranks, the shorter last window padded to whole chunks
           ["parallel.cp=2", "parallel.dp_shard=1"]]


def _evaluate_under_layouts(rank: int, run_dir: str, text: str, expected: str) -> None:
    import contextlib
    import io
    import re

    numbers = lambda line: [float(x) for x in re.findall(r"[0-9][0-9,]*\.?[0-9]*", line.replace(",", ""))]  # noqa
    for layout in LAYOUTS:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main([run_dir, "--text", text, "--set", *layout]) == 0
        if rank == 0:  # loss, perplexity, bits per byte to their printed digits; the predicted tokens exactly
            assert numbers(out.getvalue()) == pytest.approx(numbers(expected), abs=2e-4), (layout, out.getvalue())
            assert out.getvalue().strip().split("(")[-1] == expected.split("(")[-1], layout
        else:
            assert out.getvalue() == ""  # one figure per job


def test_the_command_gives_one_processs_figure_under_every_layout(trained_run, tmp_path, capsys, monkeypatch):
    """torchrun ... -m inference.evaluate RUN --set parallel.*: each rank builds and reads only its shards, and the
    figure is the one process's for FSDP, tensor (vocabulary-parallel), expert and context parallelism."""
    from tests.spawn import spawn

    text = tmp_path / "held_out.txt"
    text.write_text(TEXT, encoding="utf-8")
    assert main([str(trained_run), "--text", str(text)]) == 0
    expected = capsys.readouterr().out.strip()
    spawn(_evaluate_under_layouts, 2, str(trained_run), str(text), expected)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets them: the refusals come before the job is joined
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    for argv, message in [(["--set", "model.d_model=64"], "parallel.* keys only"),
                          (["--set", "parallel.pp=2"], "pipeline parallelism")]:
        assert main([str(trained_run), "--text", str(text), *argv]) == 2  # refused before any process group
        assert message in capsys.readouterr().err
