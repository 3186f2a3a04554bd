"""What replicating hot experts (``parallel.ep_replicas``) saves and costs per MoE layer and micro-batch, and the R
that pays best.

Under expert parallelism every rank waits, at the combine, for the busiest ep rank: the routed experts' time of a
layer is the balanced time × the imbalance (the busiest rank's rows over the mean). Replicas bring the imbalance
down (``parallel.replication.plan_replicas``; measured from counts by ``benchmarks/ep_replication.py``) and cost the
copies: the busiest sender's experts to the slots in forward and their gradients back in backward, on the ep link,
on the critical path (the copy waits for the counts, the GEMM for the copy). So with R slots:

    time(R) = expert_seconds × imbalance_after(R) + 2 × experts_sent(R) × expert_bytes / bandwidth

and R = 0 costs expert_seconds × imbalance_before. ``choose_replicas`` takes the least; 0 where no R pays.
The step-time model (``analysis/step_time.py``) prices balanced routing and leaves imbalance out, so these are
the terms it would add per MoE layer and micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from config.model import MoEConfig


def expert_seconds(moe: MoEConfig, d_model: int, tokens_per_rank: int, flops: float) -> float:
    """One MoE layer's routed-expert forward and backward on one ep rank under balanced routing: the rank computes
    as many rows as its tokens make (tokens × k), each 2 FLOPs per weight element forward and 4 backward, over its
    ``flops`` (FLOP/s achieved)."""
    matrices = 3 if moe.gated else 2
    return 6 * matrices * d_model * moe.expert_hidden * moe.top_k * tokens_per_rank / flops


@dataclass(frozen=True)
class ReplicaOption:
    """One R as measured on counts: the imbalance it leaves and the experts the busiest sender copies."""

    replicas: int
    imbalance: float
    experts_sent: float


def layer_seconds(option: ReplicaOption, expert_s: float, expert_bytes: int, bandwidth: float) -> float:
    """The routed experts' time of one layer and micro-batch with ``option``'s replicas: the straggler's compute
    and the copies both ways."""
    return expert_s * option.imbalance + 2 * option.experts_sent * expert_bytes / bandwidth


def choose_replicas(imbalance_before: float, options: list[ReplicaOption], expert_s: float, expert_bytes: int,
                    bandwidth: float) -> int:
    """The R of least ``layer_seconds`` (0: no replicas, ``imbalance_before``, no copies); the smaller R on a tie."""
    best = ReplicaOption(0, imbalance_before, 0.0)
    for option in sorted(options, key=lambda o: o.replicas):
        if layer_seconds(option, expert_s, expert_bytes, bandwidth) < layer_seconds(best, expert_s, expert_bytes,
                                                                                     bandwidth):
            best = option
    return best.replicas
