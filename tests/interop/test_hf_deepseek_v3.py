"""DeepSeek-V3 interop against the oracle: ``transformers``' own DeepseekV3ForCausalLM, built locally from tiny
random configs (no download), saved with ``save_pretrained``, imported by us, exported back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from config.errors import ConfigError
from config.run import load_config
from interop.hf import export_family, export_folder, import_folder
from tests.interop.hf_models import (
    assert_each_edit_refused,
    assert_oracle_and_export_back,
    edit_config,
    hf_tensors,
    our_model,
    save_random,
)
from tests.interop.test_hf import tokens

transformers = pytest.importorskip("transformers")
SEQ = 16


def make_deepseek(folder: Path, seed: int = 0, shard: bool = False, **overrides) -> torch.nn.Module:
    """A random tiny DeepSeek-V3 saved to ``folder``: norms randomised, and correction biases drawn so that they
    change which experts are chosen (transformers initialises them to zero)."""
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                    n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                    q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                    routed_scaling_factor=2.5, max_position_embeddings=32, rms_norm_eps=1e-6,
                    initializer_range=0.2, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**settings))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    return save_random(model, folder, shard)


def as_published(folder: Path) -> None:
    """Rewrite a saved config.json as DeepSeek-V3's published one has it (transformers 4.x era): YaRN under a
    top-level ``rope_scaling`` with ``type``, ``rope_theta`` apart, no ``rope_interleave``, and the keys of
    DeepSeek's own code (scoring_func, topk_method, moe_layer_freq, aux_loss_alpha, seq_aux, ep_size)."""
    data = json.loads((folder / "config.json").read_text())
    data["rope_theta"] = data.pop("rope_parameters")["rope_theta"]
    data.pop("rope_interleave")
    data |= {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
             "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1, "aux_loss_alpha": 0.001,
             "seq_aux": True, "ep_size": 1, "torch_dtype": data.pop("dtype"), "transformers_version": "4.33.1"}
    (folder / "config.json").write_text(json.dumps(data))


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 1.0}
SHAPES = {
    "query-lora-groups-dense-first-yarn": dict(rope_parameters=YARN),
    "full-query-one-group-all-moe-tied": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0,
                                              tie_word_embeddings=True, num_hidden_layers=2),
    "two-shared-two-groups-sharded": dict(n_shared_experts=2, n_group=2, topk_group=1, first_k_dense_replace=2,
                                             norm_topk_prob=False, routed_scaling_factor=1.0, shard=True),
    "as-published-4.x-config": dict(published=True),
    "kimi-k2-model-type-one-group-yarn": dict(kimi=True, n_group=1, topk_group=1, rope_parameters=YARN
                                              | {"beta_fast": 1.0, "beta_slow": 1.0}, routed_scaling_factor=2.827),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_import_export_match_transformers(tmp_path, shape):
    settings = dict(SHAPES[shape])
    published, kimi = settings.pop("published", False), settings.pop("kimi", False)
    hf = make_deepseek(tmp_path / "hf", **settings)
    if kimi:  # Kimi K2's config.json: this architecture under its own model_type (transformers does not know it)
        edit_config(tmp_path / "hf", model_type="kimi_k2")
    if published:  # transformers reads the rewritten config as it reads DeepSeek's: reload it so
        as_published(tmp_path / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert config.model.latent_attention and config.moe.score_func == "sigmoid"
    assert config.model.first_moe_layer == settings.get("first_k_dense_replace", 1)
    assert (config.moe.n_group, config.moe.groups_per_token) == (settings.get("n_group", 4),
                                                                 settings.get("topk_group", 2))
    assert config.model.rope_scaling == ("yarn" if published or "rope_parameters" in settings else "none")
    assert config.moe.routed_scaling_factor == settings.get("routed_scaling_factor", 2.5)
    ours = our_model(tmp_path / "ours.safetensors")
    assert any(layer.router.expert_bias.abs().sum() > 0 for layer in ours.moe_layers().values())
    assert_oracle_and_export_back(tmp_path, hf, ours, tokens(), "DeepseekV3ForCausalLM",
                                  tied=settings.get("tie_word_embeddings", False))


def test_the_rotary_reordering_is_needed(tmp_path):
    """Read without reordering DeepSeek's interleaved rotary rows, the logits differ: the oracle sees the layout."""
    hf = make_deepseek(tmp_path / "hf")
    import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    ours = our_model(tmp_path / "ours.safetensors")
    with torch.no_grad():
        for block in ours.layers.values():
            block.attn.wkv_a.weight.copy_(hf.state_dict()[
                f"model.layers.{block_index(ours, block)}.self_attn.kv_a_proj_with_mqa.weight"])
        x = tokens()
        assert (ours(x) - hf(x).logits).abs().max() > 1e-3


def block_index(model, block) -> int:
    return next(int(i) for i, b in model.layers.items() if b is block)


def test_bad_input_is_named(tmp_path):
    make_deepseek(tmp_path / "hf")
    out, base = tmp_path / "ours.safetensors", load_config("moe-8x")
    cases = [
        (dict(scoring_func="softmax"), "scoring_func must be 'sigmoid'"),
        (dict(topk_method="greedy"), "topk_method must be 'noaux_tc'"),
        (dict(moe_layer_freq=2), "moe_layer_freq must be 1"),
        (dict(rope_interleave=False), "rope_interleave must be true"),
        (dict(num_key_value_heads=2), "num_key_value_heads=2 is not supported: latent attention"),
        (dict(n_shared_experts=0), "n_shared_experts=0 is not supported"),
        (dict(n_group=3), r"moe.n_group=3 must divide moe.num_experts=8"),
        (dict(topk_group=5), r"moe.topk_group=5 must be between 1 and moe.n_group=4"),
        (dict(topk_group=1, num_experts_per_tok=3), r"moe.top_k=3 is more experts than moe.topk_group=1 groups"),
        (dict(rope_parameters=YARN | {"rope_type": "longrope"}), "rope_parameters=.* is not supported"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(first_k_dense_replace=2), "has no tensor 'model.layers.1.mlp.up_proj.weight'"),
    ]
    assert_each_edit_refused(tmp_path / "hf", cases, out, base, SEQ)


def test_export_refuses_what_deepseek_v3_cannot_express():
    """The latent-attention, sigmoid-routed model goes to DeepSeek-V3 and to no other family; what DeepSeek-V3
    lacks is named."""
    mla = ["model.kv_lora_rank=8", "model.qk_nope_head_dim=4", "model.qk_rope_head_dim=4", "model.v_head_dim=4",
           "moe.score_func=sigmoid", "moe.num_shared_experts=1", "model.first_moe_layer=1"]

    def family(*overrides: str) -> str:
        config = load_config("moe-8x", [*mla, *overrides])
        return export_family(config.model, config.moe).architecture

    assert family() == "DeepseekV3ForCausalLM"
    for overrides, message in [(["moe.score_func=softmax"], "score_func='softmax'"),
                               (["moe.num_shared_experts=0"], "shared experts of width 0"),
                               (["moe.shared_expert_hidden=7"], "shared experts of width 7"),
                               (["model.moe_every=2"], "model.moe_every=2"),
                               (["moe.n_group=8", "moe.top_k=2"], "groups of one expert")]:
        with pytest.raises(ConfigError, match=message):
            family(*overrides)
    config = load_config("moe-8x", ["moe.score_func=sigmoid", "moe.num_shared_experts=1"])
    with pytest.raises(ConfigError, match="DeepSeek-V3 attends with latent attention"):
        export_family(config.model, config.moe, "DeepseekV3ForCausalLM")
    config = load_config("moe-8x", mla)
    for architecture in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        with pytest.raises(ConfigError, match="cannot export as"):
            export_family(config.model, config.moe, architecture)


BLOCK = (16, 8)  # scale blocks smaller than DeepSeek's 128 x 128, so the tiny matrices have several, some partial


def quantize_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Rewrite a saved folder as DeepSeek publishes its weights: every linear weight but the router's, the embedding
    and the head in fp8 e4m3 with one fp32 ``weight_scale_inv`` per block; returns each such weight dequantised by
    a reference written out block by block."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    reference = {}
    for name in [n for n in tensors if n.endswith("proj.weight") or n.endswith("kv_a_proj_with_mqa.weight")]:
        weight = tensors[name]
        rows, cols = weight.shape
        blocks = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
        scales, values, dequantized = torch.empty(blocks), torch.empty_like(weight), torch.empty_like(weight)
        for i in range(blocks[0]):
            for j in range(blocks[1]):
                part = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
                scales[i, j] = weight[part].abs().max() / 448.0  # e4m3's largest finite value
                values[part] = weight[part] / scales[i, j]
        quantized = values.to(torch.float8_e4m3fn)
        for i in range(blocks[0]):
            for j in range(blocks[1]):
                part = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
                dequantized[part] = quantized[part].float() * scales[i, j]
        tensors[name], tensors[name + "_scale_inv"] = quantized, scales
        reference[name] = dequantized.to(torch.bfloat16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    edit_config(folder, quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                             "weight_block_size": list(BLOCK)})
    return reference


def test_fp8_weights_are_dequantized_as_read(tmp_path):
    """Each fp8 weight imports as the reference dequantisation, bit for bit in bf16 (the rotary rows reordered
    as ever), whether its blocks are whole or cut by the matrix's edge; the rest as stored."""
    hf = make_deepseek(tmp_path / "hf", q_lora_rank=None)
    reference = quantize_folder(tmp_path / "hf")
    assert len(reference) == 3 * 4 + 3 + 2 * 3 * (1 + 8)  # 3 layers' attention, a dense FFN, 2 MoE layers' experts
    import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    with safe_open(str(tmp_path / "ours.safetensors"), framework="pt") as handle:
        state = {name: handle.get_tensor(name) for name in handle.keys()}
    assert state["layers.0.attn.wkv_b.weight"].dtype == torch.bfloat16
    assert torch.equal(state["layers.0.attn.wkv_b.weight"], reference["model.layers.0.self_attn.kv_b_proj.weight"])
    assert torch.equal(state["layers.2.moe.experts.w_out"][5],
                       reference["model.layers.2.mlp.experts.5.down_proj.weight"].t())
    assert torch.equal(state["layers.0.ffn.w_gate.weight"], reference["model.layers.0.mlp.gate_proj.weight"])
    rows = torch.tensor(hf_deepseek_rows())
    assert torch.equal(state["layers.1.attn.wkv_a.weight"],
                       reference["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"][rows])
    assert state["layers.1.moe.router.gate"].dtype == torch.float32  # not quantised: as stored
    # fp8 moved the weights (so the checks above could fail), by about its precision (3 mantissa bits)
    original = hf.state_dict()["model.layers.0.self_attn.kv_b_proj.weight"]
    error = (reference["model.layers.0.self_attn.kv_b_proj.weight"].float() - original).abs()
    assert 0 < error.max() <= original.abs().max() / 8


def hf_deepseek_rows() -> list[int]:
    """Our rows of kv_a_proj_with_mqa (12 latent + 4 rotary, interleaved pairs) in terms of DeepSeek's."""
    from interop.hf_deepseek_v3 import interleaved_rows

    return list(interleaved_rows(12 + 4, 4, 1))


def test_fp8_settings_we_do_not_dequantize_are_refused(tmp_path):
    make_deepseek(tmp_path / "hf")
    for settings, message in [({"quant_method": "awq"}, "only block-scaled fp8"),
                              ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e4m3"),
                              ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers")]:
        edit_config(tmp_path / "hf", quantization_config=settings)
        with pytest.raises(ConfigError, match=message):
            import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)


def test_a_box_of_an_fp8_weight_is_that_box_of_the_whole():
    """What a rank of ``--init-from hf:DIR`` reads: any box, with only the scale blocks over it, dequantises to the
    same numbers as the whole matrix's box (blocks cut by the box's edges included)."""
    from interop.fp8 import dequantize, scale_box

    values = torch.randn(40, 20).to(torch.float8_e4m3fn)
    scales = torch.rand(3, 3) + 0.5  # blocks of 16 x 8: the last ones partial
    whole = dequantize(values, scales, slice(0, 40), slice(0, 20), BLOCK)
    for rows, cols in [(slice(5, 23), slice(3, 11)), (slice(32, 40), slice(16, 20)), (slice(0, 1), slice(7, 9))]:
        part = dequantize(values[rows, cols], scales[scale_box(rows, cols, BLOCK)], rows, cols, BLOCK)
        assert torch.equal(part, whole[rows, cols])
    # and the whole is the block-by-block product
    assert whole[17, 9] == (values[17, 9].float() * scales[1, 1]).to(torch.bfloat16)


@pytest.mark.parametrize("world, layout, quantized", [
    (2, ["parallel.dp_shard=1", "parallel.tp=2", "parallel.ep=2"], True),
    (4, ["parallel.dp_shard=2", "parallel.pp=2", "parallel.ep=2"], False)], ids=["tp=2xep=2-fp8", "pp=2xep=2"])
def test_init_from_deepseek_under_parallel_layouts(tmp_path, world, layout, quantized):
    """``--init-from hf:DIR`` of a DeepSeek-V3 folder, each rank reading its boxes (split heads' rotary rows
    reordered, fp8 boxes with their scale blocks): the first step's loss is one process's, and with a tiny learning
    rate every weight is still what one process read."""
    from config.run import load_config as load
    from interop.hf import hf_run_config
    from interop.weights import initial_weights
    from parallel.groups import ParallelGroups
    from parallel.layout import Layout
    from parallel.runtime import Runtime
    from tests.interop.test_hf import TINY_RUN, _hf_run
    from tests.parallel.parity import full_state
    from tests.spawn import spawn
    from training.loop import train
    from training.metrics import read_metrics

    make_deepseek(tmp_path / "hf", num_hidden_layers=2, first_k_dense_replace=1)
    if quantized:
        quantize_folder(tmp_path / "hf")
    run = [*TINY_RUN, "train.steps=2", "train.lr=1e-9", "checkpoint.interval=null", "moe.capacity_factor=null"]
    config = hf_run_config(load("moe-8x", run), tmp_path / "hf")
    groups = ParallelGroups.build(Layout.resolve(1, **config.parallel.degrees()), "cpu")
    result = train(config, tmp_path / "run1", Runtime(0, 1, 0, torch.device("cpu")), groups,
                   init_weights=initial_weights(f"hf:{tmp_path / 'hf'}", config))
    reference = full_state(result.model)
    spawn(_hf_run, world, world, [*run, *layout], str(tmp_path / "hf"), str(tmp_path / "run2"),
          str(tmp_path / "state2.pt"))
    losses = {w: [r["train/loss"] for r in read_metrics(tmp_path / f"run{w}" / "metrics.jsonl") if "train/loss" in r]
              for w in (1, 2)}
    assert losses[2][0] == pytest.approx(losses[1][0], abs=1e-5)
    state = torch.load(tmp_path / "state2.pt", weights_only=True)  # rank 0's: under pp, its stage's
    assert "layers.0.attn.wkv_a.weight" in state and state.keys() <= reference.keys()
    for name, value in state.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-6, msg=name)


