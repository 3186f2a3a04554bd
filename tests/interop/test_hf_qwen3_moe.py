"""Qwen3-MoE interop against the oracle: ``transformers``' own Qwen3MoeForCausalLM, built locally from tiny random
configs (no download), saved with ``save_pretrained``, imported by us, exported back (see ``test_hf.py`` for
Mixtral and the helpers both use)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from config.errors import ConfigError
from config.run import load_config
from interop.hf import export_family, export_folder, hf_run_config, import_folder, main
from interop.weights import initial_weights
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.runtime import Runtime
from tests.interop.hf_models import (
    assert_each_edit_refused,
    assert_oracle_and_export_back,
    edit_config,
    hf_tensors,
    our_model,
    save_random,
)
from tests.interop.test_hf import TINY_RUN, _hf_runs, tokens
from tests.interop.test_hf_gpt_oss import make_gpt_oss
from tests.parallel.parity import full_state
from tests.spawn import spawn
from training.loop import train
from training.metrics import read_metrics

transformers = pytest.importorskip("transformers")
SEQ = 16


def make_qwen3(folder: Path, seed: int = 0, shard: bool = False, **overrides) -> torch.nn.Module:
    """A random tiny Qwen3-MoE saved to ``folder``; norms (q/k norms too) are randomised, so a swapped one shows."""
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64, rope_theta=10000.0,
                    rms_norm_eps=1e-6, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    return save_random(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**settings)), folder, shard)


def as_written_by_transformers_4(folder: Path) -> None:
    """Rewrite a saved config.json as the published Qwen3-MoE models have it (transformers 4.5x): ``num_experts``,
    a top-level ``rope_theta``, ``rope_scaling: null``, ``max_window_layers``, ``torch_dtype``."""
    data = json.loads((folder / "config.json").read_text())
    data["num_experts"] = data.pop("num_local_experts")
    data["rope_theta"] = data.pop("rope_parameters")["rope_theta"]
    data |= {"rope_scaling": None, "max_window_layers": data["num_hidden_layers"], "torch_dtype": data.pop("dtype"),
             "transformers_version": "4.51.0"}
    (folder / "config.json").write_text(json.dumps(data))


# name -> (transformers settings, our (moe_every, first_moe_layer) for them)
SHAPES = {
    "gqa-top2-untied-renormalised-4.x-config": (dict(written_by_4=True), (1, 0)),
    "mha-top1-tied-not-renormalised": (dict(num_key_value_heads=4, num_experts_per_tok=1, tie_word_embeddings=True,
                                            norm_topk_prob=False), (1, 0)),
    "wide-heads-dense-first-sharded": (dict(head_dim=16, num_hidden_layers=3, mlp_only_layers=[0],
                                            norm_topk_prob=False, shard=True), (1, 1)),
    "sparse-step-2-top2-tied": (dict(num_hidden_layers=4, decoder_sparse_step=2, tie_word_embeddings=True,
                                     num_experts=3), (2, 1)),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_import_export_match_transformers(tmp_path, shape):
    settings, (moe_every, first_moe_layer) = SHAPES[shape]
    settings = dict(settings)
    written_by_4 = settings.pop("written_by_4", False)
    hf = make_qwen3(tmp_path / "hf", **settings)
    if written_by_4:
        as_written_by_transformers_4(tmp_path / "hf")
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert config.model.qk_norm and config.model.head_size == settings.get("head_dim", 8)
    assert (config.model.moe_every, config.model.first_moe_layer) == (moe_every, first_moe_layer)
    assert config.moe.renormalize == settings.get("norm_topk_prob", True) and config.moe.capacity_factor is None
    ours = our_model(tmp_path / "ours.safetensors")
    assert_oracle_and_export_back(tmp_path, hf, ours, tokens(), "Qwen3MoeForCausalLM",
                                  tied=settings.get("tie_word_embeddings", False))


def test_bad_input_is_named(tmp_path):
    make_qwen3(tmp_path / "hf", num_hidden_layers=4)
    out, base = tmp_path / "ours.safetensors", load_config("moe-8x")
    cases = [
        (dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe"),
         "Qwen2MoeForCausalLM: supported are MixtralForCausalLM .*, Qwen3MoeForCausalLM"),
        (dict(model_type="qwen3"), "architecture Qwen3MoeForCausalLM with model_type 'qwen3', not its 'qwen3_moe'"),
        (dict(use_sliding_window=True, sliding_window=8), "use_sliding_window=True"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
        (dict(shared_expert_intermediate_size=32), "shared_expert_intermediate_size"),
        (dict(num_experts=8), "num_experts=8 and num_local_experts=4 disagree"),
        (dict(mlp_only_layers=[1]), r"mlp_only_layers=\[1\] makes layers \[0, 2, 3\] MoE"),
        (dict(moe_intermediate_size=16), "mlp.experts.0.up_proj.weight.*shape"),
    ]
    assert_each_edit_refused(tmp_path / "hf", cases, out, base, SEQ)
    # every layer dense maps too (model.moe_every=0), but these files have no dense FFN: the first missing named
    edit_config(tmp_path / "hf", mlp_only_layers=[0, 1, 2, 3])
    with pytest.raises(ConfigError, match="has no tensor 'model.layers.0.mlp.up_proj.weight'"):
        import_folder(tmp_path / "hf", out, base, seq_len=SEQ)


def test_export_picks_the_family_that_expresses_the_model(tmp_path, capsys):
    """Qwen3's q/k norms go to Qwen3-MoE, a Mixtral shape to Mixtral; a shape neither has is refused with each
    family's reason, and a named architecture that cannot hold the model with its own."""
    def family(*overrides: str) -> str:
        config = load_config("moe-8x", list(overrides))
        return export_family(config.model, config.moe).architecture

    assert family() == "MixtralForCausalLM"
    assert family("model.qk_norm=true", "model.first_moe_layer=1") == "Qwen3MoeForCausalLM"
    with pytest.raises(ConfigError, match=r"MixtralForCausalLM: every layer must be MoE.*"
                                          r"Qwen3MoeForCausalLM: model.qk_norm=false"):
        family("model.first_moe_layer=1")
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM: moe.num_shared_experts=1: Qwen3-MoE has none"):
        family("model.qk_norm=true", "moe.num_shared_experts=1")
    make_qwen3(tmp_path / "hf", num_hidden_layers=3, mlp_only_layers=[0])
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "q.safetensors"), "--seq-len", "16"]) == 0
    assert main(["export", str(tmp_path / "q.safetensors"), "--out", str(tmp_path / "mixtral"),
                 "--architecture", "MixtralForCausalLM"]) == 2
    assert "cannot export as MixtralForCausalLM: every layer must be MoE" in capsys.readouterr().err


