"""Qwen3-Next's multi-token-prediction module (``mtp.*``, which ``transformers`` drops) in and out: stored beside a
tiny random Qwen3-Next as the published checkpoints store it (vLLM's and SGLang's Qwen3-Next MTP loaders read this
layout), imported into our MTP module, exported back bit for bit, and its loss against a reference built from
``transformers``' own decoder layer by the convention of the engines that serve it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.errors import ConfigError
from config.run import load_config
from interop.hf import export_family, export_folder, import_folder
from tests.interop.hf_models import hf_tensors, our_model
from tests.interop.test_hf import tokens
from tests.interop.test_hf_qwen3_next import SEQ, make_qwen3_5_moe, make_qwen3_next

transformers = pytest.importorskip("transformers")
FULL_LAYER = 1  # make_qwen3_next's layers: linear, then full attention


def add_mtp(folder: Path, decoder: str = "model.") -> dict[str, torch.Tensor]:
    """Store a multi-token-prediction module under ``mtp.`` as the published checkpoints do: ``fc`` [D, 2D],
    ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden`` and ``norm`` (zero-centred), and a full-attention decoder layer
    ``layers.0`` (the full layer's tensor names, drawn anew), every value a bf16 one; config.json declaring it
    (Qwen3.5's in its ``text_config``). ``decoder``: where the folder keeps the decoder's layers."""
    tensors = load_file(folder / "model.safetensors")
    layer = f"{decoder}layers.{FULL_LAYER}."
    generator = torch.Generator().manual_seed(7)

    def drawn(like: torch.Tensor) -> torch.Tensor:
        return (torch.randn(like.shape, generator=generator) * 0.2).bfloat16().float()
    added = {"mtp.layers.0." + name[len(layer):]: drawn(value) for name, value in tensors.items()
             if name.startswith(layer)}
    d = tensors[f"{decoder}norm.weight"].shape[0]
    added |= {"mtp.fc.weight": drawn(torch.empty(d, 2 * d)),
              **{f"mtp.{norm}.weight": drawn(torch.empty(d))
                 for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}}
    save_file(tensors | added, folder / "model.safetensors", metadata={"format": "pt"})
    path = folder / "config.json"
    settings = json.loads(path.read_text())
    (settings.get("text_config") or settings).update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    path.write_text(json.dumps(settings))
    return added


def test_the_mtp_module_imports_into_ours_and_exports_back(tmp_path):
    """With model.mtp_depth=1 the stored module fills our MTP module (norms as 1 + w); the main model still gives
    transformers' logits; export writes every tensor back bit for bit, with the config keys, and transformers,
    which drops MTP, loads the folder."""
    hf = make_qwen3_next(tmp_path / "hf")
    added = add_mtp(tmp_path / "hf")
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors",
                           load_config("moe-8x", ["model.mtp_depth=1"]), seq_len=SEQ)
    assert config.model.mtp_depth == 1
    ours = our_model(tmp_path / "ours.safetensors")
    state = ours.state_dict()
    assert torch.equal(state["mtp.0.proj.weight"], added["mtp.fc.weight"])
    assert torch.equal(state["mtp.0.embed_norm.weight"], 1 + added["mtp.pre_fc_norm_embedding.weight"])
    assert torch.equal(state["mtp.0.block.attn.wk.weight"], added["mtp.layers.0.self_attn.k_proj.weight"])
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(tokens()), hf(tokens()).logits, rtol=0, atol=1e-5)  # eval: no MTP
    export_folder(tmp_path / "ours.safetensors", tmp_path / "back")
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (exported["mtp_num_hidden_layers"], exported["mtp_use_dedicated_embeddings"]) == (1, False)
    original, returned = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert original.keys() == returned.keys() and added.keys() <= returned.keys()
    for name, value in original.items():
        assert torch.equal(value, returned[name]), name
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()).logits, hf(tokens()).logits, rtol=0, atol=1e-5)


def test_the_imported_mtp_loss_is_the_served_modules(tmp_path):
    """Our MTP loss (``moe/mtp.py``, DeepSeek-V3's) of the imported module against a reference built from
    transformers' parts as vLLM's Qwen3-Next MTP runs them: the next token's embedding and the main model's hidden
    state after its final norm, each through its zero-centred pre-fc norm (x̂ · (1 + w)), concatenated embedding
    first, through ``fc``; the stored layer as transformers' own Qwen3-Next full-attention decoder layer (read from
    a folder where it is one layer more); the final norm and the shared head; the cross-entropy against the token
    after next."""
    hf = make_qwen3_next(tmp_path / "hf")
    added = add_mtp(tmp_path / "hf")
    import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x", ["model.mtp_depth=1"]),
                  seq_len=SEQ)
    ours = our_model(tmp_path / "ours.safetensors").train()
    ids = tokens()
    ours(ids)

    deeper = tmp_path / "deeper"  # the MTP layer as layer 2 of a three-layer model
    shutil.copytree(tmp_path / "hf", deeper)
    tensors = {name: value for name, value in load_file(deeper / "model.safetensors").items()
               if not name.startswith("mtp.")}
    tensors |= {"model.layers.2." + name.removeprefix("mtp.layers.0."): value for name, value in added.items()
                if name.startswith("mtp.layers.0.")}
    save_file(tensors, deeper / "model.safetensors", metadata={"format": "pt"})
    settings = json.loads((deeper / "config.json").read_text())
    settings |= {"num_hidden_layers": 3, "layer_types": [*settings["layer_types"], "full_attention"]}
    (deeper / "config.json").write_text(json.dumps(settings))
    layer = transformers.AutoModelForCausalLM.from_pretrained(deeper).model.layers[2]

    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps) * (1 + added[name])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state  # after the main model's final norm
        embedded = hf.model.embed_tokens(ids)
        inputs = torch.cat((norm(embedded[:, 1:], "mtp.pre_fc_norm_embedding.weight"),
                            norm(hidden[:, :-1], "mtp.pre_fc_norm_hidden.weight")), -1) @ added["mtp.fc.weight"].t()
        positions = torch.arange(SEQ - 1).unsqueeze(0)
        out = layer(inputs, position_ids=positions, position_embeddings=hf.model.rotary_emb(inputs, positions))
        logits = hf.lm_head(norm(out[:, :-1], "mtp.norm.weight"))
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())
    torch.testing.assert_close(ours.last_mtp_losses[0], expected, rtol=1e-5, atol=1e-6)


def test_a_folder_with_mtp_imports_without_it_saying_so_and_deeper_mtp_is_refused(tmp_path, capsys):
    """Without model.mtp_depth the module is left out with a note (before, the folder was refused: an unread
    tensor); two modules are refused by name on import and export (the checkpoints store one layer)."""
    make_qwen3_next(tmp_path / "hf")
    add_mtp(tmp_path / "hf")
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert config.model.mtp_depth == 0 and "mtp.layers.0.self_attn.q_proj.weight" in hf_tensors(tmp_path / "hf")
    assert "multi-token prediction module (mtp.*) is imported under model.mtp_depth=1" in capsys.readouterr().err
    assert not any(name.startswith("mtp.") for name in our_model(tmp_path / "ours.safetensors").state_dict())
    with pytest.raises(ConfigError, match="model.mtp_depth=2: the checkpoint stores one multi-token-prediction layer"):
        import_folder(tmp_path / "hf", tmp_path / "two.safetensors", load_config("moe-8x", ["model.mtp_depth=2"]),
                      seq_len=SEQ)
    config.model.mtp_depth = 2
    with pytest.raises(ConfigError, match="model.mtp_depth=2: Qwen3-Next stores one multi-token-prediction layer"):
        export_family(config.model, config.moe, "Qwen3NextForCausalLM")


def test_qwen3_5_moe_mtp_module_in_and_out(tmp_path):
    """Qwen3.5-MoE's checkpoints keep the same module under ``mtp.`` beside ``model.language_model.``: imported from
    the multimodal folder, exported with the text model, every one of its tensors back bit for bit."""
    make_qwen3_5_moe(tmp_path / "hf")
    added = add_mtp(tmp_path / "hf", "model.language_model.")
    import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x", ["model.mtp_depth=1"]),
                  seq_len=SEQ)
    state = our_model(tmp_path / "ours.safetensors").state_dict()
    assert torch.equal(state["mtp.0.norm.weight"], 1 + added["mtp.norm.weight"])
    export_folder(tmp_path / "ours.safetensors", tmp_path / "back", "Qwen3_5MoeForCausalLM")
    returned = hf_tensors(tmp_path / "back")
    for name, value in added.items():
        assert torch.equal(value, returned[name]), name
