"""One transformer block, built from its place in the layer pattern (``config.model.LayerSpec``): an attention
kind (``moe/attention/``) and a feed-forward kind (``FEED_FORWARD_KINDS``), each in a pre-norm residual branch.

Shapes: B sequences, S positions, D = d_model.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from config.model import LayerSpec, ModelConfig, MoEConfig
from moe.attention import build_attention
from moe.documents import Documents
from moe.feed_forward import FeedForward
from moe.hyper_connections import HyperConnection
from moe.kv_cache import LayerCache
from moe.layer import HashMoELayer, MoELayer
from moe.norm import RMSNorm

# A layer pattern's feed-forward kind -> its module class, which states what it costs and builds itself for a
# block (``for_block``) under the name its parameters carry (``block_attribute``)
FEED_FORWARD_KINDS: dict[str, type[FeedForward] | type[MoELayer]] = {"dense": FeedForward, "moe": MoELayer,
                                                                      "hash_moe": HashMoELayer}


def feed_forward_kind(layer: LayerSpec) -> type[FeedForward] | type[MoELayer]:
    """The module class of ``layer``'s feed-forward kind."""
    return FEED_FORWARD_KINDS[layer.feed_forward]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + feed_forward(norm(x)).

    The feed-forward sits under its kind's name (``ffn`` for a dense FFN, ``moe`` for an MoE layer), the other name
    None, so that parameter names (``layers.i.ffn.*``, ``layers.i.moe.*``) and the parallel plans that look for them
    stay as they are.

    With ``model.hc_mult`` > 1 the residual is DeepSeek-V4's hyper-connections (``moe/hyper_connections.py``):
    the block takes and returns n streams [B, S, n, D], and each branch's ``attn_hc`` / ``ffn_hc`` collapses them
    into its input and merges its output back; otherwise those are None and the stream is [B, S, D].
    """

    def __init__(self, config: ModelConfig, moe_config: MoEConfig, layer: LayerSpec):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = build_attention(config, layer)
        self.ffn_norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.moe: MoELayer | None = None
        self.ffn: FeedForward | None = None
        kind = feed_forward_kind(layer)
        setattr(self, kind.block_attribute, kind.for_block(config, moe_config))
        self.hashed = layer.feed_forward == "hash_moe"  # its experts are picked by the token ids
        hyper = config.hc_mult > 1
        self.attn_hc = HyperConnection(config) if hyper else None
        self.ffn_hc = HyperConnection(config) if hyper else None

    @property
    def feed_forward(self) -> nn.Module:
        return self.moe if self.moe is not None else self.ffn

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None, token_ids: Tensor | None = None) -> Tensor:
        """x: [B, S, D] (or the n streams [B, S, n, D]) -> the same shape. ``token_ids`` [B, S]: the ids of x's
        tokens, which a hash-routed MoE layer routes by (passed by name, as the documents are)."""
        if self.attn_hc is not None:
            return self._hyper_forward(x, cos, sin, cache, documents, token_ids)
        x = _residual(x, self._attend(self.attn_norm(x), cos, sin, cache, documents))
        return _residual(x, self._feed(self.ffn_norm(x), token_ids))

    def _hyper_forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None,
                       documents: Documents | None, token_ids: Tensor | None) -> Tensor:
        """Each branch between its hyper-connection's collapse and merge."""
        collapsed, post, comb = self.attn_hc(x)
        x = HyperConnection.merge(x, self._attend(self.attn_norm(collapsed), cos, sin, cache, documents), post, comb)
        collapsed, post, comb = self.ffn_hc(x)
        return HyperConnection.merge(x, self._feed(self.ffn_norm(collapsed), token_ids), post, comb)

    def _attend(self, normed: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None,
                documents: Documents | None) -> Tensor:
        # the cache is passed only when there is one, the documents by name: tensor parallelism's input hooks
        # count the positional arguments
        return (self.attn(normed, cos, sin, documents=documents) if cache is None
                else self.attn(normed, cos, sin, cache))

    def _feed(self, normed: Tensor, token_ids: Tensor | None) -> Tensor:
        if not self.hashed:
            return self.feed_forward(normed)
        if token_ids is None:
            raise ValueError("a hash-routed MoE layer (mlp_layer_types' hash_moe) routes by token id: pass token_ids")
        return self.feed_forward(normed, token_ids=token_ids)


def _residual(stream: Tensor, branch: Tensor) -> Tensor:
    """``stream + branch``. A bf16 branch (autocast) is cast into a new fp32 tensor that the stream is then
    added into: on CPU ``stream + branch`` makes the same cast as a temporary and then a third tensor."""
    if branch.dtype == stream.dtype or isinstance(branch, DTensor) or isinstance(stream, DTensor):
        return stream + branch
    return branch.to(stream.dtype).add_(stream)
