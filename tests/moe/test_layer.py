"""MoELayer against a naive per-token reference; grouped experts against a per-expert loop."""

import math

import pytest
import torch
import torch.nn.functional as F

from config.model import MoEConfig
from moe import experts as experts_module
from moe.experts import GroupedExperts
from moe.init import initialize
from moe.layer import MoELayer

D = 16


def naive_expert(x, w_in, w_gate, w_out, activation, biases=None, alpha=1.702, limit=7.0):
    """One expert on one token, written out: [D] -> [D]. ``biases``: (up, gate, down) of this expert, or None."""
    b_in, b_gate, b_out = biases if biases is not None else (0.0, 0.0, 0.0)
    up = x @ w_in + b_in
    if activation == "swiglu":
        hidden = F.silu(x @ w_gate + b_gate) * up
    elif activation == "clamped_swiglu":  # GPT-OSS, written out with min/max rather than clamp
        gate = torch.minimum(x @ w_gate + b_gate, torch.tensor(limit))
        up = torch.maximum(torch.minimum(up, torch.tensor(limit)), torch.tensor(-limit))
        hidden = (up + 1) * gate / (1 + torch.exp(-alpha * gate))
    else:
        hidden = F.gelu(up)
    return hidden @ w_out + b_out


def naive_moe(layer: MoELayer, x, params):
    """Per-token loop: softmax/sigmoid router, top-k, renormalise, weighted sum, shared experts, aux losses."""
    cfg = layer.config
    tokens = x.reshape(-1, D)
    outputs = []
    lb_probs, lb_ids, lses = [], [], []
    for t in range(tokens.shape[0]):
        logits = tokens[t] @ params["gate"].t() + params.get("gate_bias", 0.0)
        scores = torch.softmax(logits, -1) if cfg.score_func == "softmax" else torch.sigmoid(logits)
        if cfg.groups_per_token < cfg.n_group:  # only the experts of the best groups (two best scores each)
            per_group = cfg.num_experts // cfg.n_group
            groups = scores.view(cfg.n_group, per_group)
            best = groups.topk(2, -1).values.sum(-1).topk(cfg.groups_per_token).indices
            candidates = torch.cat([torch.arange(g * per_group, (g + 1) * per_group) for g in best.tolist()])
            ids = candidates[torch.topk(scores[candidates], cfg.top_k).indices]
        else:
            ids = torch.topk(scores, cfg.top_k).indices
        w = scores[ids]
        if cfg.renormalize:
            w = w / w.sum()
        w = w * cfg.routed_scaling_factor
        y = sum(
            w[j] * naive_expert(tokens[t], params["w_in"][e], params.get("w_gate", [None] * 99)[e],
                                params["w_out"][e], cfg.activation,
                                _expert_biases(params.get("biases_by_name", {}), e),
                                cfg.swiglu_alpha, cfg.swiglu_limit)
            for j, e in enumerate(ids.tolist())
        )
        if layer.shared_experts is not None:
            s = params["shared"]
            y = y + (F.silu(tokens[t] @ s[1].t()) * (tokens[t] @ s[0].t())) @ s[2].t()
        outputs.append(y)
        lb_probs.append(scores / scores.sum())
        lb_ids.append(ids)
        lses.append(torch.logsumexp(logits, -1))
    probs, ids = torch.stack(lb_probs), torch.stack(lb_ids)
    counts = torch.stack([(ids == e).sum() for e in range(cfg.num_experts)]).float()
    aux = cfg.num_experts * ((counts / ids.numel()) * probs.mean(0)).sum()
    z = torch.stack(lses).square().mean()
    return torch.stack(outputs).view_as(x), aux, z


