"""The experts' exchange in two hops when the ep group spans nodes: a token crosses the network once per node.

``parallel/expert_dispatch.py`` sends a token once per destination *rank*. Where an ep group spans several nodes
with several of its ranks in each, a token whose experts sit on three ranks of one node crosses the network three
times with the same hidden state, and group-limited routing that keeps a token within M nodes (DeepSeek-V3,
arXiv:2412.19437, sec. 2.1.2 "node-limited routing") bounds the ranks it reaches, not its crossings, unless the
exchange deduplicates per node too. DeepSeek-V3's own layout is such a case: 256 experts over ep=64, 8 ranks per
node, a group of 32 experts per node; a token reaches up to 8 ranks on at most 4 nodes. Its report (sec. 3.2.2)
sends each token once per destination node over InfiniBand, to the GPU with the same in-node index, and forwards
it over NVLink to the GPUs holding its experts. This module does the same with torch collectives:

    hop 1 (across nodes, the ``inter`` group: the ep ranks with this rank's in-node position, one per node):
        the pair exchange with a node as the destination: one row per (token, node), and each assignment's
        in-node expert (code) and fp32 weight (``plan_pairs`` with the node's experts as "local")
    hop 2 (inside the node, the ``intra`` group: the ep ranks of this node): the forwarder treats each received
        row as a token and its assignments as that token's routing: one row per (received row, rank), each
        assignment's local expert and weight
    experts, then the combine in reverse: each rank adds its local experts' weighted outputs per pair, one row
    per pair returns to the forwarder, which adds a received row's in-node rows; one row per (token, node)
    returns home, and home adds a token's node rows

Every sum is a gather in a fixed order (``moe.dispatch.sum_choices``), so the result is the same on every run: the
sums of one process's combine in another order (per rank, per node, over nodes), equal to it and to the one-hop
exchange within rounding. Autograd runs it backward: each all-to-all's gradient is the same exchange reversed, so
backward crosses the network once per (token, node) too. Each hop exchanges its counts and reads its split sizes on
the host (two syncs per forward, where the one-hop exchange has one: hop 2's counts depend on what hop 1 brought).

The rule for when it runs (``parallel.expert.exchanges_by_node``): the pair exchange runs (``exchanges_pairs``),
and ``parallel.ranks.expert_nodes`` cuts every ep group into at least 2 nodes with the same number, at least 2,
of its ranks in each (nodes of ``ranks_per_node`` consecutive ranks). Within one node, or with one ep rank per node
(there the pair exchange already crosses once per node), the one-hop pair exchange stays: a second hop would only
add an in-node copy. What it costs: the in-node hop moves each (token, rank) pair's row over NVLink that the
one-hop exchange moved over the network, plus the codes and weights twice.

Shapes: T tokens, k choices, L local experts per rank, m ep ranks per node; P1' rows a forwarder receives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from config.errors import ConfigError
from moe.dispatch import DispatchPlan, count_per_expert
from parallel.expert_dispatch import combine_at_experts, plan_pairs, received_pairs, return_pairs, send_pairs
from parallel.runtime import launch_environment


def check_ranks_per_node(ranks_per_node: int | None, world_size: int) -> None:
    """``parallel.ranks_per_node`` must cut the world into whole nodes, as torchrun's ``--nproc-per-node`` does."""
    if ranks_per_node is not None and world_size % ranks_per_node:
        raise ConfigError(f"parallel.ranks_per_node={ranks_per_node} does not divide the world of {world_size} ranks "
                          f"into whole nodes; valid: a divisor of {world_size}, or null (torchrun's LOCAL_WORLD_SIZE)")


def node_size(ranks_per_node: int | None) -> int:
    """Ranks per node at run time: ``parallel.ranks_per_node`` where set (nodes simulated on one machine), else
    torchrun's LOCAL_WORLD_SIZE (1 in a process launched without it)."""
    return ranks_per_node or launch_environment().local_world_size


@dataclass
class ForwardedAssignments:
    """The assignments a forwarder received in hop 1, as ``plan_pairs`` reads kept assignments: each received row is
    a token, its assignments that token's routing over the node's experts."""

    order: Tensor  # [A'] received assignments grouped by in-node expert (indices into the received weights)
    token_index: Tensor  # [A'] the received row each reads
    tokens_per_expert: Tensor  # [m·L] received assignments per expert of the node


def forwarded_assignments(code: Tensor, node_experts: int) -> ForwardedAssignments:
    """Hop 1's received codes [A'] (pair-major: in-node expert · 2 + opens) -> hop 2's kept assignments."""
    _, row = received_pairs(code)
    expert = code // 2
    order = torch.sort(expert, stable=True).indices
    return ForwardedAssignments(order, row[order], count_per_expert(expert, node_experts))


def exchange_by_node(tokens: Tensor, plan: DispatchPlan, weights: Tensor, num_local: int, intra: dist.ProcessGroup,
                     inter: dist.ProcessGroup, local_ffn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """tokens [T, D] in the experts' compute dtype, weights [T, k] -> the routed output [T, D], in two hops.

    ``local_ffn(rows, tokens_per_local_expert)`` runs this rank's L experts on rows grouped local-expert-major.
    """
    num_tokens, top_k = weights.shape
    node_experts = num_local * dist.get_world_size(intra)
    across = plan_pairs(plan, num_tokens, top_k, node_experts, inter)  # destinations: nodes
    rows, code, weight = send_pairs(tokens, weights.reshape(-1), across, inter)  # [P1', D], [A'], [A']
    within = plan_pairs(forwarded_assignments(code, node_experts), rows.shape[0], top_k, num_local, intra)
    rows, code, weight = send_pairs(rows, weight, within, intra)
    combined = combine_at_experts(rows, code, weight, within.tokens_per_local_expert, min(top_k, num_local),
                                  local_ffn)
    node_rows = return_pairs(combined, within, intra)  # [P1', D]: each received row's in-node experts, added
    return return_pairs(node_rows, across, inter)
