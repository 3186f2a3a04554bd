"""Tensor parallelism: the row shares, the layout checks, and tp=2 models against one process on 2 gloo ranks.

The spawned test runs every check in one pair of processes: a small model (a dense block with GQA
attention, then an MoE block with a shared expert) parallelized with tp=2, with ep=2 folded over the
tp group, and with etp=2 (each expert's hidden dim split), must give the single-process logits,
gradients (gathered) and global gradient norm, in fp32, under full recompute, and under bf16 autocast
(looser tolerance), also with Qwen3's per-head query/key norms and a head_dim of its own; with ep over
tp, the expert all-to-all must carry each kept assignment once, not once per tp rank.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from config.parallel import ParallelConfig
from moe.transformer import MoETransformer
from parallel import expert, parallelize
from parallel.groups import ParallelGroups
from parallel.layout import Layout, validate_for_model
from parallel.sharding import clip_grad_norm_
from parallel.tensor import check_tensor_parallel, lm_loss, loss_context, row_bounds, share_counts
from tests.spawn import spawn


@pytest.mark.parametrize("num_rows, parts", [(0, 2), (1, 2), (7, 2), (8, 4), (10, 3)])
def test_row_bounds_cover_the_rows_in_near_equal_shares(num_rows, parts):
    bounds = row_bounds(num_rows, parts)
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert bounds[0] == 0 and bounds[-1] == num_rows and len(sizes) == parts
    assert max(sizes) - min(sizes) <= 1


def test_share_counts_match_counting_the_rows():
    tokens_per_expert = torch.tensor([3, 0, 5, 1, 2])
    expert_of_row = torch.repeat_interleave(torch.arange(5), tokens_per_expert)  # rows grouped by expert
    for parts in (1, 2, 3, 4):
        bounds = row_bounds(int(tokens_per_expert.sum()), parts)
        total = torch.zeros(5, dtype=torch.int64)
        for start, stop in zip(bounds, bounds[1:], strict=False):
            counts = share_counts(tokens_per_expert, start, stop)
            assert counts.tolist() == torch.bincount(expert_of_row[start:stop], minlength=5).tolist()
            total += counts
        assert torch.equal(total, tokens_per_expert)  # the shares partition the rows


@pytest.mark.parametrize("overrides, key, valid", [
    (dict(n_heads=2), "tp", "model.n_heads=2"),
    (dict(n_kv_heads=2), "tp", "model.n_kv_heads=2"),
    (dict(ffn_hidden=30, first_moe_layer=1), "tp", "model.ffn_hidden=30"),
])
def test_tp_must_divide_the_model_shapes(overrides, key, valid):
    model = ModelConfig(**{**dict(d_model=32, n_heads=4, ffn_hidden=64), **overrides})
    with pytest.raises(ConfigError, match=rf"parallel.{key}=4 does not divide .*{valid}.*valid tp for .*: 1, 2"):
        validate_for_model(Layout.resolve(4, tp=4), model, MoEConfig(num_experts=4, expert_hidden=32))


def test_tp_must_divide_the_shared_expert_hidden_size():
    moe = MoEConfig(num_experts=4, expert_hidden=32, num_shared_experts=1, shared_expert_hidden=6)
    with pytest.raises(ConfigError, match=r"parallel.tp=4 does not divide the shared-expert hidden size 6.*: 1, 2"):
        validate_for_model(Layout.resolve(4, tp=4), ModelConfig(d_model=32, n_heads=4, ffn_hidden=64), moe)


@pytest.mark.parametrize("overrides, tp, message", [
    (dict(sequence_parallel=True), 1, r"parallel.sequence_parallel=true .* but parallel.tp=1; set parallel.tp > 1"),
    (dict(vocab_parallel=True), 1, r"parallel.vocab_parallel=true .* but parallel.tp=1"),
    (dict(sequence_parallel=True), 3, r"model.seq_len=32 over parallel.tp=3 ranks, which does not divide it"),
    (dict(vocab_parallel=True), 3, r"model.vocab_size=256 over parallel.tp=3 ranks, which does not divide it"),
])
def test_tensor_parallel_options_are_checked_before_anything_is_built(overrides, tp, message):
    model = ModelConfig(vocab_size=256, d_model=48, n_heads=6, seq_len=32)
    options = dict(sequence_parallel=False, vocab_parallel=False) | overrides
    with pytest.raises(ConfigError, match=message):
        check_tensor_parallel(tp, model, **options)
    check_tensor_parallel(2, model, **options)  # tp=2 divides both


# ---------------------------------------------------------------------------
# Two ranks: the tp=2 model (and ep=2 over it) against the single-process model
# ---------------------------------------------------------------------------

WORLD = 2
MODEL = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, seq_len=8, ffn_hidden=24,
                    first_moe_layer=1)


GPT_OSS_ATTENTION = dict(qkv_bias=True, attn_output_bias=True, attention_sinks=True, sliding_window=2,
                         layer_types=["sliding_attention", "full_attention"])
GPT_OSS_MOE = dict(activation="clamped_swiglu", swiglu_limit=0.05, router_bias=True, expert_proj_bias=True)


def _model(capacity_factor: float | None, tie_embeddings: bool = False, qk_norm: bool = False,
           gpt_oss: bool = False) -> MoETransformer:
    """The test model; ``qk_norm``: Qwen3's attention (per-head q/k norms, randomised so a wrong reduction shows,
    and heads wider than d_model / n_heads); ``gpt_oss``: GPT-OSS's attention (q/k/v/o biases, sinks, a window
    of 2 on the first layer: the blocked path) and MoE (biases, clamped SwiGLU), biases and sinks randomised."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=12, capacity_factor=capacity_factor, num_shared_experts=1,
                    aux_loss_coef=0.01, z_loss_coef=0.001, **(GPT_OSS_MOE if gpt_oss else {}))
    torch.manual_seed(0)  # every rank builds the same weights
    shape = dict(qk_norm=True, head_dim=6) if qk_norm else {}
    shape |= GPT_OSS_ATTENTION if gpt_oss else {}
    model = MoETransformer(dataclasses.replace(MODEL, tie_embeddings=tie_embeddings, **shape), moe)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                param.copy_(1 + 0.5 * torch.randn_like(param))
            if name.endswith(("bias", "sinks")):
                param.copy_(0.5 * torch.randn_like(param))
    return model


