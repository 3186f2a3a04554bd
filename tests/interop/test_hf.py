"""Hugging Face interop against the oracle: ``transformers``' own MixtralForCausalLM, built locally from tiny
random configs (no download), saved with ``save_pretrained``, imported by us, exported back."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from config.errors import ConfigError
from config.run import load_config
from interop.hf import export_folder, hf_run_config, import_folder, main
from interop.weights import initial_weights
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.runtime import Runtime, init_runtime
from tests.interop.hf_models import (
    assert_each_edit_refused,
    assert_same_tensors,
    hf_tensors,
    our_model,
    save_random,
)
from tests.parallel.parity import full_state
from tests.spawn import spawn
from training.loop import train
from training.metrics import read_metrics

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
SEQ = 16


def make_hf(folder: Path, seed: int = 0, shard: bool = False, **overrides) -> torch.nn.Module:
    """A random tiny Mixtral saved to ``folder``; norms are randomised too, so a swapped norm shows."""
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    return save_random(transformers.MixtralForCausalLM(transformers.MixtralConfig(**settings)), folder, shard)


def tokens(vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))


SHAPES = {"gqa-top2-untied": {}, "mha-top1-tied": dict(num_key_value_heads=4, num_experts_per_tok=1,
                                                        tie_word_embeddings=True),
          "gqa-top2-tied-wide-heads-sharded": dict(tie_word_embeddings=True, num_local_experts=3, head_dim=16,
                                                   shard=True)}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_import_export_match_transformers(tmp_path, shape):
    settings = dict(SHAPES[shape])
    hf = make_hf(tmp_path / "hf", **settings)
    if settings.get("shard"):
        assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert config.moe.capacity_factor is None and config.moe.top_k == hf.config.num_experts_per_tok
    ours = our_model(tmp_path / "ours.safetensors")
    x = tokens()
    with torch.no_grad():
        expected = hf(x).logits
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-5)

    # our file -> an HF folder that transformers loads and runs to the same logits; every tensor bit-exact
    export_folder(tmp_path / "ours.safetensors", tmp_path / "back")
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, expected, rtol=0, atol=1e-5)
    assert_same_tensors(tmp_path / "hf", tmp_path / "back", tied=settings.get("tie_word_embeddings", False))


def test_export_of_a_checkpoint(tmp_path):
    """A training checkpoint (a step folder) exports too: train 1 step from an HF folder, export, compare."""
    make_hf(tmp_path / "hf")

    config = hf_run_config(load_config("moe-8x", TINY_RUN), tmp_path / "hf")
    groups = ParallelGroups.build(Layout.resolve(1, **config.parallel.degrees()), "cpu")
    result = train(config, tmp_path / "run", Runtime(0, 1, 0, torch.device("cpu")), groups,
                   init_weights=initial_weights(f"hf:{tmp_path / 'hf'}", config))
    export_folder(tmp_path / "run" / "checkpoints", tmp_path / "back")
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back").eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, result.model.eval()(x), rtol=0, atol=1e-5)


def test_bad_input_is_named(tmp_path):
    make_hf(tmp_path / "hf", shard=True)
    out, base = tmp_path / "ours.safetensors", load_config("moe-8x")
    cases = [
        (dict(architectures=["LlamaForCausalLM"], model_type="llama"), "LlamaForCausalLM.*MixtralForCausalLM"),
        (dict(sliding_window=8), "sliding_window=8"),
        (dict(router_jitter_noise=0.1), "router_jitter_noise"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(head_dim=16), "self_attn.q_proj.weight.*shape"),  # heads of their own width: the files must have them
        (dict(quantization_config={"bits": 4}), "quantization_config"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters"),
        (dict(intermediate_size=16), "block_sparse_moe.experts.0.w3.weight.*shape"),
    ]
    assert_each_edit_refused(tmp_path / "hf", cases, out, base, SEQ)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        import_folder(tmp_path / "hf", out, base, seq_len=128)
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1]
    shard.unlink()
    assert main(["import", str(tmp_path / "hf"), "--out", str(out), "--seq-len", str(SEQ)]) == 2
    with pytest.raises(ConfigError, match=shard.name):
        import_folder(tmp_path / "hf", out, base, seq_len=SEQ)


def test_cli_round_trip_and_no_transformers_import(tmp_path):
    make_hf(tmp_path / "hf")
    ours, back = tmp_path / "ours.safetensors", tmp_path / "back"
    # one interpreter for both commands (each start imports torch): import, then export what it wrote
    code = ("import sys, interop.hf as h; rc = h.main(sys.argv[1:7]) or h.main(sys.argv[7:]); "
            "assert 'transformers' not in sys.modules; sys.exit(rc)")
    args = ["import", str(tmp_path / "hf"), "--out", str(ours), "--seq-len", str(SEQ),
            "export", str(ours), "--out", str(back)]
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    returned = hf_tensors(back)
    assert all(torch.equal(value, returned[name]) for name, value in hf_tensors(tmp_path / "hf").items())


TINY_RUN = ["model.seq_len=16", "train.global_batch_size=4", "train.steps=1", "train.warmup_steps=1",
            "train.precision=fp32", "train.eval_interval=0", "train.eval_batches=1", "logging.wandb=disabled",
            "logging.log_interval=1", "logging.progress=lines", "checkpoint.interval=1"]


def _hf_run(rank: int, world_size: int, overrides: list[str], folder: str, run_dir: str, out: str) -> None:
    """One rank of ``--init-from hf:DIR`` as train.py runs it; rank 0 saves the gathered final weights."""

    config = hf_run_config(load_config("moe-8x", overrides), folder)
    groups = ParallelGroups.build(Layout.resolve(world_size, **config.parallel.degrees()), "cpu")
    result = train(config, Path(run_dir), init_runtime(), groups, init_weights=initial_weights(f"hf:{folder}", config))
    state = full_state(result.model)
    if rank == 0:
        torch.save(state, out)
    dist.barrier()


def _hf_runs(rank: int, world_size: int, runs: list[tuple[list[str], str, str, str]]) -> None:
    """``_hf_run`` for each (overrides, folder, run_dir, out) of ``runs``, in one spawned group: one spawn's cost."""
    for run in runs:
        _hf_run(rank, world_size, *run)


