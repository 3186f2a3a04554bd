"""The router probe: choices against a hand-computed router, token categories, agreement and change measures."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import yaml

from analysis import router
from analysis.router_probe import (
    CATEGORIES,
    ProbeResult,
    byte_categories,
    category_lift,
    expert_categories,
    layer_agreement,
    probe,
    routing_change,
    top_tokens,
)
from config.run import load_config

TINY = ["model.d_model=32", "model.n_layers=3", "model.n_heads=2", "model.seq_len=16", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=16", "logging.wandb=disabled"]
TEXT = b"def f(x1, y):\n    if x1 >= 20:\n        return 'iffy' + str(y)\n    return None  # done\n" * 4


def _tokens(text: bytes = TEXT) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def test_byte_categories_label_each_byte_and_whole_keywords_only():
    text = b"if x1 == 2:\n\treturn 'iffy'\xc3\xa9"
    got = [CATEGORIES[c] for c in byte_categories(_tokens(text))]
    expected = (["keyword"] * 2 + ["whitespace", "letter", "digit", "whitespace"] + ["punctuation"] * 2
                + ["whitespace", "digit", "punctuation", "whitespace", "whitespace"] + ["keyword"] * 6
                + ["whitespace", "punctuation"] + ["letter"] * 4 + ["punctuation", "other", "other"])
    assert got == expected
    with pytest.raises(ValueError, match="byte-level"):
        byte_categories(np.array([300]))


def test_probe_records_the_choices_of_a_hand_computed_router():
    """Top-k of softmax(h @ gate^T) on the hidden states each MoE layer received, one window at a time, dropless.

    The model has a capacity limit; the probe routes dropless, so its batch size changes nothing.
    """
    config = load_config("moe-8x", TINY)
    model = router.build_model(config)
    assert config.moe.capacity_factor == 1.25
    tokens = _tokens()
    result = probe(model, tokens, seq_len=16, batch_size=3)
    windows = len(tokens) // 16
    assert result.layers == [0, 1, 2] and len(result.tokens) == windows * 16
    assert all(layer.config.capacity_factor == 1.25 for layer in model.moe_layers().values())  # restored
    one_by_one = probe(model, tokens, seq_len=16, batch_size=1)
    for i in result.layers:
        np.testing.assert_array_equal(one_by_one.expert_ids[i], result.expert_ids[i])
        np.testing.assert_allclose(one_by_one.weights[i], result.weights[i], rtol=1e-5)

    for layer in model.moe_layers().values():
        layer.config = dataclasses.replace(layer.config, capacity_factor=None)

    inputs = {}
    hooks = [layer.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
             for i, layer in model.moe_layers().items()]
    with torch.no_grad():
        for w in range(windows):
            model(torch.from_numpy(tokens[w * 16:(w + 1) * 16]).view(1, 16))
            for i, layer in model.moe_layers().items():
                probs = torch.softmax(inputs[i].reshape(16, -1) @ layer.router.gate.t(), -1)
                top = torch.topk(probs, 2, -1)
                np.testing.assert_array_equal(result.expert_ids[i][w * 16:(w + 1) * 16], top.indices.numpy())
                weights = top.values / top.values.sum(-1, keepdim=True)
                np.testing.assert_allclose(result.weights[i][w * 16:(w + 1) * 16], weights.numpy(), rtol=1e-5)
    for hook in hooks:
        hook.remove()


def test_expert_categories_and_lift_against_a_loop():
    result = ProbeResult(tokens=_tokens(b"a1 b"), expert_ids={0: np.array([[0, 1], [1, 2], [2, 0], [0, 2]])},
                         weights={0: np.full((4, 2), 0.5)}, num_experts=3)
    counts = expert_categories(result, 0)
    expected = np.zeros((3, len(CATEGORIES)), dtype=np.int64)
    for token_categories, ids in zip(byte_categories(result.tokens), result.expert_ids[0], strict=True):
        for expert in ids:
            expected[expert, token_categories] += 1
    np.testing.assert_array_equal(counts, expected)
    lift = category_lift(counts)
    letter, digit = CATEGORIES.index("letter"), CATEGORIES.index("digit")
    # expert 0 got a, b (letters) and " " of 4 total; letters are 2 tokens x 2 choices = 4 of 8 assignments
    assert lift[0, letter] == pytest.approx((2 / 3) / (4 / 8))
    assert lift[0, digit] == 0 and math.isnan(lift[0, CATEGORIES.index("keyword")])
    assert top_tokens(result, 0, 2) == [(ord(" "), 1), (ord("1"), 1), (ord("b"), 1)]


def test_layer_agreement_nmi_is_one_for_a_relabelling_and_near_zero_for_independent_choices():
    rng = np.random.default_rng(0)
    first = rng.integers(0, 4, size=(20000, 1))
    relabelled = np.array([2, 0, 3, 1])[first]
    independent = rng.integers(0, 4, size=(20000, 1))
    result = ProbeResult(tokens=np.zeros(20000, dtype=np.int64), num_experts=4,
                         expert_ids={0: first, 1: relabelled, 3: independent},
                         weights={i: np.ones((20000, 1)) for i in (0, 1, 3)})
    pairs = layer_agreement(result)
    assert [p.layers for p in pairs] == [(0, 1), (1, 3)]
    assert pairs[0].nmi == pytest.approx(1.0)
    assert pairs[1].nmi < 0.002
    assert pairs[0].joint.sum() == 20000

    # a small case by hand: A = [0, 0, 1, 1], B = [0, 1, 1, 1]
    small = ProbeResult(tokens=np.zeros(4, dtype=np.int64), num_experts=2,
                        expert_ids={0: np.array([[0], [0], [1], [1]]), 1: np.array([[0], [1], [1], [1]])},
                        weights={0: np.ones((4, 1)), 1: np.ones((4, 1))})
    h_a, h_b = math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    h_ab = -(0.25 * math.log(0.25) * 2 + 0.5 * math.log(0.5))  # joint: (0,0) (0,1) once each, (1,1) twice
    assert layer_agreement(small)[0].nmi == pytest.approx((h_a + h_b - h_ab) / math.sqrt(h_a * h_b))


def test_routing_change_counts_kept_top1_and_set_overlap():
    tokens = np.zeros(3, dtype=np.int64)
    before = ProbeResult(tokens, {0: np.array([[0, 1], [2, 3], [1, 0]])}, {0: np.ones((3, 2))}, 4)
    after = ProbeResult(tokens, {0: np.array([[0, 2], [3, 2], [1, 0]])}, {0: np.ones((3, 2))}, 4)
    change = routing_change(before, after)[0]
    assert change["top1_same"] == pytest.approx(2 / 3)
    assert change["topk_overlap"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)
    with pytest.raises(ValueError, match="same text"):
        routing_change(before, ProbeResult(tokens + 1, after.expert_ids, after.weights, 4))


@pytest.fixture
def run_with_weights(tmp_path):
    """A run directory (config.yaml only, as training writes it) and a state dict saved beside it."""
    config = load_config("moe-8x", TINY)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    model = router.build_model(config)
    with torch.no_grad():
        for layer in model.moe_layers().values():
            layer.router.gate.mul_(-3.0)  # a different router: the routing must change
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "text.py").write_bytes(TEXT)
    return tmp_path, model


def test_probe_run_loads_the_state_dict_and_init_is_the_training_seed(run_with_weights):
    run_dir, model = run_with_weights
    tokens = _tokens()
    loaded = router.probe_run(run_dir, router.load_state_dict_file(run_dir / "weights.pt"), tokens)
    direct = probe(model, tokens, 16)
    for layer in direct.layers:
        np.testing.assert_array_equal(loaded.expert_ids[layer], direct.expert_ids[layer])
    config = router.load_run_config(run_dir)
    torch.manual_seed(config.train.seed)
    from moe.transformer import MoETransformer
    fresh = MoETransformer(config.model, config.moe)
    for name, value in router.build_model(config).state_dict().items():
        torch.testing.assert_close(value, fresh.state_dict()[name], msg=name)
    initial = router.probe_run(run_dir, None, tokens)
    change = routing_change(initial, loaded)
    assert all(c["top1_same"] < 0.9 for c in change.values())
    # the specialisation figure of initial weights says so on its face; a loaded model's does not
    from analysis.router_plots import specialisation_figure
    assert initial.initial_weights and not loaded.initial_weights
    assert "RANDOM INITIAL WEIGHTS" in specialisation_figure(initial).get_suptitle()
    assert specialisation_figure(loaded).get_suptitle() == ""
    initial.save(run_dir / "initial.npz")
    assert ProbeResult.load(run_dir / "initial.npz").initial_weights


def test_probe_cli_prints_specialisation_agreement_and_change(run_with_weights, capsys, tmp_path):
    run_dir, _ = run_with_weights
    out = tmp_path / "probe.npz"
    status = router.main(["probe", "--run", str(run_dir), "--weights", str(run_dir / "weights.pt"),
                          "--compare", "init", "--text", str(run_dir / "text.py"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0
    saved = ProbeResult.load(out)
    assert saved.layers == [0, 1, 2] and saved.expert_ids[0].shape == (len(TEXT) // 16 * 16, 2)
    assert "layer 0:" in printed and "expert   3:" in printed and "favours" in printed
    assert "layers 1 -> 2: top-1 choices share NMI" in printed
    assert "vs init:" in printed and "keep their top-1 expert" in printed


def test_probe_cli_names_a_missing_weights_file(run_with_weights, capsys):
    run_dir, _ = run_with_weights
    assert router.main(["probe", "--run", str(run_dir), "--weights", "nope.pt"]) == 2
    assert "--weights/--compare nope.pt: no such file" in capsys.readouterr().err


def test_specialisation_lines_use_categories_for_bytes_and_top_tokens_otherwise():
    result = ProbeResult(tokens=np.array([97, 98, 49, 300]), expert_ids={0: np.array([[0], [0], [1], [1]])},
                         weights={0: np.ones((4, 1))}, num_experts=2)
    lines = router.specialisation_lines(result, 0, byte_level=False)
    assert lines[0] == "  expert   0:  50.0% of assignments; favours tokens 97 (1), 98 (1)"
    assert lines[1] == "  expert   1:  50.0% of assignments; favours tokens 49 (1), 300 (1)"
    result.tokens = np.array([97, 98, 49, 32])  # a, b, 1, space
    lines = router.specialisation_lines(result, 0, byte_level=True)
    assert lines[0] == "  expert   0:  50.0% of assignments; favours letter x2.00"
    assert lines[1] == "  expert   1:  50.0% of assignments; favours digit x2.00, whitespace x2.00"