def layer_params(layer):
    params = {"gate": layer.router.gate, "w_in": layer.experts.w_in, "w_out": layer.experts.w_out}
    if layer.experts.w_gate is not None:
        params["w_gate"] = layer.experts.w_gate
    if layer.router.gate_bias is not None:
        params["gate_bias"] = layer.router.gate_bias
    if layer.experts.in_bias is not None:
        params["biases_by_name"] = {name: p for name, p in layer.experts.named_parameters() if name.endswith("bias")}
    if layer.shared_experts is not None:
        s = layer.shared_experts
        params["shared"] = (s.w_in.weight, s.w_gate.weight, s.w_out.weight)
    return params


CASES = [
    dict(activation="swiglu", top_k=2),
    dict(activation="gelu", top_k=1),
    dict(activation="swiglu", top_k=3, score_func="sigmoid"),
    dict(activation="swiglu", top_k=2, num_shared_experts=1, renormalize=False),
    dict(activation="swiglu", top_k=2, score_func="sigmoid", n_group=3, topk_group=1, routed_scaling_factor=2.5,
         num_shared_experts=1, shared_expert_hidden=8),
    # GPT-OSS: biased router and experts, clamped SwiGLU (a low limit, so the clamps act at init std 0.3)
    dict(activation="clamped_swiglu", top_k=2, router_bias=True, expert_proj_bias=True, swiglu_limit=0.5),
    dict(activation="gelu", top_k=2, expert_proj_bias=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dropless_layer_matches_naive_reference(case):
    torch.manual_seed(0)
    config = MoEConfig(num_experts=6, expert_hidden=12, capacity_factor=None, aux_loss_coef=0.1,
                       z_loss_coef=0.01, **case)
    layer = MoELayer(D, config)
    initialize(layer, 0, 0.3, 0.3)
    with torch.no_grad():  # biases start at zero: draw them, so the test sees whether each is added
        for name, param in layer.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.3)
    x = torch.randn(2, 7, D, requires_grad=True)
    grad_out = torch.randn(2, 7, D)

    out = layer(x)
    (out * grad_out).sum().backward()
    got = {name: p.grad.clone() for name, p in layer.named_parameters()} | {"x": x.grad.clone()}

    layer.zero_grad()
    x_ref = x.detach().clone().requires_grad_(True)
    ref, aux, z = naive_moe(layer, x_ref, layer_params(layer))
    ((ref * grad_out).sum() + 0.1 * aux + 0.01 * z).backward()
    expected = {name: p.grad for name, p in layer.named_parameters()} | {"x": x_ref.grad}

    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert got.keys() == expected.keys()
    for name in got:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)
    stats = layer.last_stats
    torch.testing.assert_close(stats.aux_loss, aux.detach())
    assert int(stats.num_dropped) == 0 and int(stats.tokens_per_expert.sum()) == 14 * config.top_k


def test_fully_dropped_tokens_get_a_zero_routed_output():
    """A token whose every assignment is dropped gets a zero routed output."""
    torch.manual_seed(0)
    config = MoEConfig(num_experts=4, top_k=1, expert_hidden=8, capacity_factor=0.25, force_balance=False)
    layer = MoELayer(D, config)
    initialize(layer, 0, 0.3, 0.3)
    x = torch.randn(1, 16, D)
    out = layer(x).view(16, D)
    capacity = 1  # ceil(0.25 * 1 * 16 / 4)
    kept_rows = (out.abs().sum(-1) > 0).sum().item()
    assert kept_rows <= 4 * capacity
    assert int(layer.last_stats.num_dropped) == 16 - kept_rows


EXPERT_VARIANTS = [("swiglu", False), ("gelu", False), ("clamped_swiglu", True), ("gelu", True)]
LIMIT = 0.5  # the clamped SwiGLU's limit in these tests: low enough that the clamps act at init std 0.3


def _draw_biases(experts):
    """Biases start at zero: draw them, so a test sees whether each is added to its own expert's rows."""
    with torch.no_grad():
        for name, param in experts.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.3)


def _expert_biases(weights, e):
    """Expert ``e``'s (up, gate, down) biases from a name -> stacked tensor map, or None without biases."""
    if "in_bias" not in weights:
        return None
    return weights["in_bias"][e], weights["gate_bias"][e] if "gate_bias" in weights else 0.0, weights["out_bias"][e]