def test_init_from_qwen3_trains_and_exports(tmp_path):
    """``--init-from hf:DIR`` of a Qwen3 folder with a dense layer: one step trained, the checkpoint exported, and
    transformers runs the export to our trained model's logits."""
    make_qwen3(tmp_path / "hf", num_hidden_layers=3, mlp_only_layers=[0], head_dim=16)
    config = hf_run_config(load_config("moe-8x", TINY_RUN), tmp_path / "hf")
    groups = ParallelGroups.build(Layout.resolve(1, **config.parallel.degrees()), "cpu")
    result = train(config, tmp_path / "run", Runtime(0, 1, 0, torch.device("cpu")), groups,
                   init_weights=initial_weights(f"hf:{tmp_path / 'hf'}", config))
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert recorded["model"]["qk_norm"] and recorded["model"]["head_dim"] == 16
    assert recorded["model"]["first_moe_layer"] == 1
    export_folder(tmp_path / "run" / "checkpoints", tmp_path / "back")
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "back").eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, result.model.eval()(x), rtol=0, atol=1e-5)


def test_init_from_qwen3_and_gpt_oss_under_tensor_and_expert_parallelism(tmp_path):
    """2 gloo ranks (tp=2, ep=2 over it) start from a Qwen3 folder (q/k norms on each rank's heads) and from a
    GPT-OSS one (sinks split with their heads, interleaved gate/up columns and biases read per expert), in one
    spawned group: each first step's loss is one process's, and with a tiny learning rate the weights are still
    the folder's."""
    folders = {"qwen3": make_qwen3(tmp_path / "qwen3", num_hidden_layers=3, mlp_only_layers=[0], head_dim=16),
               "gpt_oss": make_gpt_oss(tmp_path / "gpt_oss")}
    run = [*TINY_RUN, "train.steps=2", "train.lr=1e-9", "checkpoint.interval=null"]
    layout = [*run, "parallel.dp_shard=1", "parallel.tp=2", "parallel.ep=2"]
    references = {}
    for name in folders:
        config = hf_run_config(load_config("moe-8x", run), tmp_path / name)
        groups = ParallelGroups.build(Layout.resolve(1, **config.parallel.degrees()), "cpu")
        result = train(config, tmp_path / f"{name}1", Runtime(0, 1, 0, torch.device("cpu")), groups,
                       init_weights=initial_weights(f"hf:{tmp_path / name}", config))
        references[name] = full_state(result.model)
    spawn(_hf_runs, 2, 2, [(layout, str(tmp_path / name), str(tmp_path / f"{name}2"), str(tmp_path / f"{name}.pt"))
                           for name in folders])
    qwen3, gpt_oss = (hf.state_dict() for hf in folders.values())
    expected = {
        "qwen3": {"layers.1.attn.q_norm.weight": qwen3["model.layers.1.self_attn.q_norm.weight"],
                  "layers.0.ffn.w_gate.weight": qwen3["model.layers.0.mlp.gate_proj.weight"],
                  "layers.2.moe.experts.w_in":
                      qwen3["model.layers.2.mlp.experts.gate_up_proj"][:, 24:].transpose(1, 2)},
        "gpt_oss": {"layers.1.attn.sinks": gpt_oss["model.layers.1.self_attn.sinks"],
                    "layers.2.moe.experts.w_gate": gpt_oss["model.layers.2.mlp.experts.gate_up_proj"][..., ::2],
                    "layers.0.moe.experts.in_bias": gpt_oss["model.layers.0.mlp.experts.gate_up_proj_bias"][:, 1::2]}}
    for name in folders:
        losses = {world: [r["train/loss"] for r in read_metrics(tmp_path / f"{name}{world}" / "metrics.jsonl")
                          if "train/loss" in r] for world in (1, 2)}
        assert losses[2][0] == pytest.approx(losses[1][0], abs=1e-5), name
        for state in (torch.load(tmp_path / f"{name}.pt", weights_only=True), references[name]):
            for tensor, value in expected[name].items():
                torch.testing.assert_close(state[tensor], value, rtol=0, atol=1e-6, msg=f"{name} {tensor}")