def test_init_from_hf_under_a_parallel_layout(tmp_path):
    """2 gloo ranks (dp_shard=2, ep=2 over it) start from an HF folder, each reading its own slices: the first
    step's loss is one process's, and with a tiny learning rate the weights are still the folder's."""

    hf = make_hf(tmp_path / "hf")
    run = [*TINY_RUN, "train.steps=2", "train.lr=1e-9", "checkpoint.interval=null"]
    runs = {1: [], 2: ["parallel.dp_shard=2", "parallel.ep=2"]}
    results = {}
    for world, layout in runs.items():
        run_dir, out = tmp_path / f"run{world}", tmp_path / f"state{world}.pt"
        if world == 1:  # the reference, in this process
            config = hf_run_config(load_config("moe-8x", run), tmp_path / "hf")
            groups = ParallelGroups.build(Layout.resolve(1, **config.parallel.degrees()), "cpu")
            result = train(config, run_dir, Runtime(0, 1, 0, torch.device("cpu")), groups,
                           init_weights=initial_weights(f"hf:{tmp_path / 'hf'}", config))
            torch.save(full_state(result.model), out)
        else:
            spawn(_hf_run, world, world, [*run, *layout], str(tmp_path / "hf"), str(run_dir), str(out))
        losses = [r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
        results[world] = losses, torch.load(out, weights_only=True)
        recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert recorded["moe"]["num_experts"] == 4 and recorded["model"]["d_model"] == 32
        assert recorded["moe"]["capacity_factor"] is None and recorded["model"]["n_kv_heads"] == 2
    assert results[2][0][0] == pytest.approx(results[1][0][0], abs=1e-5)
    hf_state = hf.state_dict()
    for world in runs:
        state = results[world][1]
        torch.testing.assert_close(state["layers.1.moe.experts.w_gate"][2],
                                   hf_state["model.layers.1.mlp.experts.gate_up_proj"][2, :24].t(),
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(state["layers.0.attn.wk.weight"], hf_state["model.layers.0.self_attn.k_proj.weight"],
                                   rtol=0, atol=1e-6)


def test_a_published_model_started_at_a_pre_training_rate_is_warned_about(tmp_path, capsys):
    import train

    make_hf(tmp_path / "hf")
    for lr, warned in (("3e-3", True), ("2.2e-4", True), ("2e-5", False)):
        args = train.parse_args(["--init-from", f"hf:{tmp_path / 'hf'}", "--dry-run", "--set", f"train.lr={lr}",
                                  "model.seq_len=32"])
        train.check(args)
        err = capsys.readouterr().err
        assert (f"--init-from hf: fine-tunes a trained model at train.lr={float(lr):g}, a pre-training rate" in err
                ) == warned, err


def test_the_help_and_the_docs_name_every_family_that_init_from_takes(capsys):
    """``train.py --help``, configuration.md's --init-from row and huggingface.md's folder line name the families
    of interop's registry, not the first two."""
    import train as train_command
    from interop.hf import FAMILIES

    with pytest.raises(SystemExit):
        train_command.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    docs = Path(__file__).resolve().parents[2] / "docs"
    folder_line = " ".join((docs / "huggingface.md").read_text().split()).split("`HF_DIR` is a Hugging Face")[1][:360]
    row = next(line for line in (docs / "configuration.md").read_text().splitlines() if "`--init-from" in line)
    names = {"MixtralForCausalLM": "Mixtral", "Qwen3MoeForCausalLM": "Qwen3-MoE",
             "DeepseekV3ForCausalLM": "DeepSeek-V3", "Glm4MoeForCausalLM": "GLM-4.5", "GptOssForCausalLM": "GPT-OSS",
             "DeepseekV32ForCausalLM": "DeepSeek-V3.2", "GlmMoeDsaForCausalLM": "GLM-5",
             "Qwen3NextForCausalLM": "Qwen3-Next", "Qwen3_5MoeForCausalLM": "Qwen3.5-MoE",
             "Qwen3_5MoeForConditionalGeneration": "Qwen3.5-MoE", "DeepseekV4ForCausalLM": "DeepSeek-V4",
             "MiniMaxM2ForCausalLM": "MiniMax-M2"}
    assert set(FAMILIES) == set(names)
    for architecture, name in names.items():
        assert architecture in text, architecture
        assert f"`{architecture}`" in folder_line and name in row, architecture
