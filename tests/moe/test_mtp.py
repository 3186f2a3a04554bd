"""Multi-token prediction against a naive reference written from DeepSeek-V3's equations (sec. 2.2, eqs. 21-25)."""

import pytest
import torch
import torch.nn.functional as F

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from config.run import load_config
from moe.accounting import parameter_counts
from moe.transformer import MoETransformer

MODEL = dict(vocab_size=48, d_model=16, n_layers=2, n_heads=2, seq_len=12, ffn_hidden=24, first_moe_layer=1)
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, capacity_factor=None, aux_loss_coef=0.0, z_loss_coef=0.0)


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_losses(model: MoETransformer, tokens: torch.Tensor) -> torch.Tensor:
    """Per module k: h'_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i^{k-1})] token by token (eq. 21), h^k =
    TRM_k(h'_{1:S-k}) (eq. 22), P_{i+k+1} = OutHead(RMSNorm(h_i^k)) (eq. 23), L^k the cross-entropy against t_{i+k+1}
    where the input has it (eq. 24); h^0 the main model's last hidden states after its final norm (the head's
    input), as the engines serving DeepSeek-V3's MTP weights give it (``moe/mtp.py`` says why)."""
    eps = model.config.norm_eps
    h = model.tok_embeddings(tokens)
    for block in model.layers.values():
        h = block(h, model.rope_cos, model.rope_sin)
    h = rms(h, model.norm.weight, eps)
    seq, losses = tokens.shape[1], []
    for k, module in enumerate(model.mtp, start=1):
        rows = []
        for i in range(seq - k):
            emb = rms(model.tok_embeddings.weight[tokens[:, i + k]], module.embed_norm.weight, eps)  # [B, D]
            prev = rms(h[:, i], module.hidden_norm.weight, eps)
            rows.append(torch.cat((emb, prev), -1) @ module.proj.weight.t())
        h = module.block(torch.stack(rows, 1), model.rope_cos, model.rope_sin)  # [B, S-k, D]
        nll = [F.cross_entropy(rms(h[:, i], module.norm.weight, eps) @ model.output.weight.t(), tokens[:, i + k + 1])
               for i in range(seq - k - 1)]
        losses.append(torch.stack(nll).mean())
    return torch.stack(losses)


@pytest.mark.parametrize("depth, tie", [(1, False), (2, True)])
def test_losses_and_gradients_match_the_paper(depth, tie):
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**MODEL, mtp_depth=depth, mtp_loss_weight=0.3, tie_embeddings=tie), MOE)
    with torch.no_grad():  # norms away from one, so a swapped norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    tokens = torch.randint(0, 48, (3, 12), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    torch.testing.assert_close(model.last_mtp_losses, reference_losses(model, tokens).detach(), rtol=1e-5, atol=1e-6)
    lm = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    lm.backward()  # the attached MTP loss adds its gradient by itself
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with torch.no_grad():
        model.eval()
        plain = model(tokens)  # eval: no MTP
        model.train()
    torch.testing.assert_close(plain, logits.detach())  # the attached loss leaves the logits as they are
    # the reference objective: L_main + lambda / D * sum_k L^k, differentiated by autograd through the naive path
    model.eval()  # keep the model's own MTP out of this forward; MoE layers route the same in eval (no jitter)
    main = F.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    (main + 0.3 / depth * reference_losses(model, tokens).sum()).backward()
    assert got.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    assert any("mtp." in name for name in got)
    for name, grad in got.items():
        torch.testing.assert_close(grad, model.get_parameter(name).grad, rtol=1e-4, atol=1e-6, msg=name)


def test_counts_include_the_modules():
    """Parameters and FLOPs: each module a block of the next layer's kind, the projection and three norms (over
    hyper-connected streams, DeepSeek-V4's: two projections, and the streams' collapse)."""
    for depth, streams in ((1, 1), (2, 1), (2, 4)):
        config = ModelConfig(**MODEL, mtp_depth=depth, hc_mult=streams)
        model = MoETransformer(config, MOE)
        counts = parameter_counts(config, MOE)
        assert counts.total == sum(p.numel() for p in model.parameters())
        routed = sum(layer.experts.w_in.numel() * 3 for layer in model.moe_layers().values())
        assert counts.routed_experts == routed and len(model.moe_layers()) == 1 + depth


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match=r"model.mtp_depth=11 must be between 0 \(off\) and model.seq_len - 2=10"):
        ModelConfig(**MODEL, mtp_depth=11).validate()
    with pytest.raises(ConfigError, match="model.mtp_loss_weight must be >= 0"):
        ModelConfig(**MODEL, mtp_loss_weight=-1.0).validate()
    from parallel.resolve import resolve_layout

    # pipeline stages (the modules on the last), sequence slices (the modules on the whole sequence) and the
    # vocabulary-split head are taken (each proved by a parity row)
    for layout in (["parallel.pp=2"], ["parallel.tp=2", "parallel.sequence_parallel=true"],
                   ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.vocab_parallel=true"]):
        resolve_layout(load_config("moe-8x", ["model.mtp_depth=1", *layout]), 2)
