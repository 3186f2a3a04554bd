"""Multi-token prediction (DeepSeek-V3, arXiv:2412.19437, sec. 2.2): D more tokens predicted, each by a module.

Two module kinds: ``PredictionModule`` on a plain residual stream (DeepSeek-V3, GLM-4.5, Qwen3-Next) and
``HyperPredictionModule`` on DeepSeek-V4's hyper-connected streams (``model.hc_mult`` > 1); ``prediction_module``
picks one by the config.

Shapes: B sequences, S positions, n streams, D = d_model, V vocab; module k (1-based) works on the first S - k
positions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from config.model import ModelConfig, MoEConfig
from moe.hyper_connections import HyperHead
from moe.norm import RMSNorm
from moe.param_tensors import ParamTensor


class PredictionModule(nn.Module):
    """MTP module k: h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})] (eq. 21; the embedding first, as
    DeepSeek-V3's released weights order ``eh_proj``'s input), then one transformer block TRM_k (eq. 22), then its
    own final norm before the shared output head (eq. 23). The embedding and the head are the main model's."""

    def __init__(self, config: ModelConfig, moe_config: MoEConfig, block: nn.Module):
        super().__init__()
        d = config.d_model
        self.embed_norm = RMSNorm(d, eps=config.norm_eps)
        self.hidden_norm = RMSNorm(d, eps=config.norm_eps)
        self.proj = nn.Linear(2 * d, d, bias=False)
        self.block = block
        self.norm = RMSNorm(d, eps=config.norm_eps)

    def forward(self, hidden: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """hidden: h^{k-1} of positions 0..S-k-1; embedded: Emb(t_{i+k}) of the same positions -> (h^k, its final
        norm), each [B, S-k, D]. The norm runs here, not after the call, so that all of the module's weights are
        used inside its forward: FSDP gathers a unit's shards around its forward only."""
        combined = self.proj(torch.cat((self.embed_norm(embedded), self.hidden_norm(hidden)), dim=-1))
        out = self.block(combined, cos, sin)
        return out, self.norm(out)

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int) -> list[ParamTensor]:
        """Module i's (layer n_layers + k) tensors besides its block: the two input norms, the 2d -> d projection
        and the final norm (replicated under tp, as the router's gate is)."""
        d = model.d_model
        return [ParamTensor("norm", i, (d,)), ParamTensor("norm", i, (d,)), ParamTensor("projection", i, (d, 2 * d)),
                ParamTensor("norm", i, (d,))]


class HyperPredictionModule(nn.Module):
    """DeepSeek-V4's MTP module over n hyper-connected streams, as DeepSeek published it (``MTPBlock`` of
    ``inference/model.py`` in the deepseek-ai/DeepSeek-V4-Flash and -Pro repositories; vLLM's ``deepseek_v4_mtp.py``
    serves it the same way):

        h'_i = e_proj(RMSNorm(Emb(t_{i+k}))) + h_proj(RMSNorm(h^{k-1}_i))

    where h^{k-1}_i is n streams [n, D], each normalised over its own D channels by ``hnorm`` and projected by the
    one ``h_proj``, and the embedding's projection is added to every stream (V4 keeps the two D x D projections
    apart where V3 concatenates into one ``eh_proj``). Then one hyper-connected block, whose output streams are
    h^k (the next module's input); its own collapse of the streams (``hc_head``: the main model's
    ``HyperHead`` with weights of its own) and final norm give the shared head's input. h^0 is the main model's
    last block's output streams, before the main collapse: the only n-stream state there is (vLLM feeds the
    target's "pre-hc_head residual").

    The block is of the kind ``ModelConfig.layer(n_layers + k - 1)`` says: in V4 a sliding-window layer with a
    learned (not hash) router: the published configs' ``compress_ratios`` end with a 0 for it, and its
    ``layer_id`` n_layers is past ``n_hash_layers``."""

    def __init__(self, config: ModelConfig, moe_config: MoEConfig, block: nn.Module):
        super().__init__()
        d = config.d_model
        self.embed_norm = RMSNorm(d, eps=config.norm_eps)
        self.hidden_norm = RMSNorm(d, eps=config.norm_eps)
        self.embed_proj = nn.Linear(d, d, bias=False)
        self.hidden_proj = nn.Linear(d, d, bias=False)
        self.block = block
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(d, eps=config.norm_eps)

    def forward(self, hidden: Tensor, embedded: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """hidden: h^{k-1} [B, S-k, n, D]; embedded: Emb(t_{i+k}) [B, S-k, D] -> (h^k [B, S-k, n, D], the head's
        input [B, S-k, D]). The collapse and norm run here, inside the forward, for FSDP (``PredictionModule``)."""
        streams = self.hidden_proj(self.hidden_norm(hidden)) + self.embed_proj(self.embed_norm(embedded)).unsqueeze(-2)
        out = self.block(streams, cos, sin)
        return out, self.norm(self.hc_head(out))

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int) -> list[ParamTensor]:
        """Module i's (layer n_layers + k) tensors besides its block: the two input norms, the two d x d
        projections, the streams' collapse and the final norm."""
        d = model.d_model
        return [ParamTensor("norm", i, (d,)), ParamTensor("norm", i, (d,)), ParamTensor("projection", i, (d, d)),
                ParamTensor("projection", i, (d, d)), *HyperHead.parameter_tensors(model, i),
                ParamTensor("norm", i, (d,))]


