"""Sparse attention's two training stages through the training loop: the dense warm-up trains the indexers alone,
the sparse stage everything; the indexer loss is logged; a run stopped in the warm-up resumes across the change
bit for bit."""

import pytest
import torch

from config.errors import ConfigError
from config.run import load_config
from parallel.checkpoint import published_checkpoints
from tests.parallel.parity import full_state, run
from tests.training.stopped_run import stopped_after_step
from training.checkpointing import Checkpointer

# latent attention with a query bottleneck and a 4-head indexer picking 8 of up to 32 keys: the selection binds
DSA = ["model.n_kv_heads=null", "model.kv_lora_rank=12", "model.q_lora_rank=10", "model.qk_nope_head_dim=6",
       "model.qk_rope_head_dim=4", "model.v_head_dim=5", "model.index_topk=8", "model.index_n_heads=4",
       "model.index_head_dim=8"]
SETTINGS = [*DSA, "train.steps=4", "train.indexer_warmup_steps=2", "checkpoint.interval=1"]


def run_recording_weights(settings, directory):
    """``run``'s records and state, and each step's weights (recorded after the step)."""
    states, original = {}, Checkpointer.after_step

    def record(self, step, model, *args):
        states[step] = full_state(model)
        original(self, step, model, *args)

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(Checkpointer, "after_step", record)
        records, state = run(settings, 1, directory)
    return records, state, states


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: 4 steps in one go (2 of warm-up), each step's weights recorded."""
    return run_recording_weights(SETTINGS, tmp_path_factory.mktemp("uninterrupted"))


def test_the_warm_up_trains_the_indexers_alone_then_everything_trains(uninterrupted):
    records, _, states = uninterrupted
    indexer = [name for name in states[1] if ".indexer." in name]
    others = [name for name in states[1] if ".indexer." not in name]
    assert indexer and others
    assert all(not torch.equal(states[1][name], states[2][name]) for name in indexer)
    assert all(torch.equal(states[1][name], states[2][name]) for name in others)  # frozen, biases included
    changed = [name for name in others if not torch.equal(states[2][name], states[3][name])]
    assert any(".attn.wq_b." in name for name in changed) and any(".experts." in name for name in changed)
    assert all(not torch.equal(states[2][name], states[3][name]) for name in indexer)
    losses = [r["train/indexer_loss"] for r in records]
    assert len(losses) == 4 and all(0 < loss < float("inf") for loss in losses)


def test_a_run_stopped_in_the_warm_up_resumes_across_the_stage_change(uninterrupted, tmp_path, monkeypatch):
    ref_records, ref_state, _ = uninterrupted
    with stopped_after_step(monkeypatch, 2):
        run(SETTINGS, 1, tmp_path)
    # step 1's save is published once step 2's loss is finite, step 2's not yet: the run resumes in the warm-up
    assert [s for s, _ in published_checkpoints(tmp_path / "checkpoints")] == [1]
    records, state = run(SETTINGS, 1, tmp_path)
    fields = ("step", "train/loss", "train/grad_norm", "train/indexer_loss")
    assert [[r[f] for f in fields] for r in records] == [[r[f] for f in fields] for r in ref_records]
    for name in ref_state:
        assert torch.equal(state[name], ref_state[name]), name