def test_export_in_bf16_shards_loads_into_transformers(tmp_path, capsys):
    """``export --dtype bf16 --max-shard-size 20KB``: shards within the size (a larger tensor alone) and an index
    that transformers loads, every tensor the original rounded to bf16; an fp32 sharded export is the original bit
    for bit; a one-file export over those shards replaces the folder whole (none is left beside it), and a folder
    holding a file no export writes is refused, naming it."""
    hf = make_qwen3(tmp_path / "hf", num_hidden_layers=3, mlp_only_layers=[0], head_dim=16)
    ours = tmp_path / "ours.safetensors"
    assert main(["import", str(tmp_path / "hf"), "--out", str(ours), "--seq-len", str(SEQ)]) == 0
    assert main(["export", str(ours), "--out", str(tmp_path / "bf16"), "--dtype", "bf16",
                 "--max-shard-size", "20KB"]) == 0
    index = json.loads((tmp_path / "bf16" / "model.safetensors.index.json").read_text())
    shards = sorted((tmp_path / "bf16").glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {shard.name for shard in shards}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            sizes = [handle.get_slice(name).get_shape() for name in handle.keys()]
        assert len(sizes) == 1 or sum(2 * math.prod(size) for size in sizes) <= 20_000, shard.name
    original, exported = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "bf16")
    assert original.keys() == exported.keys() == index["weight_map"].keys()
    assert index["metadata"]["total_size"] == sum(value.nbytes for value in exported.values())
    for name, value in original.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], value.to(torch.bfloat16)), name

    rounded = copy.deepcopy(hf)  # the oracle with its weights rounded to bf16, computing in fp32
    with torch.no_grad():
        for param in rounded.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, rounded(x).logits, rtol=0, atol=1e-5)

    assert main(["export", str(ours), "--out", str(tmp_path / "fp32"), "--max-shard-size", "0.02MB"]) == 0
    assert (tmp_path / "fp32" / "model.safetensors.index.json").is_file()
    fp32 = hf_tensors(tmp_path / "fp32")
    assert all(torch.equal(value, fp32[name]) for name, value in original.items())
    capsys.readouterr()  # one file over the bf16 shards: the folder is replaced whole, no shard of them is left
    assert main(["export", str(ours), "--out", str(tmp_path / "bf16"), "--overwrite"]) == 0
    assert sorted(path.name for path in (tmp_path / "bf16").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert all(torch.equal(value, hf_tensors(tmp_path / "bf16")[name]) for name, value in original.items())
    (tmp_path / "bf16" / "notes.txt").write_text("mine")  # a file no export writes: never replaced with the folder
    assert main(["export", str(ours), "--out", str(tmp_path / "bf16"), "--overwrite"]) == 2
    assert "holds notes.txt, which an export does not write" in capsys.readouterr().err
    assert (tmp_path / "bf16" / "notes.txt").read_text() == "mine"
    assert main(["export", str(ours), "--out", str(tmp_path / "x"), "--max-shard-size", "5 bananas"]) == 2
    assert "--max-shard-size '5 bananas': give a size such as 5GB" in capsys.readouterr().err
