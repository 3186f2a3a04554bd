"""DeepSeek-V4's compressed sparse attention trains its lightning indexer as DeepSeek-V3.2's
(``moe/attention/compressed.py``): the loss is the KL between the attention's own distribution over the compressed
entries (each head's probabilities in the layer's softmax with its sink, summed over the heads, normalised over
the entries the loss covers) and the indexer's, against a naive reference to 1e-5 in fp32, over every visible entry
in the dense warm-up and the selected ones in the sparse stage; its gradient reaches the indexer (its own
compressor included) and nothing else, and the attention's gradient never reaches the indexer."""

import pytest
import torch

import moe.attention.compressed as compressed
from config.compressed_attention import CompressedAttentionConfig
from config.model import ModelConfig
from moe.attention import CompressedSparseAttention, build_attention
from moe.attention.compressor import visible_entries
from moe.rope import rope_tables

SEQ, RATE, TOPK = 24, 2, 3  # 12 entries, of which the later queries see up to 12: the top 3 bind
MODEL = ModelConfig(d_model=16, n_layers=1, n_heads=4, head_dim=8, rotary_dim=4, q_lora_rank=10, sliding_window=4,
                    layer_types=["compressed_sparse_attention"], seq_len=SEQ, norm_eps=1e-6, index_topk=TOPK,
                    index_n_heads=3, index_head_dim=6,
                    compressed_attention=CompressedAttentionConfig(csa_rate=RATE, hca_rate=4, o_groups=2,
                                                                   o_lora_rank=6))


def csa_layer(seed: int = 0) -> CompressedSparseAttention:
    """A CSA layer with random weights (norm weights near 1, position biases and sinks random too)."""
    MODEL.validate()
    torch.manual_seed(seed)
    layer = build_attention(MODEL, MODEL.layer(0))
    for name, param in layer.named_parameters():
        with torch.no_grad():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm.weight" in name else torch.randn_like(param) * 0.4)
    return layer.train()


def recorded_forward(layer: CompressedSparseAttention, x: torch.Tensor, monkeypatch) -> dict:
    """The layer's training forward, with what its kernel received and returned and its indexer's scores."""
    seen = {}
    kernel, scores = compressed.attend_under_mask, layer.indexer.scores

    def recording_kernel(q, k, v, scale, allowed, sinks):
        seen.update(q=q, k=k, scale=scale, allowed=allowed, sinks=sinks)
        seen["out"] = kernel(q, k, v, scale, allowed, sinks)
        return seen["out"]

    monkeypatch.setattr(compressed, "attend_under_mask", recording_kernel)
    monkeypatch.setattr(layer.indexer, "scores", lambda *args: seen.setdefault("scores", scores(*args)))
    cos, sin = rope_tables(MODEL)
    seen["output"] = layer(x, cos, sin)
    return seen


def naive_kl(seen: dict) -> torch.Tensor:
    """The indexer loss from the attention's own probabilities, query by query and head by head: each head's
    softmax over its allowed keys and its sink (checked to give the kernel's output), the entries' probabilities
    summed over the heads and normalised over the allowed entries, KL against the softmax of the indexer's scores
    there; the mean over every query (one that sees no entry adds 0)."""
    q, k, allowed, sinks = seen["q"].double(), seen["k"][:, 0].double(), seen["allowed"], seen["sinks"].double()
    batch, heads, queries, _ = q.shape
    entries = seen["scores"].shape[-1]
    allowed = allowed.expand(batch, 1, *allowed.shape[-2:])[:, 0] if allowed.dim() == 4 else allowed.expand(batch,
                                                                                                          *allowed.shape)
    total = torch.zeros((), dtype=torch.float64)
    for b in range(batch):
        for t in range(queries):
            keys = allowed[b, t].nonzero().squeeze(-1)
            target = torch.zeros(entries, dtype=torch.float64)
            for h in range(heads):
                logits = k[b, keys] @ q[b, h, t] * seen["scale"]
                weights = logits.exp() / (sinks[h].exp() + logits.exp().sum())
                torch.testing.assert_close(weights @ k[b, keys], seen["out"][b, h, t].double(), atol=1e-5, rtol=1e-5)
                for weight, key in zip(weights, keys.tolist(), strict=True):
                    if key >= k.shape[1] - entries:
                        target[key - (k.shape[1] - entries)] += weight
            chosen = allowed[b, t, -entries:]
            if not chosen.any():
                continue
            p = target[chosen] / target[chosen].sum()
            predicted = torch.softmax(seen["scores"][b, t, chosen].double(), dim=0)
            total += (p * (p.log() - predicted.log())).sum()
    return total / (batch * queries)


@pytest.mark.parametrize("dense_warmup", [True, False], ids=["dense warm-up", "sparse stage"])
def test_indexer_loss_is_the_kl_against_the_attention_over_the_entries(dense_warmup, monkeypatch):
    layer = csa_layer()
    layer.dense_warmup = dense_warmup
    x = torch.randn(2, SEQ, MODEL.d_model, generator=torch.Generator().manual_seed(1))
    seen = recorded_forward(layer, x, monkeypatch)
    visible = visible_entries(torch.arange(SEQ), SEQ // RATE, RATE)
    attended = seen["allowed"][..., -(SEQ // RATE):]  # the entries the attention sees
    if dense_warmup:  # every visible entry, as heavily compressed attention
        assert torch.equal(attended, visible)
    else:  # the indexer's top 3 of those, where there are more
        counts = attended.reshape(-1, *visible.shape).sum(-1)
        assert torch.equal(counts, visible.sum(-1).clamp(max=TOPK).expand_as(counts)) and (visible.sum(-1) > TOPK).any()
    assert layer.last_indexer_loss > 0
    torch.testing.assert_close(layer.last_indexer_loss.double(), naive_kl(seen), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dense_warmup", [True, False], ids=["dense warm-up", "sparse stage"])
def test_the_indexer_loss_reaches_the_indexer_alone_and_the_attention_loss_never_does(dense_warmup):
    """Backward of the output times 0 leaves the indexer loss's gradient alone: on every parameter of the indexer
    (its compressor's too) and on nothing else, the input included (its inputs are detached). Backward of the
    output's sum adds the attention's gradient, which the selection keeps from the indexer: its gradient is the
    same."""
    grads = []
    for weight in (0.0, 1.0):
        layer = csa_layer()
        layer.dense_warmup = dense_warmup
        x = torch.randn(2, SEQ, MODEL.d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
        cos, sin = rope_tables(MODEL)
        (layer(x, cos, sin) * weight).sum().backward()
        grads.append({name: param.grad for name, param in layer.named_parameters()})
        if weight == 0.0:
            indexer = [name for name in grads[0] if name.startswith("indexer.")]
            assert {name.split(".")[1] for name in indexer} == {"compressor", "wq", "head_weights"}
            assert all(grads[0][name] is not None and grads[0][name].any() for name in indexer), indexer
            assert all(grad is None or not grad.any() for name, grad in grads[0].items() if name not in indexer)
            assert x.grad is None or not x.grad.any()
    for name in indexer:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=0, rtol=0)
    assert any(grads[1][name].any() for name in grads[1] if name not in indexer)  # the attention's loss trains it


def test_outside_training_the_indexer_selects_and_learns_nothing():
    layer = csa_layer().eval()
    cos, sin = rope_tables(MODEL)
    layer(torch.randn(2, SEQ, MODEL.d_model), cos, sin).sum().backward()
    assert layer.last_indexer_loss is None
    assert all(param.grad is None for name, param in layer.named_parameters() if name.startswith("indexer."))