def prediction_module(model: ModelConfig) -> type[PredictionModule] | type[HyperPredictionModule]:
    """The module kind of ``model``'s multi-token prediction: over hyper-connected streams with ``hc_mult`` > 1."""
    return HyperPredictionModule if model.hc_mult > 1 else PredictionModule


class PredictionModules(nn.ModuleList):
    """The D modules, run in sequence on the main model's outputs by one call, each module keeping its name
    (``mtp.0``, ``mtp.1``, ...). One call so that a parallel plan can prepare the inputs of all of them at one
    place: sequence parallelism gathers the embeddings here (``parallel/tensor.py``).

    Module 1's h^0 is the main model's hidden state after its final norm (the head's input), not the last block's
    raw output: the paper's eq. 21 leaves it open and DeepSeek's own inference code has no MTP module
    (``inference/model.py`` of deepseek-ai/DeepSeek-V3; ``convert.py`` drops layer 61, the MTP weights; its
    README sends MTP to SGLang). The engines that serve the released MTP weights for speculative decoding, vLLM
    and SGLang (``deepseek_mtp.py``, ``deepseek_nextn.py``), give ``hnorm`` the hidden states their main model
    returns, which it returns after its final norm. So an imported DeepSeek-V3 or GLM-4.5 module sees the inputs
    it served with."""

    def forward(self, hidden: Tensor, embedded: Tensor, tokens: Tensor, head: nn.Module, cos: Tensor,
                sin: Tensor) -> Tensor:
        """L^k_MTP for k = 1..D (eq. 24): [D] fp32.

        hidden: the main model's last hidden states h^0 [B, S, D] after its final norm, the input of its head (see
        below), or with hyper-connections its last block's output streams [B, S, n, D] (``HyperPredictionModule``);
        embedded: Emb(t) [B, S, D];
        tokens: the input t [B, S]. Module k predicts t_{i+k+1} at position i; within the input that is known for
        i <= S-k-2, so each module's loss is over S-k-1 positions (the paper also uses t_{S+1}, the target after
        the input: one position more per sequence). ``head``'s logits may be split over the vocabulary (a DTensor,
        under ``parallel.tensor.loss_context`` as the main loss is).
        """
        seq, losses = tokens.shape[1], []
        for k, module in enumerate(self, start=1):
            hidden, normed = module(hidden[:, :seq - k], embedded[:, k:], cos, sin)  # [B, S-k, D] each
            logits = head(normed[:, :seq - k - 1]).float()  # [B, S-k-1, V]
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, k + 1:].flatten())
            # vocabulary-split logits (``parallel.vocab_parallel``) give a loss replicated over tp: its own value
            losses.append(loss.full_tensor() if isinstance(loss, DTensor) else loss)
        return torch.stack(losses)