def test_a_warm_up_without_sparse_attention_is_refused():
    with pytest.raises(ConfigError, match=r"train.indexer_warmup_steps=5 warms up sparse attention's indexer"):
        load_config("moe-8x", ["train.indexer_warmup_steps=5"])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_started_optimizer_state_steps_as_a_fresh_one(optimizer):
    from moe.transformer import MoETransformer
    from training.indexer_stages import start_optimizer_state
    from training.optim import build_optimizer

    config = load_config("moe-8x", ["model.d_model=16", "model.n_heads=2", "model.n_kv_heads=null",
                                    "model.n_layers=1", "model.ffn_hidden=16", "moe.expert_hidden=8",
                                    f"train.optimizer={optimizer}", "train.weight_decay=0.1"])
    torch.manual_seed(0)
    models = [MoETransformer(config.model, config.moe) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [build_optimizer(model, config.train) for model in models]
    start_optimizer_state(optimizers[1])
    assert torch.equal(models[0].output.weight, models[1].output.weight)  # the start moved nothing
    for _ in range(2):
        for model, opt in zip(models, optimizers, strict=True):
            for param in model.parameters():
                param.grad = torch.full_like(param, 0.01)
            opt.step()
    for first, second in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(first, second)


def test_glm_5_shared_selection_layers_train_through_both_stages(tmp_path):
    """Layer 1 shares layer 0's selection (no indexer of its own): the warm-up freezes it whole, the sparse stage
    (the top 2 of 32 keys: the gathered kernel) trains it; the indexer loss is layer 0's."""
    records, state = run([*SETTINGS, "model.indexer_types=[full,shared]", "model.index_topk=2", "train.steps=3"], 1,
                         tmp_path)
    assert any("layers.0.attn.indexer." in name for name in state)
    assert not any("layers.1.attn.indexer." in name for name in state)
    losses = [r["train/indexer_loss"] for r in records]
    assert len(losses) == 3 and all(0 < loss < float("inf") for loss in losses)


# DeepSeek-V4's attention: a sliding layer, a heavily compressed one and a compressed sparse one whose indexer keeps
# the top 4 of up to 16 entries (of 2 positions each)
DEEPSEEK_V4_ATTENTION = [
    "model.n_layers=3", "model.n_kv_heads=null", "model.head_dim=8", "model.rotary_dim=4", "model.q_lora_rank=12",
    "model.sliding_window=8", "model.layer_types=[sliding_attention,heavily_compressed_attention,"
    "compressed_sparse_attention]", "model.index_topk=4", "model.index_n_heads=4", "model.index_head_dim=8",
    "model.compressed_attention.csa_rate=2", "model.compressed_attention.hca_rate=4",
    "model.compressed_attention.o_groups=2", "model.compressed_attention.o_lora_rank=8"]


def test_deepseek_v4_compressed_sparse_indexer_trains_through_both_stages(tmp_path):
    """V4's CSA indexer (its own compressor included) learns alone in the warm-up, every weight after; the indexer
    loss is the CSA layer's."""
    records, _, states = run_recording_weights([*DEEPSEEK_V4_ATTENTION, "train.steps=3", "train.indexer_warmup_steps=2",
                                                "checkpoint.interval=1"], tmp_path)
    indexer = [name for name in states[1] if ".indexer." in name]
    others = [name for name in states[1] if ".indexer." not in name]
    assert {name.split(".indexer.")[0] for name in indexer} == {"layers.2.attn"}
    assert any(".indexer.compressor." in name for name in indexer)
    assert all(not torch.equal(states[1][name], states[2][name]) for name in indexer)
    assert all(torch.equal(states[1][name], states[2][name]) for name in others)  # frozen in the warm-up
    changed = [name for name in others if not torch.equal(states[2][name], states[3][name])]
    assert any(".attn.compressor." in name for name in changed) and any(".experts." in name for name in changed)
    assert all(not torch.equal(states[2][name], states[3][name]) for name in indexer)
    losses = [r["train/indexer_loss"] for r in records]
    assert len(losses) == 3 and all(0 < loss < float("inf") for loss in losses)


def test_a_warm_up_of_deepseek_v4_without_compressed_sparse_layers_is_refused():
    layers = "model.layer_types=[sliding_attention,heavily_compressed_attention,heavily_compressed_attention]"
    with pytest.raises(ConfigError, match=r"train.indexer_warmup_steps=5 warms up sparse attention's indexer"):
        load_config("moe-8x", [*DEEPSEEK_V4_ATTENTION, layers, "train.indexer_warmup_steps=5"])
