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
from moe.kv_cache import LayerCache
from moe.layer import MoELayer
from moe.norm import RMSNorm

# A layer pattern's feed-forward kind -> its module class, which states what it costs and builds itself for a
# block (``for_block``) under the name its parameters carry (``block_attribute``)
FEED_FORWARD_KINDS: dict[str, type[FeedForward] | type[MoELayer]] = {"dense": FeedForward, "moe": MoELayer}


def feed_forward_kind(layer: LayerSpec) -> type[FeedForward] | type[MoELayer]:
    """The module class of ``layer``'s feed-forward kind."""
    return FEED_FORWARD_KINDS[layer.feed_forward]


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + feed_forward(norm(x)).

    The feed-forward sits under its kind's name (``ffn`` for a dense FFN, ``moe`` for an MoE layer), the other name
    None, so that parameter names (``layers.i.ffn.*``, ``layers.i.moe.*``) and the parallel plans that look for them
    stay as they are.
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

    @property
    def feed_forward(self) -> nn.Module:
        return self.moe if self.moe is not None else self.ffn

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        normed = self.attn_norm(x)
        # the cache is passed only when there is one, the documents by name: tensor parallelism's input hooks
        # count the positional arguments
        x = _residual(x, self.attn(normed, cos, sin, documents=documents) if cache is None
                      else self.attn(normed, cos, sin, cache))
        return _residual(x, self.feed_forward(self.ffn_norm(x)))


def _residual(stream: Tensor, branch: Tensor) -> Tensor:
    """``stream + branch``. A bf16 branch (autocast) is cast into a new fp32 tensor that the stream is then
    added into: on CPU ``stream + branch`` makes the same cast as a temporary and then a third tensor."""
    if branch.dtype == stream.dtype or isinstance(branch, DTensor) or isinstance(stream, DTensor):
        return stream + branch
    return branch.to(stream.dtype).add_(stream)
