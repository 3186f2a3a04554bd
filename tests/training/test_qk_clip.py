"""QK-clip (training/qk_clip.py, moe/max_logits.py): the recorded largest logits against full attention logits
computed by hand, the clip against a recomputation of the logits, and the threshold's validation. The parallel
layouts are held to one process by the ``-qk_clip`` rows of tests/parallel/test_parity.py."""

import math

import pytest
import torch

import moe.max_logits
from config.errors import ConfigError
from config.run import TrainConfig, load_config
from moe.attention.latent import LatentAttention
from moe.documents import document_ids
from moe.rope import apply_partial_rope, apply_rope
from moe.transformer import MoETransformer
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from tests.parallel.parity import TINY
from training.qk_clip import QKClip

LATENT = ["model.kv_lora_rank=16", "model.q_lora_rank=12", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4",
          "model.v_head_dim=8"]
KINDS = {  # attention kinds and the options that change which logits a query sees
    "multi-head-qkv_bias": ["model.qkv_bias=true"],
    "grouped-query-partial_rotary": ["model.n_kv_heads=2", "model.rotary_dim=4"],
    "sliding_window-sinks": ["model.sliding_window=4", "model.layer_types=[sliding_attention, full_attention]",
                             "model.attention_sinks=true"],
    "latent": LATENT,
}


def build(overrides: list[str]) -> tuple[MoETransformer, QKClip, list]:
    """A tiny fp32 model with QK-clip (threshold set later) and a list that each attention's inputs are put in."""
    config = load_config("moe-8x", [*TINY, "moe.capacity_factor=null", *overrides])
    torch.manual_seed(0)
    model = MoETransformer(config.model, config.moe, seed=3)
    with torch.no_grad():  # larger query and key weights: logits of order 1, as a trained model's; nonzero biases
        for name, param in model.named_parameters():
            if name.split(".")[-2] in ("wq", "wk", "wq_b", "wkv_b"):
                param.copy_(torch.randn_like(param) * 0.4 if name.endswith("bias") else param * 20)
    clip = QKClip(model, math.inf, ParallelGroups.build(Layout.resolve(1), "cpu"))
    inputs = []
    for attention in clip.attentions:
        attention.register_forward_pre_hook(lambda module, args, kwargs: inputs.append((module, args, kwargs)),
                                            with_kwargs=True)
    return model, clip, inputs


