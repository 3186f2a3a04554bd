"""Context parallelism's own checks: the cut of a sequence, one forward and backward against one process, refusals.

The parity rows (``test_parity.py``) train under cp and match one process; they would match too if every rank
silently computed the whole sequence. Here each rank's logits are checked to be exactly its positions' rows of the
one-process logits, from a model that was given only those positions, so the exchange in attention is what makes
them right.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from config.errors import ConfigError
from config.run import load_config
from moe.documents import document_ids
from moe.sequence_shards import SequenceShards, _ChunkAttention
from moe.transformer import MoETransformer
from parallel.context import apply_context_parallel
from parallel.resolve import resolve_layout
from tests.parallel.parity import GPT_OSS, TINY
from tests.spawn import spawn

LATENT = ["model.kv_lora_rank=16", "model.q_lora_rank=12", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
          "model.v_head_dim=8", "moe.score_func=sigmoid", "moe.aux_loss_scope=sequence"]
MODELS = {  # grouped-query attention; GPT-OSS's sinks and sliding window (the blocked path in one process); MLA
    "gqa": ["model.n_kv_heads=2"],
    "gpt-oss": GPT_OSS,
    "latent": LATENT,
}
END = 3  # the token that ends a document in the masked case


def test_each_rank_holds_one_chunk_from_each_end_and_the_same_causal_work():
    seq, cp = 16, 4
    shards = [SequenceShards(cp, rank) for rank in range(cp)]
    assert shards[0].positions(seq).tolist() == [0, 1, 14, 15]
    assert shards[3].positions(seq).tolist() == [6, 7, 8, 9]
    assert sorted(torch.cat([s.positions(seq) for s in shards]).tolist()) == list(range(seq))
    assert shards[1].key_positions(seq).tolist() == torch.cat([s.positions(seq) for s in shards]).tolist()
    assert len({int((s.positions(seq) + 1).sum()) for s in shards}) == 1  # causal scores per rank: all equal
    batch = torch.arange(2 * seq).view(2, seq)
    assert shards[2].shard(batch).tolist() == [[4, 5, 10, 11], [20, 21, 26, 27]]
    with pytest.raises(ValueError, match="does not split into 2 x cp = 8 equal chunks"):
        shards[0].positions(12)


@pytest.mark.parametrize("kv_heads, start", [(4, 0), (4, 12), (2, 12)])
def test_a_chunk_attends_as_the_causal_mask_says_without_one(kv_heads, start):
    """The CPU path of ``causal_attention``: a chunk of queries over the keys before it and its own, two flash
    calls merged by their log-sum-exps, against one SDPA under the lower-right causal mask, forward and backward."""
    chunk, generator = 6, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, length, 8, generator=generator, requires_grad=True)
               for heads, length in ((4, chunk), (kv_heads, start + chunk), (kv_heads, start + chunk)))
    grad = torch.randn(2, 4, chunk, 8, generator=generator)
    _ChunkAttention.apply(q, k, v, start, 0.3).backward(grad)
    got = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    mask = torch.arange(start + chunk)[None, :] <= torch.arange(start, start + chunk)[:, None]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=kv_heads != 4)
    expected.backward(grad)
    torch.testing.assert_close(_ChunkAttention.apply(q, k, v, start, 0.3), expected, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(got, (q.grad, k.grad, v.grad), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def _config(name: str):
    return load_config("moe-8x", [*TINY, "moe.capacity_factor=null", "model.n_layers=2", *MODELS[name]])


def _tokens(config, masked: bool):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, config.model.vocab_size, (2, config.model.seq_len), generator=generator)
    if masked:  # documents ending at a few places, so the mask matters
        tokens[:, [3, 9, 20, 26]] = END
    return tokens


def _loss_and_grads(model: MoETransformer, tokens: torch.Tensor, documents, weights: torch.Tensor):
    """The mean over this model's positions of a weighted sum of its logits, its logits, and every gradient."""
    logits = model(tokens, documents=documents)
    loss = (logits * weights).sum() / logits[..., 0].numel()
    loss.backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _compare_with_one_process(rank: int, name: str, masked: bool) -> None:
    config = _config(name)
    tokens = _tokens(config, masked)
    documents = document_ids(tokens, END) if masked else None
    weights = torch.randn(*tokens.shape, config.model.vocab_size, generator=torch.Generator().manual_seed(2))
    reference = MoETransformer(config.model, config.moe, seed=0)
    ref_logits, ref_grads = _loss_and_grads(reference, tokens, documents, weights)

    model = MoETransformer(config.model, config.moe, seed=0)
    apply_context_parallel(model, dist.group.WORLD, rank, 2)
    shards = model.sequence_shards
    logits, grads = _loss_and_grads(model, shards.shard(tokens), documents, shards.shard(weights))
    assert logits.shape[1] == config.model.seq_len // 2  # this rank's positions only
    torch.testing.assert_close(logits, shards.shard(ref_logits), rtol=1e-5, atol=1e-5)
    # each rank's loss is the mean over its half: the mean of the two ranks' gradients is the whole mean's
    for param, grad in grads.items():
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / 2, ref_grads[param], rtol=1e-4, atol=1e-6, msg=param)


def _compare_each_model(rank: int) -> None:
    for name, masked in [("gqa", False), ("gpt-oss", True), ("latent", True), ("latent", False)]:
        _compare_with_one_process(rank, name, masked)


def test_a_rank_computes_its_positions_of_the_one_process_forward_and_backward():
    """Grouped-query attention with the plain causal mask; GPT-OSS's sinks and sliding window (in one process the
    blocked path, here the masked one) over packed documents; latent attention with a query bottleneck over packed
    documents, its balancing loss per sequence. One spawn for the three: the processes cost more than the models."""
    spawn(_compare_each_model, 2)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=3", "train.global_batch_size=12", "moe.capacity_factor=null"],
     r"parallel.cp=3: model.seq_len=32 must split into 2 × cp = 6 equal chunks .*valid cp for this world of 12 "
     r"ranks: 1, 2, 4$"),
    (["parallel.cp=2", "moe.capacity_factor=1.25"], r"parallel.cp=2 with moe.capacity_factor=1.25: the capacity and "
                                                    r"the order of drops are a whole micro-batch's"),
    (["parallel.cp=2", "moe.capacity_factor=null", "model.mtp_depth=1"], r"parallel.cp=2 with model.mtp_depth=1"),
])
def test_what_context_parallelism_cannot_serve_is_refused_before_any_process(overrides, message):
    config = load_config("moe-8x", [*TINY, *overrides])
    with pytest.raises(ConfigError, match=message):
        resolve_layout(config, 12 if "train.global_batch_size=12" in overrides else 4)
