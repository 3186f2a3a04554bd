"""Gated DeltaNet under context parallelism against one process: the state maps against the rule run from a state,
and cp ranks emulated by threads in one process (their all-gather a concatenation inside one autograd graph, so
gradients cross "ranks" as the reduce-scatter would carry them) against the whole sequence, forward and gradients.
The distributed runs are tests/parallel/test_parity.py's cp rows."""

import threading

import pytest
import torch

from config.model import ModelConfig
from moe.attention.delta_rule import gated_delta_rule, state_map
from moe.attention.delta_rule_shards import sharded_gated_delta_rule
from moe.documents import documents_of
from moe.sequence_shards import SequenceShards
from tests.moe.test_gated_delta import HYBRID, random_layer, rule_inputs


class ThreadRanks(torch.nn.Module):
    """cp ranks as threads: called on a tensor, concatenates every rank's along dim -2 in rank order, as
    ``parallel.context.SequenceGather`` does over processes (its backward is autograd's: each rank's slice gets the
    sum of every reader's gradient). A module, so that a layer can take it as its ``gather_sequence``; the calling
    thread's rank says which slot is its own."""

    def __init__(self, cp: int):
        super().__init__()
        self.cp, self.slots, self.barrier, self.local = cp, [None] * cp, threading.Barrier(cp), threading.local()

    def forward(self, x):
        self.slots[self.local.rank] = x
        self.barrier.wait()
        gathered = torch.cat(self.slots, dim=-2)
        self.barrier.wait()  # every rank has read the slots before any overwrites them
        return gathered

    def run(self, work):
        """work(rank) on every rank at once -> the results in rank order."""
        results, errors = [None] * self.cp, []

        def target(rank):
            self.local.rank = rank
            try:
                results[rank] = work(rank)
            except BaseException as error:  # noqa: BLE001 (re-raised below, on the test's thread)
                errors.append(error)
                self.barrier.abort()
        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(self.cp)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def unshard(pieces, cp: int, dim: int):
    """Each rank's positions (``SequenceShards.positions``) put back in sequence order along ``dim``."""
    seq = sum(piece.shape[dim] for piece in pieces)
    order = torch.cat([SequenceShards(cp, rank).positions(seq) for rank in range(cp)])
    return torch.cat(pieces, dim=dim).index_select(dim, torch.argsort(order))


def test_state_map_is_the_rule_from_any_state():
    q, k, v, g, b = (x.detach() for x in rule_inputs(9))
    start = torch.randn(2, 4, 8, 6)
    mapped = state_map(k, v, g, b, 4)
    transition, offset = mapped.split((8, 6), dim=-1)
    torch.testing.assert_close(transition @ start + offset, gated_delta_rule(q, k, v, g, b, 4, start)[1],
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(offset, gated_delta_rule(q, k, v, g, b, 4)[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [2, 3])
def test_sharded_rule_is_the_whole_sequences(cp):
    """Each rank's outputs at its positions and every input's gradient equal one process's run over the sequence
    (chunks of 3 positions by rule chunks of 4: each chunk's run pads)."""
    inputs = rule_inputs(6 * cp)
    whole, _ = gated_delta_rule(*inputs, 4)
    ranks = ThreadRanks(cp)

    def rank_outputs(rank):
        shards = SequenceShards(cp, rank)
        positions = shards.positions(6 * cp)
        return sharded_gated_delta_rule(*(x.index_select(2, positions) for x in inputs), 4, ranks, shards)
    sharded = unshard(ranks.run(rank_outputs), cp, dim=2)
    torch.testing.assert_close(sharded, whole, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1, 1, whole.numel()).view_as(whole)
    expected = torch.autograd.grad((whole * weights).sum(), inputs)
    for ours, theirs in zip(torch.autograd.grad((sharded * weights).sum(), inputs), expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("cp", "kernel"), [(2, 4), (4, 4)], ids=["chunks-of-4", "chunks-of-2-kernel-4"])
def test_layer_on_cp_ranks_is_one_process(cp, kernel):
    """The whole layer: each rank's outputs at its positions and the gradients of the input and every weight equal
    one process's, the convolution's inputs before each chunk taken from the ranks that hold them (with 2
    positions a chunk and kernel 4, from two chunks back)."""
    model = ModelConfig(**{**HYBRID, "linear_conv_kernel": kernel})
    layer = random_layer(model)
    x = torch.randn(2, 16, model.d_model, requires_grad=True)
    whole = layer(x, None, None)
    ranks = ThreadRanks(cp)
    ids = torch.zeros(2, 16, dtype=torch.long)
    table = torch.zeros(16, 1)

    layer.gather_sequence = ranks

    def rank_outputs(rank):
        shards = SequenceShards(cp, rank)
        return layer(shards.shard(x), None, None, documents=documents_of(ids, table, table, shards, masked=False))
    sharded = unshard(ranks.run(rank_outputs), cp, dim=1)
    torch.testing.assert_close(sharded, whole, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1, 1, whole.numel()).view_as(whole)
    leaves = [x, *layer.parameters()]
    expected = torch.autograd.grad((whole * weights).sum(), leaves)
    for ours, theirs in zip(torch.autograd.grad((sharded * weights).sum(), leaves), expected, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
