"""What replicating hot experts (``parallel.ep_replicas``) saves and costs per MoE layer and micro-batch, and the R
that pays best.

Under expert parallelism every rank waits, at the combine, for the busiest ep rank: the routed experts' time of a
layer is the balanced time × the imbalance (the busiest rank's rows over the mean). Replicas bring the imbalance
down (``parallel.replication.plan_replicas``; measured from counts by ``benchmarks/ep_replication.py``) and cost the
copies: the busiest sender's experts to the slots in forward and their gradients back in backward, on the ep link,
on the critical path (the copy waits for the counts, the GEMM for the copy). So with R slots:

    time(R) = expert_seconds × imbalance_after(R) + 2 × experts_sent(R) × expert_bytes / bandwidth

and R = 0 costs expert_seconds × imbalance_before. ``choose_replicas`` takes the least; 0 where no R pays.
The planner (``analysis/layout_search.py``) asks ``straggler_wait`` for each plan with ep > 1: R in {0, 1, 2}
priced so against a stated imbalance (``IMBALANCE``, ``--imbalance``), the chosen R in the plan's command.
The step-time model (``analysis/step_time.py``) prices balanced routing and leaves imbalance out, so these are
the terms it would add per MoE layer and micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from analysis.gpu_presets import Hardware
from analysis.memory_activations import COMPUTE_DTYPE, expert_weight_elements
from analysis.memory_states import local_layers
from config.model import MoEConfig
from config.run import RunConfig
from parallel.hardware import planned_precision
from parallel.layout import Layout


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


def least_time(options: list[ReplicaOption], expert_s: float, expert_bytes: int, bandwidth: float) -> ReplicaOption:
    """The option of least ``layer_seconds``; the smaller R on a tie."""
    return min(options, key=lambda o: (layer_seconds(o, expert_s, expert_bytes, bandwidth), o.replicas))


def best_replicas(imbalance_before: float, options: list[ReplicaOption], expert_s: float, expert_bytes: int,
                  bandwidth: float) -> ReplicaOption:
    """The option of least ``layer_seconds`` (R = 0: ``imbalance_before``, no copies); the smaller R on a tie."""
    return least_time([ReplicaOption(0, imbalance_before, 0.0), *options], expert_s, expert_bytes, bandwidth)


def choose_replicas(imbalance_before: float, options: list[ReplicaOption], expert_s: float, expert_bytes: int,
                    bandwidth: float) -> int:
    """The R of ``best_replicas``: 0 where no R pays."""
    return best_replicas(imbalance_before, options, expert_s, expert_bytes, bandwidth).replicas


# The planner's routing assumption (``--imbalance``): the busiest ep rank's rows over the mean without replicas.
# IMBALANCE, what to ask for (the default is 1, forced balance), is benchmarks/ep_replication.py's skewed routing
# at ep=8 (1.329; docs/parallelism.md's table). What
# R slots leave of the excess over balanced, and how many experts the busiest sender copies per layer and
# micro-batch, come from the same row: R=1 leaves 1.070 (0.21 of the excess), R=2 1.014 (0.04); the copies are 0.56
# of a rank's dispatch bytes with either R at 4,096 tokens of DeepSeek-V3's shapes, i.e. 3 experts
# (tests/benchmarks/test_ep_replication.py recomputes them from that row). A trained 64-expert model's real routing
# leaves less of its excess at ep 8-64 (R=1: 0.03-0.15, R=2: 0.005-0.05), so R is priced on the pessimistic side.
IMBALANCE = 1.3
EXCESS_LEFT = {1: 0.21, 2: 0.04}
EXPERTS_SENT = {1: 3.0, 2: 3.0}
REPLICA_CHOICES = (0, *EXCESS_LEFT)  # the R the planner prices


def replica_options(imbalance_before: float) -> list[ReplicaOption]:
    """R = 1 and 2 under the stated assumption: each leaves its share of the excess over balanced."""
    return [ReplicaOption(r, 1 + (imbalance_before - 1) * left, EXPERTS_SENT[r]) for r, left in EXCESS_LEFT.items()]


@dataclass(frozen=True)
class StragglerWait:
    """What a step waits for the busiest ep rank beyond balanced routing, with the R that makes it least."""

    replicas: int
    seconds: float


def straggler_wait(config: RunConfig, layout: Layout, micro_batch_size: int, microbatches: int,
                   hardware: Hardware, gpus_per_node: int, efficiency: float, imbalance_before: float,
                   allowed: tuple[int, ...] = REPLICA_CHOICES) -> StragglerWait:
    """Per step, on the stage with the most MoE layers: each layer and micro-batch costs ``layer_seconds`` of the
    R chosen among ``allowed`` (the least time, the smaller R on a tie; one R: that one) less its balanced time.
    A rank's routed rows are its tokens' (micro-batch × S / cp) × k, shared by its tp ranks (rows over tp / etp,
    hidden over etp); the copies are one expert's etp-shard in the compute dtype on the ep link: NVLink where the ep
    group (tp · ep contiguous ranks) fits a node, else the rank's network adapter. Recompute of the MoE layers is
    not priced. Zero without expert parallelism or with balanced routing."""
    if layout.ep == 1 or imbalance_before <= 1 or config.model.n_moe_layers == 0:
        return StragglerWait(0, 0.0)
    model, moe = config.model, config.moe
    tokens = micro_batch_size * model.seq_len // layout.cp
    expert_s = expert_seconds(moe, model.d_model, tokens, hardware.bf16_flops * efficiency) / layout.tp
    compute = COMPUTE_DTYPE[planned_precision(config.train.precision)].itemsize
    expert_bytes = expert_weight_elements(model, moe, layout.etp) * compute
    if layout.tp * layout.ep <= gpus_per_node:
        bandwidth = hardware.intra_node * hardware.intra_efficiency
    else:
        bandwidth = hardware.inter_node * hardware.network_efficiency
    options = [o for o in (ReplicaOption(0, imbalance_before, 0.0), *replica_options(imbalance_before))
               if o.replicas in allowed]
    option = least_time(options, expert_s, expert_bytes, bandwidth)
    layers = max(sum(1 for i in local_layers(config, layout, stage)[0] if model.is_moe_layer(i))
                 for stage in range(layout.pp))
    extra = layer_seconds(option, expert_s, expert_bytes, bandwidth) - expert_s
    return StragglerWait(option.replicas, layers * microbatches * extra)
