"""Router selection, the balancing terms against their formulas, and their gradient injection."""

import math

import pytest
import torch

from config.model import MoEConfig
from moe.init import initialize
from moe.losses import attach_loss, load_balancing_loss, z_loss
from moe.router import TopKRouter


def make_router(**overrides) -> TopKRouter:
    config = MoEConfig(**{"num_experts": 4, "top_k": 2, **overrides})
    router = TopKRouter(3, config)
    torch.manual_seed(0)
    torch.nn.init.normal_(router.gate)
    return router


def test_topk_selection_and_renormalisation():
    router = make_router()
    x = torch.randn(5, 3)
    out = router(x)
    probs = torch.softmax(x @ router.gate.detach().t(), dim=-1)
    expected_ids = probs.argsort(dim=-1, descending=True)[:, :2]
    assert torch.equal(out.expert_ids, expected_ids)
    chosen = probs.gather(1, expected_ids)
    torch.testing.assert_close(out.weights, chosen / chosen.sum(-1, keepdim=True))
    torch.testing.assert_close(out.weights.sum(-1), torch.ones(5))


def test_without_renormalisation_weights_are_raw_probabilities():
    router = make_router(renormalize=False, top_k=3)
    x = torch.randn(6, 3)
    out = router(x)
    torch.testing.assert_close(out.weights, out.probs.gather(1, out.expert_ids))
    assert (out.weights.sum(-1) < 1).all()


def test_sigmoid_scores_and_top_k_equal_to_num_experts():
    router = make_router(score_func="sigmoid", top_k=4)
    x = torch.randn(4, 3)
    out = router(x)
    assert torch.equal(out.expert_ids.sort(-1).values, torch.arange(4).expand(4, 4))
    scores = torch.sigmoid(x @ router.gate.detach().t())
    torch.testing.assert_close(out.probs, scores / scores.sum(-1, keepdim=True))


def test_router_runs_in_fp32_under_bf16_autocast():
    router = make_router()
    x = torch.randn(8, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router(x.bfloat16())
    assert out.logits.dtype == torch.float32 and out.weights.dtype == torch.float32


def test_expert_bias_changes_selection_but_not_weights():
    router = make_router(bias_update_rate=0.1, renormalize=False)
    x = torch.randn(6, 3)
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    out = router(x)
    assert (out.expert_ids == 3).any(dim=1).all()  # the bias forces expert 3 into every top-2
    torch.testing.assert_close(out.weights, out.probs.gather(1, out.expert_ids))  # raw scores, no bias


def test_update_bias_follows_the_sign_of_the_load_error():
    router = make_router(bias_update_rate=0.01)
    router.update_bias(torch.tensor([10, 2, 4, 4]))  # mean 5
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))


def test_force_balance_is_round_robin():
    router = make_router(force_balance=True)
    out = router(torch.randn(6, 3))
    assert out.expert_ids.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]]


def test_jitter_only_in_training():
    router = make_router(jitter_eps=0.5)
    x = torch.randn(16, 3)
    router.eval()
    torch.testing.assert_close(router(x).logits, router(x).logits)
    router.train()
    assert not torch.allclose(router(x).logits, router(x).logits)


def test_load_balancing_loss_hand_computed():
    # 4 tokens, 2 experts, top-1: expert 0 gets 3 of 4 assignments.
    probs = torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.7, 0.3], [0.2, 0.8]])
    ids = torch.tensor([[0], [0], [0], [1]])
    # f = [3/4, 1/4], P = [0.6, 0.4] -> 2 * (0.45 + 0.1) = 1.1
    torch.testing.assert_close(load_balancing_loss(probs, ids, 2), torch.tensor(1.1))
    # per sequence (2 sequences of 2): seq0 f=[1,0] P=[.75,.25] -> 1.5; seq1 f=[.5,.5] P=[.45,.55] -> 1.0
    torch.testing.assert_close(load_balancing_loss(probs, ids, 2, num_sequences=2), torch.tensor(1.25))


def test_load_balancing_loss_is_one_when_uniform():
    probs = torch.full((8, 4), 0.25)
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    torch.testing.assert_close(load_balancing_loss(probs, ids, 4), torch.tensor(1.0))


def test_z_loss_hand_computed():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0]])
    lse = [math.log(2.0), math.log(math.e + math.e**2)]
    torch.testing.assert_close(z_loss(logits), torch.tensor((lse[0] ** 2 + lse[1] ** 2) / 2))


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_attached_loss_gradient_equals_adding_it_to_the_objective(scale):
    w = torch.randn(3, requires_grad=True)
    out = w * 2.0
    aux = (w**2).sum()
    attach_loss(out, aux, scale).sum().backward()
    expected = torch.full((3,), 2.0) + scale * 2 * w.detach()
    torch.testing.assert_close(w.grad, expected)


