"""Document masking against its definition: a window of packed documents, masked, gives each document exactly the
logits (and the gradients) it gets when run alone, from position 0, in a batch of its own.

The model is run once per document as the reference: no mask, no shared code path with the masked run but the
layers themselves. Routing is dropless, so a token's expert choice does not depend on the others in the batch.
"""

import pytest
import torch

from config.model import ModelConfig, MoEConfig
from moe.documents import document_ids, document_positions, documents_of
from moe.kv_cache import KVCache
from moe.transformer import MoETransformer

END = 3  # the end-of-document token of these tests
SEQ = 32
# the documents of one window (each ends with END, the first is a tail of one that began before the window)
LENGTHS = [5, 1, 9, 11, 3]

# layer settings: grouped-query attention; GPT-OSS's sinks with a window of 4 (32 positions: the blocked path) on
# a sliding layer before a full one; the same with a window of 9 (the masked SDPA path; shorter than the longest
# document, so the window binds within it); partial rotary with q/k norms; DeepSeek's latent attention with a query
# bottleneck
SETTINGS = [
    pytest.param(dict(n_kv_heads=2), id="gqa"),
    pytest.param(dict(attention_sinks=True, qkv_bias=True, sliding_window=4,
                      layer_types=["sliding_attention", "full_attention"]), id="gpt-oss-blocked-window"),
    pytest.param(dict(attention_sinks=True, sliding_window=9, layer_types=["sliding_attention", "full_attention"]),
                 id="gpt-oss-masked-window"),
    pytest.param(dict(rotary_dim=4, qk_norm=True), id="glm-partial-rotary"),
    pytest.param(dict(kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5),
                 id="latent-attention"),
]


def packed_window(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One window [1, SEQ] of the documents of ``LENGTHS`` (random tokens, never END but at each end), and each
    document alone [1, length]."""
    generator = torch.Generator().manual_seed(seed)
    documents = []
    for length in LENGTHS:
        doc = torch.randint(END + 1, 64, (1, length), generator=generator)
        doc[0, -1] = END
        documents.append(doc)
    tail = torch.randint(END + 1, 64, (1, SEQ - sum(LENGTHS)), generator=generator)  # a document cut by the window
    documents.append(tail)
    return torch.cat(documents, dim=1), documents


def tiny_model(settings: dict) -> MoETransformer:
    config = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, seq_len=SEQ, ffn_hidden=48, **settings)
    config.validate()
    torch.manual_seed(0)
    model = MoETransformer(config, MoEConfig(num_experts=4, top_k=2, expert_hidden=24, capacity_factor=None,
                                                    aux_loss_coef=0.0, z_loss_coef=0.0), seed=1)
    with torch.no_grad():  # sinks of a few units, so they take a real share of the softmax
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param) * 2)
    return model


def test_document_ids_and_positions_restart_after_each_end_token():
    tokens = torch.tensor([[7, END, 5, 6, END, END, 9], [END, 1, 2, 4, 5, 6, 7]])
    ids = document_ids(tokens, END)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    positions = [[0, 1, 0, 1, 2, 0, 0], [0, 0, 1, 2, 3, 4, 5]]
    assert document_positions(ids).tolist() == positions
    cos, sin = torch.randn(7, 2), torch.randn(7, 2)  # rotary tables [L, r/2]
    documents = documents_of(ids, cos, sin)
    for row, places in enumerate(positions):  # each position rotated by its place in its document
        assert torch.equal(documents.cos[row, 0], cos[places]) and torch.equal(documents.sin[row, 0], sin[places])
    # attention's mask: causal, and only within the document
    assert documents.mask[0, 0].tolist() == [[ids[0, i] == ids[0, j] and j <= i for j in range(7)] for i in range(7)]


@pytest.mark.parametrize("settings", SETTINGS)
def test_a_masked_window_gives_each_document_its_logits_and_gradients_alone(settings):
    model = tiny_model(settings)
    window, documents = packed_window()
    packed = model(window, documents=document_ids(window, END))
    weights = torch.randn_like(packed)  # a loss that weighs every logit: every gradient path is exercised
    (packed * weights).sum().backward()
    packed_grads = {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}
    model.zero_grad()

    start = 0
    for doc in documents:
        alone = model(doc)  # plain causal attention from position 0: the document as if it were the whole input
        length = doc.shape[1]
        torch.testing.assert_close(packed[:, start:start + length], alone, rtol=1e-5, atol=1e-5)
        (alone * weights[:, start:start + length]).sum().backward()  # gradients add up over the documents
        start += length
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-4, atol=1e-4, msg=name)
    # the check has teeth: without the mask the documents see each other and the logits differ
    assert not torch.allclose(model(window)[:, LENGTHS[0]:], packed[:, LENGTHS[0]:], atol=1e-3)


def test_documents_are_refused_with_generation_and_multi_token_prediction():
    window, _ = packed_window()
    ids = document_ids(window, END)
    with pytest.raises(ValueError, match="not to generation with a cache"):
        tiny_model({})(window, cache=KVCache(), documents=ids)
    with pytest.raises(ValueError, match="multi-token prediction"):
        tiny_model(dict(mtp_depth=1))(window, documents=ids)
