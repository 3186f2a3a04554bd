"""Tensors of a Hugging Face folder that its config.json does not use are refused by name, never dropped: a layer
more than ``num_hidden_layers``, q/k/v biases under ``attention_bias: false``, q/k norms under ``use_qk_norm:
false`` (each dropped, the import was another model than the folder's). A declared multi-token-prediction layer
the run does not ask for is the one set of tensors left unread on purpose."""

import re
import shutil

import pytest
from safetensors.torch import load_file, save_file

from config.errors import ConfigError
from config.run import load_config
from interop.hf import import_folder
from tests.interop.hf_models import edit_config
from tests.interop.test_hf import make_hf
from tests.interop.test_hf_glm4_moe import make_glm

SEQ = 16


def refused(folder, message):
    out = folder.parent / f"{folder.name}.safetensors"
    with pytest.raises(ConfigError, match=re.escape(message)):
        import_folder(folder, out, load_config("moe-8x"), seq_len=SEQ)
    assert not out.exists()


def test_a_layer_more_than_config_json_says_is_refused(tmp_path):
    make_hf(tmp_path / "hf")  # a 2-layer Mixtral
    edit_config(tmp_path / "hf", num_hidden_layers=1)
    refused(tmp_path / "hf", "tensor 'model.layers.1.block_sparse_moe.experts.0.w1.weight' is not used by the model "
                             "its config.json describes")


def test_biases_and_qk_norms_that_config_json_switches_off_are_refused(tmp_path):
    make_glm(tmp_path / "glm", num_hidden_layers=2, num_nextn_predict_layers=0)  # with q/k/v biases and q/k norms
    shutil.copytree(tmp_path / "glm", tmp_path / "no-bias")
    edit_config(tmp_path / "no-bias", attention_bias=False)
    refused(tmp_path / "no-bias", "tensor 'model.layers.0.self_attn.k_proj.bias' is not used by the model its "
                                  "config.json describes (6 such tensor(s)")
    edit_config(tmp_path / "glm", use_qk_norm=False)
    refused(tmp_path / "glm", "tensor 'model.layers.0.self_attn.k_norm.weight' is not used")
    edit_config(tmp_path / "glm", use_qk_norm=True)
    import_folder(tmp_path / "glm", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)


def test_a_declared_mtp_layer_is_left_unread_unless_asked_for_but_a_plain_one_is_refused(tmp_path):
    make_glm(tmp_path / "glm", num_hidden_layers=2, num_nextn_predict_layers=0)
    state = load_file(tmp_path / "glm" / "model.safetensors")
    # the second layer as the MTP layer of a 1-layer model: its enorm, hnorm and eh_proj beside a decoder layer
    edit_config(tmp_path / "glm", num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=1)
    refused(tmp_path / "glm", "tensor 'model.layers.1.input_layernorm.weight' is not used")  # no eh_proj: a layer
    width = state["model.embed_tokens.weight"].shape[1]
    for name in ("enorm.weight", "hnorm.weight"):
        state[f"model.layers.1.{name}"] = state["model.norm.weight"].clone()
    state["model.layers.1.eh_proj.weight"] = state["model.embed_tokens.weight"][:width].repeat(1, 2).clone()
    save_file(state, tmp_path / "glm" / "model.safetensors", metadata={"format": "pt"})
    import_folder(tmp_path / "glm", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