@pytest.mark.parametrize("activation, bias", EXPERT_VARIANTS)
@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_grouped_experts_equal_a_per_expert_loop(activation, bias, use_grouped_mm, monkeypatch):
    if not use_grouped_mm:
        monkeypatch.setattr(experts_module, "HAS_GROUPED_MM", False)  # the padded-bmm fallback
    torch.manual_seed(0)
    experts = GroupedExperts(5, D, 12, activation, bias=bias, swiglu_limit=LIMIT)
    initialize(experts, 0, 0.3, 0.3)
    _draw_biases(experts)
    counts = torch.tensor([3, 0, 7, 1, 5])  # an empty group included
    x = torch.randn(int(counts.sum()), D, requires_grad=True)
    grad = torch.randn(int(counts.sum()), D)
    out = experts(x, counts)
    (out * grad).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in experts.parameters()]

    experts.zero_grad()
    x_ref = x.detach().clone().requires_grad_(True)
    pieces, start = [], 0
    for e, n in enumerate(counts.tolist()):
        w_gate = experts.w_gate[e] if experts.w_gate is not None else None
        biases = _expert_biases(dict(experts.named_parameters()), e)
        pieces.append(torch.stack([naive_expert(x_ref[i], experts.w_in[e], w_gate, experts.w_out[e], activation,
                                                biases, limit=LIMIT)
                                   for i in range(start, start + n)]) if n else x_ref[:0])
        start += n
    ref = torch.cat(pieces)
    (ref * grad).sum().backward()
    expected = [x_ref.grad] + [p.grad for p in experts.parameters()]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_layer_close_to_fp32():
    torch.manual_seed(0)
    config = MoEConfig(num_experts=8, top_k=2, expert_hidden=32, capacity_factor=None)
    layer = MoELayer(D, config)
    initialize(layer, 0, 0.2, 0.2)
    x = torch.randn(2, 32, D)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("top_k, score_func", [(1, "softmax"), (2, "softmax"), (3, "sigmoid")])
def test_routing_stats_match_a_per_token_loop(top_k, score_func):
    """Entropy, top-1 probability, choice shares and co-selection counts against plain Python loops."""
    torch.manual_seed(0)
    config = MoEConfig(num_experts=5, top_k=top_k, expert_hidden=8, score_func=score_func, renormalize=False)
    layer = MoELayer(D, config)
    initialize(layer, 0, 0.5, 0.3)
    x = torch.randn(3, 6, D)
    layer(x)
    routed = layer.router(x.reshape(-1, D))
    stats = layer.last_stats

    tokens = routed.probs.shape[0]
    entropy = top1 = 0.0
    shares = [0.0] * top_k
    pairs = torch.zeros(5, 5, dtype=torch.int64)
    for t in range(tokens):
        p = routed.probs[t].tolist()
        entropy += -sum(q * math.log(q) for q in p if q > 0) / tokens
        top1 += max(p) / tokens
        w = routed.weights[t].tolist()
        for j in range(top_k):
            shares[j] += w[j] / sum(w) / tokens
        for a in routed.expert_ids[t].tolist():
            for b in routed.expert_ids[t].tolist():
                pairs[a, b] += 1
    assert float(stats.entropy) == pytest.approx(entropy, rel=1e-5)
    assert float(stats.top1_prob) == pytest.approx(top1, rel=1e-5)
    assert stats.choice_share.tolist() == pytest.approx(shares, rel=1e-5)
    if top_k == 1:
        assert stats.coselection is None
    else:
        assert torch.equal(stats.coselection, pairs)
        assert torch.equal(stats.coselection.diagonal(), stats.tokens_per_expert)


