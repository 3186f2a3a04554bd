"""The deduplicated token exchange of expert parallelism: a token travels once to each ep rank its experts live on.

``parallel/expert.py``'s row exchange sends one row per kept (token, expert) assignment, so a token whose k experts
share one rank crosses the link k times with the same hidden state. Here a rank sends each (token, destination rank)
*pair* once; the destination expands the row to its local experts, runs them, and adds their outputs weighted by the
router's weights before sending one row back; home adds the rows of its token's destinations. So dispatch and
combine, and both again in backward, move one row per pair instead of one per assignment: the bytes scale with the
ranks a token reaches, which group-limited routing bounds (DeepSeek-V3, arXiv:2412.19437, sec. 2.1.2 and 3.2.2;
``analysis/dispatch_reach.py``). A token's rows per rank fall from its assignments there to one.

Why combine at the destination rather than send each expert's output home: the output rows would be k per token
again (and their gradients in backward), where the weighted sum is one. It needs the weights at the destination:
one fp32 per kept assignment, sent with a code per assignment (its local expert, and whether it opens its pair),
against a row of D elements per assignment saved. Both are the same sums as one process's combine, in another order
(per destination, then over destinations, where one process adds a token's k products in choice order): equal in
exact arithmetic, and within rounding in floating point; every addition is a gather-and-add in a fixed order
(``moe.dispatch.sum_choices``), so the result is the same on every run.

One forward, ep ranks, L = E / ep local experts:

    1. counts:   one all-to-all of [ep, L + 1] int64: rows per local expert and pairs, for every destination
    2. splits:   pairs and assignments to send and receive (the one device-to-host sync)
    3. dispatch: the pairs' rows [P, D], each assignment's code and weight, all sent pair-major (destination,
                 token, then local expert)
    4. experts:  expand the rows to their assignments, local-expert-major, and run the grouped GEMM
    5. combine:  weight and add each pair's outputs there; one row per pair returns; home adds a token's rows

Capacity drops happened before (``moe.dispatch.plan_dispatch``, per expert, as one process drops), so only kept
assignments form pairs; a token with no kept assignment gets zeros, as one process gives it.

Shapes: T tokens, k choices, N kept assignments, P pairs sent, P' pairs received, A' assignments received.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from moe.dispatch import DispatchPlan, count_per_expert, sum_choices


class KeptAssignments(Protocol):
    """What ``plan_pairs`` reads of a dispatch plan (``moe.dispatch.DispatchPlan`` is one; the two-hop exchange
    builds another from the assignments a node receives, ``parallel/node_dispatch.py``)."""

    order: Tensor  # [N] the kept assignments (indices into the flattened weights), grouped by expert
    token_index: Tensor  # [N] the token each reads
    tokens_per_expert: Tensor  # [E] int64, kept assignments per expert


@dataclass
class PairPlan:
    """One forward's deduplicated exchange, built by ``plan_pairs`` and used by that call only."""

    send_pairs: list[int]  # [ep] (token, rank) pairs this rank sends to each rank
    recv_pairs: list[int]  # [ep] pairs it receives from each
    send_assignments: list[int]  # [ep] kept assignments behind the pairs it sends
    recv_assignments: list[int]  # [ep] assignments behind the pairs it receives
    pair_token: Tensor  # [P] the token each sent pair carries, destination-major then by token
    assignment: Tensor  # [N] the kept assignments (``plan.order``'s t·k + j) in sending order: pair-major, local expert
    code: Tensor  # [N] int64, per sent assignment: local expert · 2 + 1 if it opens its pair
    token_pairs: Tensor  # [T, min(k, ep)] the pairs each token's output adds, destination order; P where none
    tokens_per_local_expert: Tensor  # [L] received assignments per local expert (the grouped GEMM's sizes)


def _position_in_run(opens: Tensor) -> Tensor:
    """For a sequence cut into runs (``opens`` [n] bool marks each run's first element): each element's index
    within its run. A running maximum of the openers' indices, so no device-to-host sync."""
    index = torch.arange(opens.numel(), device=opens.device)
    return index - torch.cummax(torch.where(opens, index, 0), 0).values


def _slots(run: Tensor, position: Tensor, runs: int, width: int, empty: int) -> Tensor:
    """[runs, width] of element indices, element i at (run[i], position[i]); ``empty`` where a run is shorter."""
    slots = run.new_full((runs * width,), empty)
    slots[run * width + position] = torch.arange(run.numel(), device=run.device)
    return slots.view(runs, width)


