"""Pipeline stages: the cost-balanced split against brute force, the checks before init, and the cut stages
chained in one process against the whole model (outputs, gradients with the injected aux losses, names).

The schedules themselves run across processes in ``test_parity.py`` (pp layouts).
"""

import itertools
import random

import pytest
import torch

import train
from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from moe.accounting import block_flops_per_token
from moe.transformer import MoETransformer
from parallel.pipeline import balanced_split, check_pipeline, cut_stage, stage_layers


def brute_force_bottleneck(costs, num_stages, first_extra, last_extra):
    """The smallest costliest stage over every way to cut ``costs`` into contiguous non-empty stages."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), num_stages - 1):
        bounds = [0, *cuts, len(costs)]
        stage_costs = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        stage_costs[0] += first_extra
        stage_costs[-1] += last_extra
        best = min(best, max(stage_costs))
    return best


def test_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        stages = rng.randint(1, n)
        costs = [rng.choice([1.0, 2.0, 3.5, 7.0]) * rng.uniform(0.5, 1.5) for _ in range(n)]
        first, last = rng.choice([0.0, 2.0]), rng.choice([0.0, 5.0])
        split = balanced_split(costs, stages, first, last)
        # contiguous, non-empty, covering every layer once, in order
        assert [i for r in split for i in r] == list(range(n)) and all(len(r) for r in split)
        got = max(sum(costs[i] for i in r) + (first if k == 0 else 0) + (last if k == stages - 1 else 0)
                  for k, r in enumerate(split))
        assert got == pytest.approx(brute_force_bottleneck(costs, stages, first, last), rel=1e-12)


def test_split_by_hand():
    assert balanced_split([1, 1, 1, 1, 4], 2) == [range(0, 4), range(4, 5)]
    assert balanced_split([1, 1, 1, 1], 2, last_extra=2) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3"):
        balanced_split([1, 1], 3)


def test_moe_blocks_weigh_more_than_dense_blocks_in_the_split():
    # layers 0, 2, 4 dense, 1, 3, 5 MoE with top-4 of wide experts: costs alternate
    model = ModelConfig(d_model=32, n_layers=6, n_heads=4, seq_len=16, ffn_hidden=32, vocab_size=8, moe_every=2,
                        first_moe_layer=1)
    moe = MoEConfig(num_experts=8, top_k=4, expert_hidden=64)
    dense, sparse = (block_flops_per_token(model, moe, model.layer(i)) for i in (0, 1))
    assert sparse > 3 * dense
    split = stage_layers(model, moe, 3)
    assert [sum(model.is_moe_layer(i) for i in r) for r in split] == [1, 1, 1]


@pytest.mark.parametrize("pp, virtual, schedule, microbatches, message", [
    (2, 3, "interleaved_1f1b", 4, r"2 × parallel.pp_virtual_stages=3 = 6 pipeline stages, more than "
                                  r"model.n_layers=4.*use parallel.pp_virtual_stages=2"),
    (4, 2, "interleaved_1f1b", 4, r"8 pipeline stages, more than model.n_layers=4.*use parallel.pp_virtual_stages=1"),
    (5, 1, "1f1b", 8, r"5 pipeline stages, more than model.n_layers=4.*use parallel.pp=4 or fewer"),
    (2, 2, "1f1b", 4, r"parallel.pp_virtual_stages=2 needs parallel.pp_schedule=interleaved_1f1b"),
    (4, 1, "1f1b", 2, r"1f1b needs at least parallel.pp=4 micro-batches per step, got 2"),
    (2, 2, "interleaved_1f1b", 7, r"needs a multiple of 2 .*got 7"),
    (1, 2, "1f1b", 4, r"parallel.pp_virtual_stages=2 needs pipeline parallelism"),
    (2, 1, "zero_bubble", 4, r"parallel.pp_schedule='zero_bubble' is not a schedule; valid: gpipe, 1f1b"),
])
def test_impossible_pipelines_are_refused(pp, virtual, schedule, microbatches, message):
    with pytest.raises(ConfigError, match=message):
        check_pipeline(pp, ModelConfig(n_layers=4), schedule, virtual, microbatches)


def test_possible_pipelines_pass():
    check_pipeline(2, ModelConfig(n_layers=4), "interleaved_1f1b", 2, 4)
    check_pipeline(4, ModelConfig(n_layers=4), "interleaved_1f1b", 1, 3)  # fewer than pp: one round
    check_pipeline(2, ModelConfig(n_layers=2), "gpipe", 1, 1)
    with pytest.raises(ConfigError, match="model.tie_embeddings=true"):
        check_pipeline(2, ModelConfig(n_layers=2, tie_embeddings=True), "gpipe", 1, 1)


def test_train_refuses_a_pipeline_before_init(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")  # no RANK: nothing would join a job, but it must not get that far
    status = train.main(["--run-dir", str(tmp_path / "r"), "--set", "parallel.pp=2", "parallel.pp_virtual_stages=4",
                         "parallel.pp_schedule=interleaved_1f1b", "logging.wandb=disabled"])
    assert status == 2
    assert "8 pipeline stages, more than model.n_layers=4" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_stages_chained_match_the_whole_model_with_aux_losses():
    """Run the cut stages one after another in one process, as the schedule does across ranks.

    Backward is started per stage from the gradient the next stage hands back, so the aux losses
    of every stage's MoE layers must reach backward by themselves (none are passed along).
    """
    torch.manual_seed(0)
    model_config = ModelConfig(d_model=32, n_layers=4, n_heads=4, seq_len=16, ffn_hidden=48, moe_every=2)
    moe_config = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, aux_loss_coef=0.5, z_loss_coef=0.1)
    model = MoETransformer(model_config, moe_config)
    ranges = stage_layers(model_config, moe_config, 3)
    stages = [cut_stage(model, r, k == 0, k == len(ranges) - 1) for k, r in enumerate(ranges)]

    # names: the stages' state dicts together are the model's, each entry in exactly one stage
    merged = {}
    for stage in stages:
        assert not merged.keys() & stage.state_dict().keys()
        merged.update(stage.state_dict())
    assert merged.keys() == model.state_dict().keys()
    assert all(torch.equal(merged[k], v) for k, v in model.state_dict().items())
    # the model is left whole, and the stages own copies of their tensors
    assert list(model.layers) == ["0", "1", "2", "3"] and isinstance(model.output, torch.nn.Linear)
    model_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not any(p.untyped_storage().data_ptr() in model_storages for stage in stages for p in stage.parameters())

    tokens = torch.randint(0, model_config.vocab_size, (2, 16))
    targets = torch.randint(0, model_config.vocab_size, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()

    outputs, inputs, x = [], [], tokens
    for stage in stages:
        inputs.append(x)
        outputs.append(stage(x))
        x = outputs[-1].detach().requires_grad_()
    stage_loss = torch.nn.functional.cross_entropy(outputs[-1].flatten(0, 1), targets.flatten())
    torch.testing.assert_close(stage_loss, loss)
    stage_loss.backward()
    for k in range(len(stages) - 2, -1, -1):
        outputs[k].backward(inputs[k + 1].grad)

    grads = {name: p.grad for stage in stages for name, p in stage.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, msg=name)
    router = next(n for n in grads if n.endswith("router.gate"))
    assert grads[router].abs().sum() > 0


@pytest.mark.parametrize("streams", [1, 4])
def test_last_stage_runs_multi_token_prediction_with_a_copy_of_the_embedding(streams):
    """With ``model.mtp_depth`` the last stage holds the MTP module and a copy of the embedding under the same name
    and with the same values; given the token ids beside the hidden states it gives the whole model's logits and
    MTP losses, and the two embeddings' gradients add up to the whole model's (what ``PipelineModel.step``'s
    all-reduce makes of them). Every other parameter's gradient is the whole model's on the stage holding it. With
    hyper-connections (4 streams, DeepSeek-V4's MTP module) the streams cross the cut and feed the module there."""
    torch.manual_seed(0)
    model_config = ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16, ffn_hidden=48, moe_every=2,
                               mtp_depth=1, hc_mult=streams)
    moe_config = MoEConfig(num_experts=4, top_k=2, expert_hidden=32)
    model = MoETransformer(model_config, moe_config)
    first, last = (cut_stage(model, r, k == 0, k == 1) for k, r in enumerate(stage_layers(model_config, moe_config, 2)))
    assert first.mtp is None and isinstance(first.output, torch.nn.Identity)
    assert last.mtp is not None and torch.equal(last.tok_embeddings.weight, first.tok_embeddings.weight)
    shared = first.state_dict().keys() & last.state_dict().keys()
    assert shared == {"tok_embeddings.weight"}
    assert (first.state_dict().keys() | last.state_dict().keys()) == model.state_dict().keys()

    tokens = torch.randint(0, model_config.vocab_size, (2, 16))
    targets = torch.randint(0, model_config.vocab_size, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
    loss.backward()
    hidden = first(tokens)
    received = hidden.detach().requires_grad_()
    stage_loss = torch.nn.functional.cross_entropy(last(received, ids=tokens).flatten(0, 1), targets.flatten())
    torch.testing.assert_close(stage_loss, loss)
    torch.testing.assert_close(last.last_mtp_losses, model.last_mtp_losses)
    stage_loss.backward()
    hidden.backward(received.grad)

    embedding = first.tok_embeddings.weight.grad + last.tok_embeddings.weight.grad
    torch.testing.assert_close(embedding, model.tok_embeddings.weight.grad)
    assert last.tok_embeddings.weight.grad.abs().sum() > 0  # the copy's own share: the MTP module's lookups
    grads = {name: p.grad for stage in (first, last) for name, p in stage.named_parameters()}
    for name, param in model.named_parameters():
        if name != "tok_embeddings.weight":
            torch.testing.assert_close(grads[name], param.grad, msg=name)
    assert any(name.startswith("mtp.0.") and grad.abs().sum() > 0 for name, grad in grads.items())