def test_balancing_gradients_reach_the_gate_without_the_caller():
    """MoELayer output's backward alone must give the gate the aux/z-loss gradient."""
    from moe.layer import MoELayer

    torch.manual_seed(1)
    config = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, capacity_factor=None,
                       aux_loss_coef=0.5, z_loss_coef=0.1)
    layer = MoELayer(6, config)
    initialize(layer, 0, 0.5, 0.5)
    x = torch.randn(2, 5, 6)
    out = layer(x)
    (out * 0).sum().backward()  # the LM objective contributes nothing; only the injected losses remain
    assert layer.router.gate.grad is not None and layer.router.gate.grad.abs().sum() > 0

    # and the gradient equals that of coef * loss computed by hand
    gate = layer.router.gate.detach().clone().requires_grad_(True)
    logits = x.reshape(-1, 6) @ gate.t()
    probs = torch.softmax(logits, -1)
    ids = probs.topk(2, dim=-1).indices
    expected_loss = 0.5 * load_balancing_loss(probs, ids, 4) + 0.1 * torch.logsumexp(logits, -1).square().mean()
    expected_loss.backward()
    torch.testing.assert_close(layer.router.gate.grad, gate.grad)


def reference_group_limited(scores, bias, n_group, topk_group, top_k):
    """Per token, written from DeepSeek-V3's description: rank groups by the sum of their two best biased
    scores, keep the topk_group best, then the top_k biased scores among the kept groups' experts."""
    chosen = []
    per_group = scores.shape[1] // n_group
    for row in (scores + bias).tolist():
        groups = [row[g * per_group:(g + 1) * per_group] for g in range(n_group)]
        group_score = [sum(sorted(g, reverse=True)[:2]) for g in groups]
        kept = sorted(range(n_group), key=lambda g: -group_score[g])[:topk_group]
        candidates = [e for g in kept for e in range(g * per_group, (g + 1) * per_group)]
        chosen.append(sorted(sorted(candidates, key=lambda e: -row[e])[:top_k]))
    return chosen


@pytest.mark.parametrize("n_group, topk_group, top_k", [(4, 2, 3), (4, 1, 2), (2, 1, 3), (4, 3, 3), (8, 3, 3)])
def test_group_limited_selection_matches_a_per_token_reference(n_group, topk_group, top_k):
    router = make_router(num_experts=8, top_k=top_k, n_group=n_group, topk_group=topk_group,
                         score_func="sigmoid", routed_scaling_factor=2.5)
    router.expert_bias.copy_(torch.linspace(-0.3, 0.3, 8))
    x = torch.randn(64, 3)
    out = router(x)
    scores = torch.sigmoid(x @ router.gate.detach().t())
    expected = reference_group_limited(scores, router.expert_bias, n_group, topk_group, top_k)
    assert out.expert_ids.sort(-1).values.tolist() == expected
    # the limit excludes experts: plain top-k of the biased scores would have chosen others for some tokens;
    # except with groups of one expert, where the best topk_group groups hold the plain top-k (top_k <= topk_group)
    plain = (scores + router.expert_bias).topk(top_k, -1).indices.sort(-1).values.tolist()
    assert (plain == expected) == (n_group == 8)
    # weights: the unbiased scores of the chosen, renormalised, times the routed scaling factor
    chosen = scores.gather(1, out.expert_ids)
    torch.testing.assert_close(out.weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_the_correction_bias_selects_without_bias_updates():
    """An imported bias (DeepSeek-V3's e_score_correction_bias) steers selection even with balancing off."""
    router = make_router(score_func="sigmoid")
    assert router.bias_update_rate == 0
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    assert (router(torch.randn(6, 3)).expert_ids == 3).any(dim=1).all()


def test_group_limited_routing_stays_unbiased_in_its_gradient():
    """The gate's gradient flows only through the chosen raw scores: the same as routing on fixed ids."""
    router = make_router(num_experts=8, top_k=2, n_group=4, topk_group=2, score_func="sigmoid",
                         routed_scaling_factor=2.0)
    x = torch.randn(16, 3)
    out = router(x)
    out.weights.square().sum().backward()
    gate = router.gate.detach().clone().requires_grad_(True)
    chosen = torch.sigmoid(x @ gate.t()).gather(1, out.expert_ids)
    (2.0 * chosen / chosen.sum(-1, keepdim=True)).square().sum().backward()
    torch.testing.assert_close(router.gate.grad, gate.grad)


@pytest.mark.parametrize("settings, message", [
    (dict(n_group=3), r"moe.n_group=3 must divide moe.num_experts=8 into equal groups; valid: \[1, 2, 4, 8\]"),
    (dict(n_group=4, topk_group=5), r"moe.topk_group=5 must be between 1 and moe.n_group=4"),
    (dict(n_group=4, topk_group=1, top_k=3), r"moe.top_k=3 is more experts than moe.topk_group=1 groups of 2 "
                                             r"hold \(2\); valid: top_k <= 2, or raise moe.topk_group to at least 2"),
    (dict(routed_scaling_factor=0.0), r"moe.routed_scaling_factor must be positive, got 0.0"),
])
def test_impossible_group_routing_is_refused_by_name(settings, message):
    from config.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        MoEConfig(**{"num_experts": 8, "top_k": 2, **settings}).validate()