def plan_pairs(plan: KeptAssignments, num_tokens: int, top_k: int, num_local: int,
               group: dist.ProcessGroup) -> PairPlan:
    """Steps 1-2: group the kept assignments into (token, destination) pairs and exchange their counts.

    A destination is a rank of ``group`` holding ``num_local`` consecutive experts of ``plan``'s; ``top_k``: the most
    assignments one token has."""
    ep = dist.get_world_size(group)
    device = plan.order.device
    experts = torch.arange(plan.tokens_per_expert.numel(), device=device)
    expert = torch.repeat_interleave(experts, plan.tokens_per_expert, output_size=plan.order.numel())  # [N]
    # one key per kept assignment, ordered (destination, token, local expert); unique, as a token's experts are
    key = ((expert // num_local) * num_tokens + plan.token_index) * num_local + expert % num_local
    key, by_key = torch.sort(key)
    pair_key = key // num_local  # destination · T + token
    opens = torch.ones_like(pair_key, dtype=torch.bool)
    opens[1:] = pair_key[1:] != pair_key[:-1]
    pair_key = pair_key[opens]  # [P]

    send = torch.cat([plan.tokens_per_expert.view(ep, num_local),
                      count_per_expert(pair_key // num_tokens, ep).unsqueeze(1)], 1).contiguous()  # [ep, L + 1]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # NOTE: the exchange's one device-to-host sync, as in ``parallel.expert.plan_exchange``: the collectives need
    # their split sizes as host integers
    send_assignments, recv_assignments, send_pairs, recv_pairs = torch.stack(
        [send[:, :-1].sum(1), recv[:, :-1].sum(1), send[:, -1], recv[:, -1]]).tolist()

    pair_token = pair_key % num_tokens
    # each token's pairs in destination order: pair_key is destination-major, so a stable sort by token keeps it
    by_token = torch.sort(pair_token, stable=True).indices
    sorted_tokens = pair_token[by_token]
    token_opens = torch.ones_like(sorted_tokens, dtype=torch.bool)
    token_opens[1:] = sorted_tokens[1:] != sorted_tokens[:-1]
    token_pairs = by_token.new_full((num_tokens * min(top_k, ep),), pair_key.numel())
    token_pairs[sorted_tokens * min(top_k, ep) + _position_in_run(token_opens)] = by_token
    return PairPlan(
        send_pairs=send_pairs, recv_pairs=recv_pairs,
        send_assignments=send_assignments, recv_assignments=recv_assignments,
        pair_token=pair_token,
        assignment=plan.order[by_key],
        code=(key % num_local) * 2 + opens,
        token_pairs=token_pairs.view(num_tokens, min(top_k, ep)),
        tokens_per_local_expert=recv[:, :-1].sum(0),
    )


def all_to_all_rows(x: Tensor, send_splits: list[int], recv_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Uneven all-to-all along dim 0, differentiable: [sum(send_splits), ...] -> [sum(recv_splits), ...]; both
    exchanges of expert parallelism use it (rows, pairs, their codes and weights).

    torch's functional collective (the one ``torch.distributed.nn.functional``'s deprecation points to):
    autograd-aware, its backward the same exchange with the splits swapped, and traceable by
    ``torch.compile``. It returns before the data has arrived; the first use of the result waits.
    """
    return funcol.all_to_all_single(x.contiguous(), recv_splits, send_splits, group)


def send_pairs(tokens: Tensor, weights: Tensor, pairs: PairPlan,
               group: dist.ProcessGroup) -> tuple[Tensor, Tensor, Tensor]:
    """Step 3: tokens [T, D], the assignments' weights flattened [T·k] -> what arrives: the pairs' rows [P', D], each
    received assignment's code [A'] and fp32 weight [A'] (its gradient returns to the router), all pair-major."""
    rows = all_to_all_rows(tokens.index_select(0, pairs.pair_token), pairs.send_pairs, pairs.recv_pairs, group)
    code = all_to_all_rows(pairs.code, pairs.send_assignments, pairs.recv_assignments, group)
    weight = all_to_all_rows(weights.index_select(0, pairs.assignment), pairs.send_assignments,
                             pairs.recv_assignments, group)
    return rows, code, weight


def received_pairs(code: Tensor) -> tuple[Tensor, Tensor]:
    """Of the received assignments [A'] (pair-major): whether each opens its pair, and the pair it reads."""
    opens = code % 2 == 1
    return opens, torch.cumsum(opens, 0) - 1


def combine_at_experts(rows: Tensor, code: Tensor, weight: Tensor, tokens_per_local_expert: Tensor, width: int,
                       local_ffn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Steps 4-5 at the experts' rank: the received pairs' rows [P', D] -> one weighted sum per pair [P', D].

    ``width``: the most assignments one pair carries here, min(k, L).
    """
    # 4. experts: received assignments are pair-major; the grouped GEMM wants them by local expert
    opens, pair = received_pairs(code)
    expert_major = torch.sort(code // 2, stable=True).indices
    out = local_ffn(rows.index_select(0, pair[expert_major]), tokens_per_local_expert)
    pair_major = torch.empty_like(expert_major)
    pair_major[expert_major] = torch.arange(expert_major.numel(), device=expert_major.device)

    # 5. combine: weight each output, add a pair's in local-expert order
    scaled = out.index_select(0, pair_major) * weight.to(out.dtype).unsqueeze(1)  # [A', D] pair-major
    scaled = torch.cat([scaled, scaled.new_zeros(1, scaled.shape[1])])  # the row short pairs read
    return sum_choices(scaled, _slots(pair, _position_in_run(opens), rows.shape[0], width, out.shape[0]))


def return_pairs(combined: Tensor, pairs: PairPlan, group: dist.ProcessGroup) -> Tensor:
    """Step 5's way home: one row per received pair [P', D] returns to its sender, which adds each token's rows in
    destination order -> [T, D] (zeros for a token without pairs)."""
    returned = all_to_all_rows(combined, pairs.recv_pairs, pairs.send_pairs, group)  # [P, D]
    returned = torch.cat([returned, returned.new_zeros(1, returned.shape[1])])  # what a token without pairs reads
    return sum_choices(returned, pairs.token_pairs)


def exchange_pairs(tokens: Tensor, plan: DispatchPlan, weights: Tensor, num_local: int, group: dist.ProcessGroup,
                   local_ffn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Steps 1-5: tokens [T, D] in the experts' compute dtype, weights [T, k] -> the routed output [T, D].

    ``local_ffn(rows, tokens_per_local_expert)`` runs this rank's experts on rows grouped local-expert-major.
    """
    num_tokens, top_k = weights.shape
    pairs = plan_pairs(plan, num_tokens, top_k, num_local, group)
    rows, code, weight = send_pairs(tokens, weights.reshape(-1), pairs, group)
    combined = combine_at_experts(rows, code, weight, pairs.tokens_per_local_expert, min(top_k, num_local), local_ffn)
    return return_pairs(combined, pairs, group)
