"""Sparse upcycling against the dense model it starts from: ours, and ``transformers``' own LlamaForCausalLM and
Qwen3ForCausalLM (built locally from tiny random configs, saved with ``save_pretrained``; no download) as oracles.

With every expert a copy of the dense FFN and the k weights renormalised, an MoE layer computes the dense FFN
whatever the router picks: the upcycled model's logits must equal the dense model's, here in fp32 to 1e-5.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors import safe_open

import train
from config.run import config_from_dict, load_config
from data.cache import load_tokens
from data.sampler import TokenSampler, split_tokens
from interop.export import CONFIG_METADATA_KEY, consolidated_state, write_safetensors_streaming
from interop.upcycle import main
from moe.transformer import MoETransformer
from tests.interop.hf_models import edit_config, our_model, randomise_norms, save_random
from training.metrics import read_metrics

transformers = pytest.importorskip("transformers")
SEQ = 16
DENSE = ["model.d_model=32", "model.n_layers=3", "model.n_heads=4", f"model.seq_len={SEQ}", "model.ffn_hidden=48"]


def our_dense_file(path: Path, overrides: list[str]) -> MoETransformer:
    """A random dense model of ours, written as our safetensors (what interop.export writes)."""
    config = load_config("dense", [*DENSE, *overrides])
    torch.manual_seed(0)
    model = MoETransformer(config.model, config.moe, seed=3).eval()
    randomise_norms(model)
    state = model.state_dict()
    write_safetensors_streaming(path, {name: (value.shape, value.dtype) for name, value in state.items()},
                                lambda name: state[name].contiguous(),
                                {CONFIG_METADATA_KEY: yaml.safe_dump(config.to_dict())})
    return model


def tokens(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (3, SEQ), generator=torch.Generator().manual_seed(1))


SHAPES = {"top2-every-layer": ([], ["--experts", "4", "--top-k", "2"]),
          "top1-every-other-gqa-tied": (["model.n_kv_heads=2", "model.tie_embeddings=true"],
                                        ["--experts", "3", "--top-k", "1", "--moe-every", "2",
                                         "--first-moe-layer", "1"])}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_our_dense_model_upcycled_gives_its_logits(tmp_path, shape):
    model_overrides, flags = SHAPES[shape]
    dense = our_dense_file(tmp_path / "dense.safetensors", model_overrides)
    out = tmp_path / "moe.safetensors"
    assert main([str(tmp_path / "dense.safetensors"), *flags, "--out", str(out)]) == 0
    moe = our_model(out)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(moe(x), dense(x), rtol=0, atol=1e-5)
    layers = moe.moe_layers()
    assert sorted(layers) == ([0, 1, 2] if shape == "top2-every-layer" else [1])
    for layer in layers.values():  # the router spread the tokens: the equality is not one expert's
        assert int((layer.last_stats.tokens_per_expert > 0).sum()) >= 2
    assert yaml.safe_load((tmp_path / "moe.yaml").read_text()) == yaml.safe_load(
        safe_open(str(out), framework="pt").metadata()[CONFIG_METADATA_KEY])

    # the check can fail: noise on the copies makes the experts differ, and the logits with them
    assert main([str(tmp_path / "dense.safetensors"), *flags, "--noise", "0.5", "--out", str(out), "--overwrite"]) == 0
    with torch.no_grad():
        assert (our_model(out)(x) - dense(x)).abs().max() > 1e-3


def make_hf(folder: Path, architecture: str = "Llama", **overrides) -> torch.nn.Module:
    """A random tiny transformers Llama or Qwen3 (dense) saved to ``folder``, norms randomised too."""
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(0)
    config = getattr(transformers, f"{architecture}Config")(**settings)
    return save_random(getattr(transformers, f"{architecture}ForCausalLM")(config), folder)


HF_DENSE = {"llama-gqa-untied-top2": ("Llama", {}, ["--experts", "4", "--top-k", "2"]),
            "llama-mha-tied-top1-every-other": ("Llama", dict(num_key_value_heads=4, tie_word_embeddings=True),
                                                ["--experts", "2", "--top-k", "1", "--moe-every", "2"]),
            # Qwen3: q/k norms, and a head width (12) other than hidden / heads (8)
            "qwen3-gqa-head-dim-top2": ("Qwen3", dict(head_dim=12), ["--experts", "3", "--top-k", "2"])}


@pytest.mark.parametrize("shape", list(HF_DENSE), ids=list(HF_DENSE))
def test_a_transformers_dense_model_upcycled_gives_its_logits(tmp_path, shape):
    architecture, settings, flags = HF_DENSE[shape]
    hf = make_hf(tmp_path / "hf", architecture, **settings)
    out = tmp_path / "moe.safetensors"
    assert main([str(tmp_path / "hf"), *flags, "--out", str(out), "--set", f"model.seq_len={SEQ}"]) == 0
    moe = our_model(out)
    assert moe.config.ffn_hidden == 48 and moe.layers["0"].moe.experts.w_in.shape == (int(flags[1]), 32, 48)
    assert moe.config.qk_norm == (architecture == "Qwen3")
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(moe(x), hf(x).logits, rtol=0, atol=1e-5)


def test_an_upcycled_run_starts_at_the_dense_models_loss(tmp_path):
    """Dense run -> its checkpoint -> upcycle -> train.py --init-from: the first step's loss is the dense model's."""
    run = ["--set", *DENSE, "train.global_batch_size=4", "train.precision=fp32", "logging.wandb=disabled",
           "logging.log_interval=1", "train.eval_batches=1", "train.eval_interval=0", "checkpoint.interval=3"]
    assert train.main(["--config", "dense", "--run-dir", str(tmp_path / "dense"), *run, "train.steps=3"]) == 0
    out = tmp_path / "moe.safetensors"
    assert main([str(tmp_path / "dense" / "checkpoints"), "--experts", "4", "--top-k", "2", "--out", str(out)]) == 0
    assert train.main(["--config", str(tmp_path / "moe.yaml"), "--init-from", str(out), "--run-dir",
                       str(tmp_path / "moe"), "--set", "train.steps=2", "checkpoint.interval=null"]) == 0
    first = next(r for r in read_metrics(tmp_path / "moe" / "metrics.jsonl") if "train/lm_loss" in r)

    state, config_text, _ = consolidated_state(tmp_path / "dense" / "checkpoints")
    config = config_from_dict(yaml.safe_load(config_text))
    dense = MoETransformer(config.model, config.moe)
    dense.load_state_dict(state)
    train_tokens, _ = split_tokens(load_tokens(config.data.source, config.data.cache_dir), config.data.val_fraction)
    inputs, targets = TokenSampler(train_tokens, SEQ, config.train.seed).next_batch(4)
    with torch.no_grad():
        expected = F.cross_entropy(dense(inputs).flatten(0, 1), targets.flatten()).item()
    assert first["step"] == 1 and first["train/lm_loss"] == pytest.approx(expected, abs=1e-5)


def test_bad_sources_are_refused_before_anything_is_written(tmp_path, capsys):
    make_hf(tmp_path / "llama")
    out = tmp_path / "moe.safetensors"
    up = [str(tmp_path / "llama"), "--experts", "4", "--top-k", "2", "--out", str(out), "--set", "model.seq_len=16"]

    cases = [
        (dict(architectures=["GemmaForCausalLM"], model_type="gemma"),
         r"unsupported architecture GemmaForCausalLM: a dense source is one of LlamaForCausalLM, Qwen3ForCausalLM"),
        (dict(intermediate_size=40), r"tensor 'model.layers.0.mlp.up_proj.weight' has shape \(48, 32\), the dense "
                                     r"model's config needs \(40, 32\)"),
        (dict(rope_scaling={"type": "linear", "factor": 2.0}), r"rope_scaling=.* is not supported"),
    ]
    original = (tmp_path / "llama" / "config.json").read_text()
    for changes, message in cases:
        edit_config(tmp_path / "llama", **changes)
        assert main(up) == 2
        assert re.search(message, capsys.readouterr().err), message
        (tmp_path / "llama" / "config.json").write_text(original)
    assert main([str(tmp_path / "llama"), "--experts", "2", "--top-k", "3", *up[5:]]) == 2
    assert "moe.top_k=3 must be between 1 and moe.num_experts=2" in capsys.readouterr().err
    assert main([*up, "model.d_model=64"]) == 2
    assert "the model's shape is the dense model's" in capsys.readouterr().err
    for noise in ("inf", "nan", "-0.1"):  # infinite weights would be written and trained on
        assert main([*up[:7], "--noise", noise, *up[7:]]) == 2
        assert f"--noise {float(noise)}: must be a finite number >= 0" in capsys.readouterr().err
    assert not out.exists() and not out.with_suffix(".yaml").exists()

    assert main(up) == 0  # an MoE model is not a dense source
    assert main([str(out), "--experts", "4", "--top-k", "2", "--out", str(tmp_path / "again.safetensors")]) == 2
    assert "upcycling starts from a dense model (model.moe_every: 0)" in capsys.readouterr().err
