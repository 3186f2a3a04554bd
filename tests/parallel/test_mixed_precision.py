"""FSDP2 mixed precision as ``parallelize(..., param_dtype=bf16)`` applies it, observed while the model runs.

On 2 gloo ranks (dp_shard=2): during forward every FSDP unit's weights are bf16 except the routers', which
run on fp32 weights; the sharded master weights stay fp32 and their gradients arrive in fp32; the rotary
tables reach attention in fp32 (FSDP does not cast the blocks' inputs).
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from config.run import load_config
from moe.attention import AttentionKind
from moe.transformer import MoETransformer
from parallel import parallelize
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.tensor import lm_loss
from tests.parallel.parity import TINY
from tests.spawn import spawn


def _observe(rank: int, results: dict) -> None:
    config = load_config("moe-8x", [*TINY, "parallel.dp_shard=2", "moe.capacity_factor=null"])
    groups = ParallelGroups.build(Layout.resolve(2, dp_shard=2), "cpu")
    model = parallelize(MoETransformer(config.model, config.moe), groups, config.parallel, torch.bfloat16)
    seen: dict[str, set] = {"router": set(), "attention": set(), "experts": set(), "rope": set()}

    def attention(module, args) -> None:  # a pre-hook returning None leaves the inputs as they are
        seen["attention"].add(str(module.wq.weight.dtype))
        seen["rope"].add(str(args[1].dtype))

    def router(module, args) -> None:
        seen["router"].add(str(module.gate.dtype))

    def experts(module, args) -> None:
        seen["experts"].add(str(module.w_in.dtype))

    for module in model.modules():
        if isinstance(module, AttentionKind):
            module.register_forward_pre_hook(attention)
    for layer in model.moe_layers().values():
        layer.router.register_forward_pre_hook(router)
        layer.experts.register_forward_pre_hook(experts)
    tokens = torch.randint(0, config.model.vocab_size, (2, config.model.seq_len + 1),
                           generator=torch.Generator().manual_seed(rank))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    results[rank] = ({kind: sorted(dtypes) for kind, dtypes in seen.items()},
                     sorted({str(p.dtype) for p in model.parameters()}),
                     sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None}))


def test_fsdp_units_compute_in_bf16_and_the_routers_in_fp32():
    with mp.Manager() as manager:
        results = manager.dict()
        spawn(_observe, 2, results)
        results = dict(results)
    for rank in range(2):
        during, masters, grads = results[rank]
        assert during == {"router": ["torch.float32"], "attention": ["torch.bfloat16"],
                          "experts": ["torch.bfloat16"], "rope": ["torch.float32"]}, rank
        assert masters == ["torch.float32"] and grads == ["torch.float32"], rank
