"""DeepSeek-V4's multi-token-prediction layer (``mtp.0.*``, which ``transformers`` neither builds nor saves) in and
out, and its loss against a reference built from ``transformers``' DeepSeek-V4 pieces by DeepSeek's published
equations (``MTPBlock`` of ``inference/model.py`` in deepseek-ai/DeepSeek-V4-Flash; vLLM's ``deepseek_v4_mtp.py``
runs it the same way):

    e = enorm(Emb(t_{i+1})),  h = hnorm(h^0_i) per stream,  x = e_proj(e) (on every stream) + h_proj(h),
    x = the MTP decoder layer (hyper-connected, sliding attention, learned routing),
    logits = head(norm(hc_head(x))),

h^0 being the main model's last layer's output streams (before its ``hc_head``). The layer's tensors are drawn as a
fourth layer of a tiny random transformers model (``make_v4``'s three then a sliding MoE layer), which is then the
oracle of the MTP's decoder layer; the rest of the module is drawn here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.errors import ConfigError
from config.run import load_config
from interop.hf import export_folder, import_folder
from tests.interop.hf_models import hf_tensors, our_model
from tests.interop.test_hf_deepseek_v4 import LAYER_TYPES, SEQ, make_v4, published_name, tokens

transformers = pytest.importorskip("transformers")
v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
MLP_TYPES = ("hash_moe", "moe", "moe")
MTP = "mtp.0."


def make_v4_with_mtp(folder: Path, **sizes) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """``make_v4``'s model saved to ``folder`` with an MTP layer beside it under ``mtp.0.`` (the names
    ``transformers`` gives a layer, as this model saves them): its decoder layer is layer 3 of a four-layer
    transformers model drawn with the same seed (returned: its layer 3 is the oracle's), ``e_proj``/``h_proj``,
    ``enorm``/``hnorm``/``norm`` and ``hc_head_fn``/``_base``/``_scale`` drawn here. Returns the deeper model and the
    MTP tensors (``sizes``: ``make_v4``'s)."""
    deep = make_v4(folder, layer_types=[*LAYER_TYPES, "sliding_attention"], mlp_layer_types=(*MLP_TYPES, "moe"),
                   **sizes)
    tensors, d, n = load_file(folder / "model.safetensors"), deep.config.hidden_size, deep.config.hc_mult
    last = "model.layers.3."
    mtp = {MTP + name.removeprefix(last): tensors.pop(name) for name in list(tensors) if name.startswith(last)}
    generator = torch.Generator().manual_seed(5)

    def drawn(*shape: int, mean: float = 0.0, std: float = 0.2) -> torch.Tensor:
        return mean + std * torch.randn(shape, generator=generator)
    mtp |= {f"{MTP}e_proj.weight": drawn(d, d), f"{MTP}h_proj.weight": drawn(d, d),
            **{f"{MTP}{norm}.weight": drawn(d, mean=1.0) for norm in ("enorm", "hnorm", "norm")},
            f"{MTP}hc_head_fn": drawn(n, n * d, std=0.1), f"{MTP}hc_head_base": drawn(n, std=0.3),
            f"{MTP}hc_head_scale": drawn(1, mean=1.0, std=0.3)}
    (folder / "model.safetensors").unlink()
    save_file(tensors | mtp, folder / "model.safetensors", metadata={"format": "pt"})
    settings = json.loads((folder / "config.json").read_text())
    settings |= {"num_hidden_layers": 3, "layer_types": LAYER_TYPES, "mlp_layer_types": list(MLP_TYPES),
                 "num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(settings))
    return deep, mtp


def test_the_mtp_layer_imports_and_exports_back_under_both_naming_schemes(tmp_path):
    """Under model.mtp_depth=1 the stored layer fills our MTP module; export writes every tensor of the folder back
    bit for bit (the MTP layer's included, config.json saying num_nextn_predict_layers 1), and transformers, which
    drops ``mtp.``, loads the export to the main model's logits. The same folder under DeepSeek's published names
    (no ``model.`` prefix, ``embed``, ``hc_head_fn``, ``kv_norm``) imports to the same weights, bit for bit."""
    _, mtp = make_v4_with_mtp(tmp_path / "hf")
    base = load_config("moe-8x", ["model.mtp_depth=1"])
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", base, seq_len=SEQ)
    assert config.model.mtp_depth == 1 and config.model.layer(3).attention == "sliding_shared_kv"
    state = our_model(tmp_path / "ours.safetensors").state_dict()
    assert torch.equal(state["mtp.0.hidden_proj.weight"], mtp[f"{MTP}h_proj.weight"])
    assert torch.equal(state["mtp.0.hc_head.weight"], mtp[f"{MTP}hc_head_fn"])
    assert torch.equal(state["mtp.0.block.attn.kv_norm.weight"], mtp[f"{MTP}attn.norm.weight"])
    assert torch.equal(state["mtp.0.block.moe.router.expert_bias"], mtp[f"{MTP}ffn.gate.bias"])

    export_folder(tmp_path / "ours.safetensors", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    original, returned = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert original.keys() == returned.keys() and mtp.keys() <= returned.keys()
    for name, value in original.items():
        assert torch.equal(value, returned[name]), name
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    back = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()).logits, hf(tokens()).logits, rtol=0, atol=1e-5)

    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    save_file({published_name(name): value for name, value in original.items()}, published / "model.safetensors",
              metadata={"format": "pt"})
    assert f"{MTP}attn.kv_norm.weight" in hf_tensors(published)
    import_folder(published, tmp_path / "from_published.safetensors", base, seq_len=SEQ)
    again = our_model(tmp_path / "from_published.safetensors").state_dict()
    assert state.keys() == again.keys()
    for name, value in state.items():
        assert torch.equal(value, again[name]), name


def test_mtp_asked_of_a_folder_without_it_is_refused_by_name(tmp_path):
    """A folder ``transformers`` saved (no MTP layer, though its config.json says num_nextn_predict_layers 1)
    imported under model.mtp_depth=1: refused, saying what to set; without it, imported."""
    make_v4(tmp_path / "hf")
    with pytest.raises(ConfigError, match=r"model.mtp_depth=1, but the folder stores no multi-token-prediction "
                                          r"layer \(no 'mtp.0.enorm.weight'\): set model.mtp_depth=0"):
        import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x", ["model.mtp_depth=1"]),
                      seq_len=SEQ)
    assert import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"),
                         seq_len=SEQ).model.mtp_depth == 0