def test_group_padding_layout_by_hand():
    padding = experts_module.GroupPadding(torch.tensor([3, 0, 17, 1]), 16)
    assert padding.padded_counts.tolist() == [16, 0, 32, 16]
    assert padding.destination.tolist() == [0, 1, 2] + list(range(16, 33)) + [48]
    assert padding.padding_rows.tolist() == list(range(3, 16)) + list(range(33, 48)) + list(range(49, 64))
    x = torch.arange(21.0).repeat_interleave(2).view(21, 2)
    padded = padding.pad(x)
    assert padded.shape == (64, 2)
    assert torch.equal(padded[padding.destination], x)
    assert int((padded != 0).any(1).sum()) == 20  # row 0 of x is zero itself; every padding row is zero
    assert torch.equal(padding.unpad(padded), x)


def test_group_padding_gradients():
    padding = experts_module.GroupPadding(torch.tensor([5, 2, 0, 9]), 4)
    x = torch.randn(16, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(int(padding.num_padded), 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(padding.pad, (x,))
    assert torch.autograd.gradcheck(padding.unpad, (y,))


def test_groups_padded_for_reduced_precision_on_cpu_only():
    assert experts_module.row_multiple_on("cpu", torch.bfloat16) == 16
    assert experts_module.row_multiple_on("cpu", torch.float32) == 1
    assert experts_module.row_multiple_on("cpu", torch.float64) == 1
    assert experts_module.row_multiple_on("cuda", torch.bfloat16) == 1
    assert experts_module.padded_rows([19, 0, 3, 21], 16) == 32 + 0 + 16 + 32


def _bf16_experts_grads(activation, bias, counts, monkeypatch, multiple):
    """Output and gradients (input's, then the weights') of bf16 experts with groups padded to ``multiple``."""
    monkeypatch.setattr(experts_module, "ONEDNN_GROUP_ROWS", multiple)
    torch.manual_seed(0)
    experts = GroupedExperts(len(counts), D, 12, activation, bias=bias, swiglu_limit=LIMIT)
    initialize(experts, 0, 0.3, 0.3)
    _draw_biases(experts)
    x = torch.randn(int(counts.sum()), D).bfloat16().requires_grad_(True)
    grad = torch.randn(int(counts.sum()), D).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = experts(x, counts)
    out.backward(grad)
    return experts, x, grad, [out.float(), x.grad.float()] + [p.grad for p in experts.parameters()]


@pytest.mark.parametrize("activation, bias", EXPERT_VARIANTS)
def test_padded_bf16_experts_equal_unpadded_and_a_per_expert_loop(activation, bias, monkeypatch):
    """bf16 on CPU pads the groups (``row_multiple_on``). Padding changes no result: outputs and every gradient
    equal the unpadded grouped GEMM's, and the per-expert loop's on the same bf16 values computed in fp32 (within
    the bf16 rounding of the experts' hidden activations, relative to each tensor's largest value)."""
    counts = torch.tensor([19, 0, 3, 21])  # none a multiple of 16, an empty group included
    experts, x, grad, got = _bf16_experts_grads(activation, bias, counts, monkeypatch, 16)
    unpadded = _bf16_experts_grads(activation, bias, counts, monkeypatch, 1)[3]
    for g, u in zip(got, unpadded, strict=True):
        torch.testing.assert_close(g, u, rtol=1e-3, atol=1e-3 * float(u.detach().abs().max()))

    weights = {n: p.detach().bfloat16().float().requires_grad_(True) for n, p in experts.named_parameters()}
    x_ref = x.detach().float().requires_grad_(True)
    pieces, start = [], 0
    for e, n in enumerate(counts.tolist()):
        w_gate = weights["w_gate"][e] if "w_gate" in weights else None
        pieces.append(torch.stack([naive_expert(x_ref[i], weights["w_in"][e], w_gate, weights["w_out"][e], activation,
                                                _expert_biases(weights, e), limit=LIMIT)
                                   for i in range(start, start + n)]) if n else x_ref[:0])
        start += n
    ref = torch.cat(pieces)
    ref.backward(grad.float())
    for g, e in zip(got, [ref, x_ref.grad] + list(w.grad for w in weights.values()), strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=2e-2 * float(e.detach().abs().max()))