def reference_max_logits(attention, x, cos, sin, documents=None) -> torch.Tensor:
    """Each head's largest scale·q·k over the batch and the allowed (query, key) pairs, from the full [B, h, S, S]
    logits of q and k computed from the module's weights by hand."""
    batch, seq, _ = x.shape
    if documents is not None:
        cos, sin = documents.cos, documents.sin
    else:
        cos, sin = cos[:seq], sin[:seq]
    if isinstance(attention, LatentAttention):
        n, r = attention.nope_dim, attention.rope_dim
        q = attention.wq_b(attention.q_latent_norm(attention.wq_a(x))).view(batch, seq, -1, n + r).transpose(1, 2)
        latent, k_rope = attention.wkv_a(x).split([attention.kv_rank, r], dim=-1)
        kv = attention.wkv_b(attention.kv_latent_norm(latent)).view(batch, seq, -1, n + attention.v_dim)
        k_nope = kv.transpose(1, 2)[..., :n]
        k_rope = apply_rope(k_rope[:, None], cos, sin)  # one rotary key for every head
        logits = (q[..., :n] @ k_nope.transpose(-2, -1)
                  + apply_rope(q[..., n:], cos, sin) @ k_rope.transpose(-2, -1)) * attention.softmax_scale
        window = None
    else:
        hd = attention.head_dim
        q = apply_partial_rope(attention.wq(x).view(batch, seq, -1, hd).transpose(1, 2), cos, sin, attention.rotary_dim)
        k = apply_partial_rope(attention.wk(x).view(batch, seq, -1, hd).transpose(1, 2), cos, sin, attention.rotary_dim)
        k = k.repeat_interleave(attention.n_heads // attention.n_kv_heads, dim=1)
        logits = q @ k.transpose(-2, -1) / math.sqrt(hd)
        window = attention.window
    query, key = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = (key <= query) & (key > query - (window or seq))
    if documents is not None:
        allowed = allowed & documents.mask
    return logits.masked_fill(~allowed, -torch.inf).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_recorded_max_logits_equal_the_full_logits_by_hand(kind, documents, monkeypatch):
    """Every layer's recorded maxima (over two micro-batches, queries in chunks of 3 rows) equal the maxima of the
    full masked logits; evaluation records nothing."""
    monkeypatch.setattr(moe.max_logits, "CHUNK_LOGITS", 3 * 2 * 4 * 32)  # 3 query rows of [B=2, h=4, S=32]
    model, clip, inputs = build(KINDS[kind])
    generator = torch.Generator().manual_seed(1)
    expected = [torch.full((4,), -torch.inf) for _ in clip.attentions]
    for _ in range(2):
        tokens = torch.randint(0, 256, (2, 32), generator=generator)
        tokens[:, ::7] = 10  # a document ends every 7 tokens
        inputs.clear()
        model(tokens, documents=document_ids(tokens, 10) if documents else None)
        with torch.no_grad():
            for i, (attention, args, kwargs) in enumerate(inputs):
                docs = kwargs.get("documents")
                assert (docs is not None) == documents
                expected[i] = torch.maximum(expected[i], reference_max_logits(attention, *args, documents=docs))
    for attention, want in zip(clip.attentions, expected, strict=True):
        got = attention.logit_tracker.take()
        assert want.min() > 0.5  # logits of order 1: the comparison is not between zeros
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    model.eval()
    model(tokens)
    assert all(attention.logit_tracker.take() is None for attention in clip.attentions)


def projections(attention) -> dict[str, torch.Tensor]:
    """The attention's tensors that QK-clip may scale, and the ones it must not, as copies."""
    names = ["wq_a", "wq_b", "wkv_a", "wkv_b"] if isinstance(attention, LatentAttention) else ["wq", "wk", "wv"]
    return {f"{name}.{kind}": getattr(getattr(attention, name), kind).detach().clone()
            for name in names for kind in ("weight", "bias") if getattr(getattr(attention, name), kind) is not None}


@pytest.mark.parametrize("kind", ["multi-head-qkv_bias", "grouped-query-partial_rotary", "latent"])
def test_a_clip_brings_the_heads_over_the_threshold_to_it_and_leaves_the_others(kind):
    """With the threshold between the heads' maxima, recomputing each layer's logits on the same inputs after the
    clip gives the threshold for the clipped heads and the same maxima for the others, whose rows are unchanged bit
    for bit; so are the shared key heads (grouped-query) and the shared rotary key (latent)."""
    model, clip, inputs = build(KINDS[kind])
    model(torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2)))
    before = {id(a): (a.logit_tracker.max_logits.clone(), projections(a)) for a in clip.attentions}
    clip.threshold = float(torch.cat([maxima for maxima, _ in before.values()]).median())
    clip.after_step(stepped=True)
    metrics = clip.metrics()
    assert 0 < metrics["qk_clip/heads_clipped"] < 4 * len(clip.attentions)  # some heads fired, not all
    with torch.no_grad():
        for attention, args, kwargs in list(inputs):  # the same inputs again (the hook adds them to ``inputs``)
            attention(*args, **kwargs)
    for attention in clip.attentions:
        maxima, weights = before[id(attention)]
        after, now = attention.logit_tracker.take(), projections(attention)
        fired = maxima > clip.threshold
        torch.testing.assert_close(after[fired], torch.full_like(after[fired], clip.threshold), rtol=2e-6, atol=0)
        torch.testing.assert_close(after[~fired], maxima[~fired], rtol=2e-6, atol=0)
        if isinstance(attention, LatentAttention):  # rows per head: n nope + r rotary (query), n nope + v (key, value)
            unclipped = {"wq_b.weight": 12, "wkv_b.weight": 16}
            untouched = ["wq_a.weight", "wkv_a.weight"]  # the query latent, the key latent and the shared rotary key
        else:
            unclipped = {"wq.weight": 8, "wq.bias": 8}
            if attention.n_kv_heads == attention.n_heads:
                unclipped |= {"wk.weight": 8, "wk.bias": 8}
            untouched = ["wv.weight", "wv.bias"] + ([] if attention.n_kv_heads == attention.n_heads else ["wk.weight"])
        for name in untouched:
            if name in weights:
                assert torch.equal(now[name], weights[name]), name
        for name, rows in unclipped.items():
            if name in weights:
                for head in range(4):
                    block = slice(head * rows, (head + 1) * rows)
                    assert torch.equal(now[name][block], weights[name][block]) == (not fired[head]), (name, head)


def test_a_skipped_step_clips_nothing_and_forgets_its_logits():
    """A step the loop skipped (non-finite loss) scales no weight, and its logits do not reach the next step."""
    model, clip, _ = build([])
    clip.threshold = 1e-3  # every head is over it
    model(torch.randint(0, 256, (2, 32)))
    state = {name: value.clone() for name, value in model.state_dict().items()}
    clip.after_step(stepped=False)
    assert all(torch.equal(value, state[name]) for name, value in model.state_dict().items())
    assert all(attention.logit_tracker.take() is None for attention in clip.attentions)
    assert clip.metrics() == {"qk_clip/heads_clipped": 0.0}


@pytest.mark.parametrize("value, message", [("nan", "is not a finite number"), ("inf", "is not a finite number"),
                                            ("0", "must be a positive finite logit"),
                                            ("-100", "must be a positive finite logit")])
def test_a_threshold_that_is_not_a_positive_finite_logit_is_refused(value, message):
    """Refused when the config is read, before any process or tensor (non-finite numbers by the schema)."""
    with pytest.raises(ConfigError, match=rf"train\.qk_clip_threshold[=:] ?{value}(\.0)? .*{message}"):
        load_config("moe-8x", [f"train.qk_clip_threshold={value}"])
    with pytest.raises(ConfigError, match=r"train\.qk_clip_threshold=nan must be a positive finite logit"):
        TrainConfig(qk_clip_threshold=math.nan).validate()


def test_qk_clip_with_qk_norm_is_refused():
    with pytest.raises(ConfigError, match=r"train\.qk_clip_threshold=100\.0 with model\.qk_norm=true"):
        load_config("moe-8x", ["train.qk_clip_threshold=100", "model.qk_norm=true"])