def rms_norm(weight: torch.Tensor, eps: float) -> torch.nn.Module:
    norm = v4.DeepseekV4RMSNorm(weight.shape[0], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


def reference_loss(hf, deep, mtp: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The published equations on transformers' pieces: the main model's streams before its ``hc_head`` (a hook),
    its embedding and head; ``DeepseekV4RMSNorm`` for enorm, hnorm and norm; ``DeepseekV4HyperHead`` with the MTP's
    own weights; the decoder layer ``deep.model.layers[3]`` on positions 0..S-2; the cross-entropy against the token
    after next."""
    config, eps = deep.config, deep.config.rms_norm_eps
    captured = []
    hook = hf.model.hc_head.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    hf(ids)
    hook.remove()
    streams = captured[0]  # [B, S, n, D]
    embedded = hf.model.embed_tokens(ids)
    e = rms_norm(mtp[f"{MTP}enorm.weight"], eps)(embedded[:, 1:])
    h = rms_norm(mtp[f"{MTP}hnorm.weight"], eps)(streams[:, :-1])
    x = (e @ mtp[f"{MTP}e_proj.weight"].t()).unsqueeze(2) + h @ mtp[f"{MTP}h_proj.weight"].t()
    positions = torch.arange(SEQ - 1).unsqueeze(0)
    rotary = {kind: deep.model.rotary_emb(embedded, positions, layer_type=kind) for kind in ("main", "compress")}
    mask = v4.create_sliding_window_causal_mask(config=config, inputs_embeds=embedded[:, 1:], attention_mask=None,
                                                cache=None, position_ids=positions)
    out = deep.model.layers[3](x, position_embeddings=rotary, position_ids=positions, attention_mask=mask,
                               input_ids=ids[:, 1:])
    head = v4.DeepseekV4HyperHead(config)
    with torch.no_grad():
        head.hc_fn.copy_(mtp[f"{MTP}hc_head_fn"])
        head.hc_base.copy_(mtp[f"{MTP}hc_head_base"])
        head.hc_scale.copy_(mtp[f"{MTP}hc_head_scale"])
    logits = hf.lm_head(rms_norm(mtp[f"{MTP}norm.weight"], eps)(head(out)))[:, :-1]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())


def test_the_mtp_loss_is_the_published_equations_on_transformers_pieces(tmp_path):
    """Our MTP loss of the imported layer (``moe/mtp.py``'s ``HyperPredictionModule``) against ``reference_loss``,
    fp32 within 1e-5; with the two input norms' weights swapped, or the two projections', it is not."""
    deep, mtp = make_v4_with_mtp(tmp_path / "hf")
    import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x", ["model.mtp_depth=1"]),
                  seq_len=SEQ)
    ours, ids = our_model(tmp_path / "ours.safetensors").train(), tokens()
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        expected = reference_loss(hf, deep.eval(), mtp, ids)
        ours(ids)
        torch.testing.assert_close(ours.last_mtp_losses[0], expected, rtol=1e-5, atol=1e-6)
        module = ours.mtp[0]
        for first, second in [(module.embed_norm.weight, module.hidden_norm.weight),
                              (module.embed_proj.weight, module.hidden_proj.weight)]:
            first_value = first.clone()
            first.copy_(second)
            second.copy_(first_value)
            ours(ids)
            assert abs(float(ours.last_mtp_losses[0]) - float(expected)) > 1e-3
            second.copy_(first)
            first.copy_(first_value)