def _forward(model: MoETransformer, dtype: torch.dtype | None,
             vocab_parallel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and loss of one fixed batch (the same on both ranks: tp ranks share their data)."""
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with loss_context(vocab_parallel):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(tokens[:, :-1])
        return logits, lm_loss(logits, tokens[:, 1:])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _check(groups: ParallelGroups, capacity_factor: float | None, recompute: str = "none",
           dtype: torch.dtype | None = None, sequence_parallel: bool = False, vocab_parallel: bool = False,
           tie_embeddings: bool = False, qk_norm: bool = False, gpt_oss: bool = False) -> None:
    reference = _model(capacity_factor, tie_embeddings, qk_norm, gpt_oss)
    options = ParallelConfig(activation_checkpointing=recompute, sequence_parallel=sequence_parallel,
                             vocab_parallel=vocab_parallel)
    model = parallelize(copy.deepcopy(reference), groups, options)
    attn = model.layers["0"].attn
    head_dim = reference.config.head_size
    assert isinstance(attn.wq.weight, DTensor) and attn.wq.weight.to_local().shape == (2 * head_dim, 16)  # 2 of 4 heads
    assert isinstance(attn.q_norm.weight, DTensor) if qk_norm else attn.q_norm is None  # replicated over tp
    if gpt_oss:  # the sinks split with their heads
        assert attn.sinks.to_local().shape == (2,) and attn.window == 2
    assert not isinstance(model.layers["1"].moe.router.gate, DTensor)  # the router stays whole
    if groups.layout.etp > 1:  # each rank holds half of every expert's hidden dim
        assert model.layers["1"].moe.experts.w_out.to_local().shape == (4, 6, 16)
    assert isinstance(model.layers["0"].attn_norm.weight, DTensor) == sequence_parallel
    embedding_rows = model.tok_embeddings.weight.to_local().shape[0] if vocab_parallel else 64
    assert embedding_rows == 64 // WORLD ** vocab_parallel
    streams = []  # what each block hands to the next: a sequence slice under sequence parallelism
    hooks = [block.register_forward_hook(lambda module, args, out: streams.append(tuple(out.shape)))
             for block in model.layers.values()]

    ref_logits, ref_loss = _forward(reference, dtype)
    ref_loss.backward()
    sent, computed = [], []  # rows of each token all-to-all this rank starts; rows its local experts compute

    def counting_all_to_all(x, output_split_sizes, input_split_sizes, group, tag=""):
        sent.append(x.shape[0])
        return original(x, output_split_sizes, input_split_sizes, group, tag)

    def counting_ffn(x, *args, **kwargs):
        computed.append(x.shape[0])
        return original_ffn(x, *args, **kwargs)

    original, funcol.all_to_all_single = funcol.all_to_all_single, counting_all_to_all
    original_ffn, expert.expert_ffn = expert.expert_ffn, counting_ffn
    try:
        logits, loss = _forward(model, dtype, vocab_parallel)
    finally:
        funcol.all_to_all_single, expert.expert_ffn = original, original_ffn
        for hook in hooks:
            hook.remove()
    assert streams == [(2, 8 // WORLD ** sequence_parallel, 16)] * 2
    with loss_context(vocab_parallel):  # the backward of a vocabulary-parallel loss runs in it too
        loss.backward()
    logits = _full(logits)  # vocabulary-sharded under vocab_parallel

    tol = dict(rtol=1e-5, atol=1e-6) if dtype is None else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(logits.detach(), ref_logits.detach(), **tol)
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), **tol)
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    grads = {name: _full(p.grad) for name, p in model.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], **tol, msg=name)
    expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in ref_grads.values()]))
    torch.testing.assert_close(clip_grad_norm_(model.parameters(), float("inf")), expected, **tol)

    # The routed experts compute each kept assignment once over the tp group, not once per tp rank (under
    # expert tensor parallelism once per etp rank, each over its slice of the hidden dim).
    stats = reference.routing_stats()[1]
    kept = int(stats.tokens_per_expert.sum() - stats.num_dropped)
    assert len(computed) == 1
    total_computed = torch.tensor(computed)
    dist.all_reduce(total_computed)
    assert int(total_computed) == kept * groups.layout.etp
    if groups.layout.ep > 1:
        # Forward traffic of the one MoE layer: dispatch then combine, each moving this rank's share only;
        # over the tp group the dispatched rows are the kept assignments once (tp ranks hold the same tokens).
        assert len(sent) == 2, sent
        rank = groups.coords()["tp"]
        assert sent[0] == row_bounds(kept, WORLD)[rank + 1] - row_bounds(kept, WORLD)[rank], (sent, kept)
        total = torch.tensor(sent)  # [dispatched rows, rows returned by the combine]
        dist.all_reduce(total)
        assert total.tolist() == [kept, kept]
        if capacity_factor is not None:
            assert int(stats.num_dropped) > 0  # dropped before sending
    else:
        assert sent == []  # tp alone shares the rows out in place; etp alone splits the experts in place: no exchange


def _worker(rank: int) -> None:
    for layout in (Layout(WORLD, tp=WORLD), Layout(WORLD, tp=WORLD, ep=WORLD), Layout(WORLD, tp=WORLD, etp=WORLD)):
        groups = ParallelGroups.build(layout, "cpu")
        # "full": backward re-runs each block, its tp collectives and row shares included
        for capacity_factor, recompute, dtype in ((None, "none", None), (1.0, "none", None),
                                                  (None, "full", None), (None, "none", torch.bfloat16)):
            _check(groups, capacity_factor, recompute, dtype)
        for sequence_parallel, vocab_parallel in ((True, False), (False, True), (True, True)):
            _check(groups, 1.0, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
        _check(groups, None, "full", sequence_parallel=True, vocab_parallel=True)
        # one vocabulary-split table serves as embedding and head
        _check(groups, None, sequence_parallel=True, vocab_parallel=True, tie_embeddings=True)
        # Qwen3's per-head q/k norms on each rank's heads (their weights' gradients summed over tp)
        _check(groups, None, qk_norm=True)
        _check(groups, 1.0, "full", sequence_parallel=True, qk_norm=True)
        if layout.etp == 1:  # GPT-OSS's attention and MoE (expert biases refuse etp > 1)
            _check(groups, 1.0, gpt_oss=True)
            _check(groups, None, "full", sequence_parallel=True, gpt_oss=True)


def test_tensor_parallel_model_matches_single_process():
    spawn(_worker, WORLD)
