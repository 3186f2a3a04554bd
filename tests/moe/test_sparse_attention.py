"""Sparse latent attention (DeepSeek Sparse Attention) against two references: ``transformers``' DeepseekV32Attention
with our weights copied in (its main rotary rows in DeepSeek's interleaved order, a permutation the Hugging Face
import applies), and a naive dense attention under an explicit top-k mask written here. The sequence is longer than
the indexer's k, so the selection binds."""

import pytest
import torch

from config.errors import ConfigError
from config.model import ModelConfig
from config.run import load_config
from interop.hf_deepseek_v3 import interleaved_rows
from moe.attention import SparseLatentAttention, build_attention
from moe.attention import kernel as kernels
from moe.attention.kernel import GATHERED, SPARSE, choose_kernel
from moe.attention.sparse_latent import indexer_loss
from moe.kv_cache import LayerCache
from moe.rope import rope_tables

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf_v32  # noqa: E402

DSA = dict(d_model=32, n_heads=4, q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
           v_head_dim=5, seq_len=24, rope_theta=500.0, index_topk=7, index_n_heads=8, index_head_dim=8)
HF_NAMES = {"wq_a": "q_a_proj", "q_latent_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa",
            "kv_latent_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj", "indexer.wq": "indexer.wq_b",
            "indexer.wk": "indexer.wk", "indexer.k_norm": "indexer.k_norm",
            "indexer.head_weights": "indexer.weights_proj"}


def sparse_attention(seed: int = 0, **settings) -> tuple[ModelConfig, SparseLatentAttention]:
    torch.manual_seed(seed)
    model = ModelConfig(**{**DSA, **settings})
    model.validate()
    ours = build_attention(model, model.layer(0))
    for name, param in ours.named_parameters():
        with torch.no_grad():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm.weight" in name else torch.randn_like(param) * 0.3)
    return model, ours


def to_hf(model: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors by name (weights or their gradients) in DeepseekV32Attention's names, the main rotary rows
    interleaved as DeepSeek's are."""
    qk = model.qk_nope_head_dim + model.qk_rope_head_dim
    to_theirs = {"wq_b": interleaved_rows(qk, model.qk_rope_head_dim, model.n_heads),
                 "wkv_a": interleaved_rows(model.kv_lora_rank + model.qk_rope_head_dim, model.qk_rope_head_dim, 1)}
    out = {}
    for key, value in state.items():
        module, param = key.rsplit(".", 1)
        if module in to_theirs:  # ours = theirs[rows], so theirs = ours[argsort(rows)]
            value = value[torch.tensor(to_theirs[module]).argsort()]
        out[f"{HF_NAMES[module]}.{param}"] = value
    return out


def hf_attention(model: ModelConfig, ours: SparseLatentAttention):
    config = transformers.DeepseekV32Config(
        hidden_size=model.d_model, num_attention_heads=model.n_heads, num_key_value_heads=model.n_heads,
        q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim, index_topk=model.index_topk,
        index_n_heads=model.index_n_heads, index_head_dim=model.index_head_dim, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta}, vocab_size=16, num_hidden_layers=1)
    config._attn_implementation = "eager"
    theirs = hf_v32.DeepseekV32Attention(config, layer_idx=0).eval()
    theirs.load_state_dict(to_hf(model, ours.state_dict()))
    return theirs, hf_v32.DeepseekV32RotaryEmbedding(config)


# top 7 of 24 keys: the masked kernel (``sparse``); top 3 of 48: each query's keys gathered (``gathered``)
KERNELS = pytest.mark.parametrize("settings, kernel", [(dict(index_topk=7), SPARSE),
                                                      (dict(index_topk=3, seq_len=48), GATHERED)])


