"""DeepSeek-V4 generation through its cache (``moe/kv_cache.py``: the window's key/value head, the compressors'
open windows and entries, the indexer's keys) against the whole sequence's forward: a tiny V4 with the three
attention kinds (window of 6; compressed sparse attention of rate 4 keeping the indexer's top 2, heavily compressed
of rate 8), a hash-routed layer and 4 hyper-connected streams. The whole forward is held to ``transformers`` in
tests/moe/test_attention_v4.py and tests/interop/test_hf_deepseek_v4.py. 16 indexer heads: with 4, an entry's score
is exactly 0 wherever all 4 ReLUs are (1 in 16), and which of such tied entries the top-k keeps can differ between
a whole forward and a chunk of it (seen: logits 0.18 apart from one position on), a tie of the model's, with or
without a cache."""

import pytest
import torch

from config.run import load_config
from inference.generate import generate
from moe.kv_cache import KVCache
from moe.transformer import MoETransformer

WINDOW, CSA_RATE, HCA_RATE, SEQ = 6, 4, 8, 40
V4 = ["model.d_model=32", "model.n_layers=3", "model.n_heads=4", "model.n_kv_heads=null", "model.head_dim=16",
      "model.rotary_dim=8", "model.q_lora_rank=12", f"model.sliding_window={WINDOW}", f"model.seq_len={SEQ}",
      "model.layer_types=[sliding_attention, compressed_sparse_attention, heavily_compressed_attention]",
      "model.mlp_layer_types=[hash_moe, moe, moe]", "model.hc_mult=4", "model.index_topk=2",
      "model.index_n_heads=16", "model.index_head_dim=8", f"model.compressed_attention.csa_rate={CSA_RATE}",
      f"model.compressed_attention.hca_rate={HCA_RATE}", "model.compressed_attention.o_groups=2",
      "model.compressed_attention.o_lora_rank=8", "model.init_std=0.1", "moe.num_experts=4", "moe.top_k=2",
      "moe.expert_hidden=16", "moe.capacity_factor=null", "moe.score_func=sqrtsoftplus",
      "moe.num_shared_experts=1"]


def tiny_v4() -> MoETransformer:
    """The tiny V4, its sinks, position biases and hyper-connection biases and scales drawn too (init leaves them at
    zero or one, where a mistake in their cached use could hide)."""
    config = load_config("moe-8x", V4)
    model = MoETransformer(config.model, config.moe, seed=0).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("sinks", "position_bias", "_hc.bias", "_hc.scale", "hc_head.bias", "hc_head.scale")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def test_cached_logits_equal_the_whole_forward_at_every_step():
    """Two sequences: a prompt of 11 positions (past the window of 6; two CSA windows and an open one, one HCA
    window), one position at a time closing 4 CSA and 2 HCA windows, a chunk of 8 after cached ones (longer than
    the window, closing 2 CSA windows and 1 HCA), then one at a time to the end: each step's logits those of the
    whole sequence's forward at its positions, fp32 within 1e-5."""
    model = tiny_v4()
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    pieces = [(0, 11), *((i, i + 1) for i in range(11, 27)), (27, 35), *((i, i + 1) for i in range(35, SEQ))]
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        steps = [model(tokens[:, start:end], cache) for start, end in pieces]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    assert cache.length == SEQ
    layers = cache.layers
    assert layers["0"].sliding_keys.shape[2] == WINDOW - 1  # the window's last positions, no more
    assert layers["1"].compressors["attention"].entries.shape[1] == SEQ // CSA_RATE
    assert layers["1"].compressors["indexer"].entries.shape[1] == SEQ // CSA_RATE
    assert layers["2"].compressors["attention"].entries.shape[1] == SEQ // HCA_RATE


def test_cached_greedy_generation_writes_what_recomputing_writes():
    """A prompt longer than the window, then 14 tokens (across 3 CSA and 1 HCA window boundaries): the cache's
    greedy tokens are those of the whole sequence recomputed at each step (``transformers``' too:
    tests/interop/test_hf_deepseek_v4.py)."""
    model = tiny_v4()
    prompt = [5, 77, 200, 3, 41, 9, 120, 18, 64, 2]
    written = generate(model, prompt, 14, temperature=0)
    assert written == generate(model, prompt, 14, temperature=0, use_cache=False)


def test_a_cache_refuses_another_number_of_sequences():
    model = tiny_v4()
    tokens = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    cache = KVCache()
    with torch.no_grad():
        model(tokens, cache)
        with pytest.raises(ValueError, match="holds 2 sequences and this call continues 1"):
            model(tokens[:1, :1], cache)
