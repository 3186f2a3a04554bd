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