def add_mtp_layer(folder: Path, n_layers: int) -> dict[str, torch.Tensor]:
    """Store a multi-token-prediction layer after the last as DeepSeek-V3 does (layer n_layers: a decoder layer's
    tensors, drawn anew, with enorm, hnorm, eh_proj, shared_head.norm, and copies of the embedding and head)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    last, mtp = f"model.layers.{n_layers - 1}.", f"model.layers.{n_layers}."
    added = {mtp + name[len(last):]: torch.randn_like(value) for name, value in tensors.items()
             if name.startswith(last)}
    d = tensors["model.norm.weight"].shape[0]
    added |= {mtp + "enorm.weight": torch.rand(d) + 0.5, mtp + "hnorm.weight": torch.rand(d) + 0.5,
              mtp + "eh_proj.weight": torch.randn(d, 2 * d), mtp + "shared_head.norm.weight": torch.rand(d) + 0.5,
              mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
              mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    save_file(tensors | added, folder / "model.safetensors", metadata={"format": "pt"})
    return added


def test_the_mtp_layer_imports_into_our_modules_and_exports_back(tmp_path):
    """With model.mtp_depth=1 the stored layer after the last fills our MTP module (rotary rows reordered, experts
    stacked); the main model still gives transformers' logits; export writes the layer back bit for bit (but the
    embedding and head copies, which ours share) and transformers, which has no MTP, loads the folder."""
    hf = make_deepseek(tmp_path / "hf")
    added = add_mtp_layer(tmp_path / "hf", 3)
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x", ["model.mtp_depth=1"]),
                           seq_len=SEQ)
    assert config.model.mtp_depth == 1
    with safe_open(str(tmp_path / "ours.safetensors"), framework="pt") as handle:
        state = {name: handle.get_tensor(name) for name in handle.keys()}
    assert torch.equal(state["mtp.0.proj.weight"], added["model.layers.3.eh_proj.weight"])
    assert torch.equal(state["mtp.0.embed_norm.weight"], added["model.layers.3.enorm.weight"])
    assert torch.equal(state["mtp.0.block.moe.experts.w_in"][2],
                       added["model.layers.3.mlp.experts.2.up_proj.weight"].t())
    assert torch.equal(state["mtp.0.block.attn.wkv_a.weight"],
                       added["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"][torch.tensor(hf_deepseek_rows())])
    ours = our_model(tmp_path / "ours.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), hf(tokens()).logits, rtol=0, atol=1e-5)  # eval: no MTP
    export_folder(tmp_path / "ours.safetensors", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    original = {n: v for n, v in hf_tensors(tmp_path / "hf").items()
                if not n.endswith(("layers.3.embed_tokens.weight", "layers.3.shared_head.head.weight"))}
    assert_same_tensors_dict(original, hf_tensors(tmp_path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens()).logits, hf(tokens()).logits, rtol=0, atol=1e-5)


def assert_same_tensors_dict(original: dict[str, torch.Tensor], returned: dict[str, torch.Tensor]) -> None:
    assert original.keys() == returned.keys()
    for name, value in original.items():
        assert torch.equal(value, returned[name]), name


def test_an_imported_mtp_module_predicts_from_the_normalised_hidden_state_as_served(tmp_path):
    """The stored MTP layer's loss against a reference built from transformers' parts, by the convention of the
    engines that serve DeepSeek-V3's MTP weights (vLLM, SGLang; DeepSeek's own inference code has none): ``hnorm``
    takes the main model's hidden state after its final norm (transformers' ``last_hidden_state``), ``enorm`` the
    next token's embedding, ``eh_proj`` their concatenation (embedding first), then the stored decoder layer as
    transformers runs it, ``shared_head.norm`` and the head; the cross-entropy against the token after next."""
    hf = make_deepseek(tmp_path / "hf")
    added = add_mtp_layer(tmp_path / "hf", 3)
    import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x", ["model.mtp_depth=1"]),
                  seq_len=SEQ)
    ours = our_model(tmp_path / "ours.safetensors").train()
    ids = tokens()
    ours(ids)

    stored = {name.removeprefix("model.layers.3."): value for name, value in added.items()}
    # the stored layer as transformers loads a decoder layer (its experts fused as it fuses them): a model of one
    # layer more reads it from the folder
    layer = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", num_hidden_layers=4).model.layers[3]
    rms = lambda x, weight: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + hf.config.rms_norm_eps) * weight  # noqa: E731
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state  # after the main model's final norm
        embedded = hf.model.embed_tokens(ids)
        inputs = torch.cat((rms(embedded[:, 1:], stored["enorm.weight"]), rms(hidden[:, :-1], stored["hnorm.weight"])),
                           -1) @ stored["eh_proj.weight"].t()  # position i: h_i with the embedding of t_{i+1}
        positions = torch.arange(SEQ - 1).unsqueeze(0)
        out = layer(inputs, position_ids=positions, position_embeddings=hf.model.rotary_emb(inputs, positions))
        logits = rms(out[:, :-1], stored["shared_head.norm.weight"]) @ stored["shared_head.head.weight"].t()
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten())
    torch.testing.assert_close(ours.last_mtp_losses[0], expected, rtol=1e-5, atol=1e-6)