@KERNELS
def test_sparse_attention_matches_transformers_forward_and_gradients(settings, kernel):
    model, ours = sparse_attention(**settings)
    assert choose_kernel(model.seq_len, selected=model.index_topk, keys=model.seq_len) == kernel
    ours.eval()
    theirs, rotary = hf_attention(model, ours)
    x = torch.randn(2, model.seq_len, model.d_model)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    positions = torch.arange(model.seq_len)[None].expand(2, -1)
    mask = torch.full((model.seq_len, model.seq_len), float("-inf")).triu(1)[None, None].expand(2, 1, -1, -1)
    expected, _ = theirs(x_theirs, rotary(x_theirs, positions), mask, position_ids=positions)
    cos, sin = rope_tables(model)
    got = ours(x_ours, cos, sin)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    weights = torch.randn_like(got)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=0, atol=1e-5)
    theirs_params = dict(theirs.named_parameters())
    ours_grads = {name: torch.zeros_like(param) if param.grad is None else param.grad
                  for name, param in ours.named_parameters()}  # the indexer's: none, as transformers' (no_grad)
    for name, grad in to_hf(model, ours_grads).items():
        expected_grad = theirs_params[name].grad
        torch.testing.assert_close(grad, torch.zeros_like(grad) if expected_grad is None else expected_grad,
                                   rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")  # gradients of ~30


def naive_sparse_attention(ours: SparseLatentAttention, model: ModelConfig, x: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                       torch.Tensor]:
    """The layer written out: every head's dense scores under an explicit mask of each query's top-k index scores
    among its visible keys (index scores summed head by head); -> the output and the [B, S, S] selection."""
    batch, seq, _ = x.shape
    n, r, v, c = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim, model.kv_lora_rank
    cos, sin = (table[:seq] for table in rope_tables(model))

    def rope(t):  # pairs (i, i + r/2) of t [..., S, r]
        a, b = t.chunk(2, dim=-1)
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    def rms(t, weight, eps=1e-6):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight

    latent_q = rms(x @ ours.wq_a.weight.T, ours.q_latent_norm.weight)
    q = (latent_q @ ours.wq_b.weight.T).view(batch, seq, -1, n + r).transpose(1, 2)
    q = torch.cat((q[..., :n], rope(q[..., n:])), dim=-1)
    kv_a = x @ ours.wkv_a.weight.T
    latent, k_rope = rms(kv_a[..., :c], ours.kv_latent_norm.weight), rope(kv_a[..., c:])
    kv = (latent @ ours.wkv_b.weight.T).view(batch, seq, -1, n + v).transpose(1, 2)
    k = torch.cat((kv[..., :n], k_rope[:, None].expand(-1, model.n_heads, -1, -1)), dim=-1)
    indexer, hi, di = ours.indexer, model.index_n_heads, model.index_head_dim
    index_q = (latent_q @ indexer.wq.weight.T).view(batch, seq, hi, di)
    index_q = torch.cat((rope(index_q[..., :r].transpose(1, 2)).transpose(1, 2), index_q[..., r:]), dim=-1)
    index_k = torch.nn.functional.layer_norm(x @ indexer.wk.weight.T, (di,), indexer.k_norm.weight,
                                             indexer.k_norm.bias, 1e-6)
    index_k = torch.cat((rope(index_k[..., :r]), index_k[..., r:]), dim=-1)
    head_weights = x @ indexer.head_weights.weight.T
    index = sum(head_weights[..., j, None] * hi ** -0.5
                * torch.relu(index_q[:, :, j] @ index_k.transpose(1, 2) * di ** -0.5) for j in range(hi))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    order = index.masked_fill(~causal, float("-inf")).argsort(dim=-1, descending=True)
    selected = torch.zeros(batch, seq, seq, dtype=torch.bool).scatter(-1, order[..., :model.index_topk], True)
    allowed = (selected & causal)[:, None]
    scores = (q @ k.transpose(-1, -2)) * (n + r) ** -0.5
    out = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ kv[..., n:]
    return out.transpose(1, 2).reshape(batch, seq, -1) @ ours.wo.weight.T, selected & causal


@KERNELS
def test_sparse_attention_matches_naive_top_k_attention_and_the_selection_binds(settings, kernel):
    model, ours = sparse_attention(seed=1, **settings)
    assert choose_kernel(model.seq_len, selected=model.index_topk, keys=model.seq_len) == kernel
    ours.eval()
    x = torch.randn(2, model.seq_len, model.d_model)
    expected, selected = naive_sparse_attention(ours, model, x)
    torch.testing.assert_close(ours(x, *rope_tables(model)), expected, rtol=0, atol=1e-5)
    causal = torch.ones(model.seq_len, model.seq_len, dtype=torch.bool).tril()
    assert (selected.sum(-1) == causal.sum(-1).clamp(max=model.index_topk)).all()  # k keys, or all the visible
    assert (selected != causal).any()  # some query sees more than k keys: the top-k left some out
    dense_model = ModelConfig(**{**DSA, "seq_len": model.seq_len, "index_topk": None, "index_n_heads": None,
                                 "index_head_dim": None})
    dense = build_attention(dense_model, dense_model.layer(0)).eval()
    dense.load_state_dict({k: v for k, v in ours.state_dict().items() if not k.startswith("indexer.")})
    assert (dense(x, *rope_tables(model)) - expected).abs().max() > 1e-3  # sparse is not dense here


def test_gathered_kernel_equals_the_masked_kernel_in_training(monkeypatch):
    """The same layer and batch through both sparse kernels (the masked one forced by a ratio no sequence
    reaches): output, every gradient and the indexer's loss within fp32 1e-5, in both training stages' sparse
    one and with the selection binding for most queries."""
    model, ours = sparse_attention(seed=6, index_topk=3, seq_len=48)
    assert choose_kernel(model.seq_len, selected=model.index_topk, keys=model.seq_len) == GATHERED
    ours.train()
    x = torch.randn(2, model.seq_len, model.d_model)
    weights = torch.randn(2, model.seq_len, model.d_model)
    results = []
    for ratio in (kernels.GATHER_RATIO, 10 ** 6):
        monkeypatch.setattr(kernels, "GATHER_RATIO", ratio)
        ours.zero_grad()
        x_in = x.clone().requires_grad_()
        out = ours(x_in, *rope_tables(model))
        (out * weights).sum().backward()
        results.append((out, ours.last_indexer_loss, x_in.grad,
                        {name: p.grad.clone() for name, p in ours.named_parameters()}))
    (out, loss, grad, params), (out_m, loss_m, grad_m, params_m) = results
    torch.testing.assert_close(out, out_m, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, loss_m, rtol=0, atol=1e-5)
    torch.testing.assert_close(grad, grad_m, rtol=0, atol=1e-5)
    for name in params:
        torch.testing.assert_close(params[name], params_m[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_generation_with_the_indexer_key_cache_equals_the_whole_forward():
    model, ours = sparse_attention(seed=2)
    ours.eval()
    x = torch.randn(1, model.seq_len, model.d_model)
    cos, sin = rope_tables(model)
    whole = ours(x, cos, sin)
    cache = LayerCache()
    steps = [ours(x[:, :10], cos, sin, cache)] + [ours(x[:, i:i + 1], cos, sin, cache)
                                                   for i in range(10, model.seq_len)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=0, atol=1e-5)
    assert cache.index_keys.shape == (1, model.seq_len, model.index_head_dim)


def naive_kl(scores: torch.Tensor, attention: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Sum over each query's keys of p log(p / softmax(I)), p the attention L1-normalised, then the mean."""
    total = []
    for b in range(scores.shape[0]):
        for t in range(scores.shape[1]):
            chosen = keys[b, t]
            p = attention[b, t, chosen] / attention[b, t, chosen].sum()
            log_q = torch.log_softmax(scores[b, t, chosen], dim=0)
            total.append((p * (p.log() - log_q)).sum())
    return torch.stack(total).mean()


def test_indexer_loss_is_the_published_kl_and_trains_the_indexer_alone():
    torch.manual_seed(3)
    scores, attention = torch.randn(2, 5, 5), torch.rand(2, 5, 5) + 0.1
    keys = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5) & (torch.rand(2, 5, 5) > 0.3)
    keys = keys | torch.eye(5, dtype=torch.bool)
    torch.testing.assert_close(indexer_loss(scores, attention, keys), naive_kl(scores, attention, keys))
    model, ours = sparse_attention(seed=4)
    x = torch.randn(2, model.seq_len, model.d_model)
    for dense_warmup in (True, False):
        ours.zero_grad()
        ours.train().dense_warmup = dense_warmup
        ours(x, *rope_tables(model)).sum().backward()  # the output's gradient and the indexer's loss
        assert ours.last_indexer_loss > 0
        main = [p.grad for name, p in ours.named_parameters() if not name.startswith("indexer.")]
        assert all(grad is not None for grad in main) and all(
            p.grad.abs().sum() > 0 for p in ours.indexer.parameters())
    ours.zero_grad()
    ours(x, *rope_tables(model)).detach().requires_grad_().sum().backward()  # no language-model path: no loss
    assert all(p.grad is None for p in ours.indexer.parameters())


def test_only_the_indexer_loss_reaches_the_indexer():
    """Without its loss (eval) the language-model gradient leaves the indexer untouched; with it, the indexer's
    gradient is the loss's alone: the same whatever the output's gradient."""
    model, ours = sparse_attention(seed=5)
    x = torch.randn(2, model.seq_len, model.d_model)
    ours.eval()
    ours(x, *rope_tables(model)).sum().backward()
    assert all(p.grad is None for p in ours.indexer.parameters())
    grads = []
    ours.train()
    for scale in (1.0, 3.0):
        ours.zero_grad()
        (ours(x, *rope_tables(model)) * scale).sum().backward()
        grads.append([p.grad.clone() for p in ours.indexer.parameters()])
    for first, second in zip(*grads, strict=True):
        torch.testing.assert_close(first, second)


@pytest.mark.parametrize("settings, message", [
    (dict(index_topk=8), r"sparse attention's indexer reads latent attention's query latent"),
    (dict(DSA, q_lora_rank=None), r"sparse attention's indexer reads latent attention's query latent"),
    (dict(DSA, index_n_heads=0), r"model.index_n_heads=0: sparse attention \(model.index_topk set\) needs"),
    (dict(DSA, index_head_dim=2), r"model.index_head_dim=2 must hold the indexer's rotary channels"),
    (dict(DSA, index_topk=None), r"model.index_n_heads is a sparse-attention setting: it needs model.index_topk"),
    (dict(DSA, n_layers=2, indexer_types=["shared", "full"]), r"model.indexer_types=\['shared', 'full'\]: one "
                                                              r"'full' or 'shared' per layer \(2\), the first 'full'"),
    (dict(DSA, n_layers=2, indexer_types=["full"]), r"model.indexer_types=\['full'\]: one 'full' or 'shared'"),
])
def test_impossible_sparse_attention_settings_are_refused_by_name(settings, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**settings).validate()



def test_shared_selection_layers_are_refused_under_pipeline_parallelism():
    with pytest.raises(ConfigError, match=r"model.indexer_types with 'shared' layers under parallel.pp=2"):
        load_config("deepseek-v3.2", ["model.n_layers=4", "model.indexer_types=[full,shared,full,shared]",
                                      "parallel.pp=2"])


def test_the_indexer_loss_of_bf16_scores_is_the_fp32_kl():
    """Under bf16 autocast the indexer's scores are bf16; the KL is taken in fp32 from them, so a near-perfect
    indexer's small loss keeps its value (a bf16 log-softmax rounded it below zero for about half of such batches)."""
    torch.manual_seed(7)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    logits = torch.randn(2, 64, 64) * 2
    attention = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)
    scores = (logits + 0.02 * torch.randn_like(logits)).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = indexer_loss(scores, attention, causal)
    torch.testing.assert_close(got, naive_kl(scores.float(), attention, causal.expand(2, 64, 64)))
    assert got > 0
