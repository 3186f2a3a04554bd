"""Interval routing statistics against a naive reference, and the columnar .npy files they are kept in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from config.model import ModelConfig, MoEConfig
from moe.transformer import MoETransformer
from training.metrics import MetricsLogger
from training.routing_log import RoutingLog
from training.routing_stats import RoutingAccumulator, append_rows, balancing_biases, read_routing, routing_metrics


def _tiny_model(top_k: int, capacity_factor: float | None, bias_rate: float = 0.0) -> MoETransformer:
    torch.manual_seed(0)
    model = ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, ffn_hidden=64)
    moe = MoEConfig(num_experts=4, top_k=top_k, expert_hidden=16, capacity_factor=capacity_factor,
                    bias_update_rate=bias_rate)
    return MoETransformer(model, moe)


def _micro_batches(model: MoETransformer, count: int, batch: int = 3, seed: int = 100) -> list[dict]:
    """Run ``count`` micro-batches of random bytes; return each one's routing statistics by layer."""
    seen = []
    for m in range(count):
        torch.manual_seed(seed + m)
        with torch.no_grad():
            model(torch.randint(0, 256, (batch, 16)))
        seen.append({i: s for i, s in model.routing_stats().items()})
    return seen


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 1.0), (2, 0.75), (2, None)])
def test_interval_figures_match_a_naive_reduction(top_k, capacity_factor):
    model = _tiny_model(top_k, capacity_factor)
    accumulator = RoutingAccumulator()
    batches = []
    for m, batch in enumerate((3, 1, 2)):  # unequal micro-batches: means must weight by tokens
        stats = _micro_batches(model, 1, batch, seed=m)[0]
        accumulator.add(stats)
        batches.append(({i: s.tokens_per_expert.tolist() for i, s in stats.items()},
                        {i: (int(s.num_dropped), s.num_assignments, float(s.entropy), float(s.top1_prob),
                             s.choice_share.tolist(), float(s.aux_loss), float(s.z_loss),
                             None if s.coselection is None else s.coselection.tolist()) for i, s in stats.items()},
                        batch * 16))
    result = accumulator.reduce()
    assert result.layers.tolist() == [0, 1]
    metrics = routing_metrics(result)
    for n, layer in enumerate((0, 1)):
        load = [sum(b[0][layer][e] for b in batches) for e in range(4)]
        total_tokens = sum(b[2] for b in batches)
        dropped = sum(b[1][layer][0] for b in batches)
        assignments = sum(b[1][layer][1] for b in batches)
        mean_load = sum(load) / 4
        entropy = sum(b[1][layer][2] * b[2] for b in batches) / total_tokens
        top1 = sum(b[1][layer][3] * b[2] for b in batches) / total_tokens
        shares = [sum(b[1][layer][4][j] * b[2] for b in batches) / total_tokens for j in range(top_k)]
        per_batch_maxvio = [(max(b[0][layer]) - sum(b[0][layer]) / 4) / (sum(b[0][layer]) / 4) for b in batches]

        assert result.tokens_per_expert[n].tolist() == load
        assert metrics[f"router/layer{layer}/load"] == pytest.approx([x / sum(load) for x in load])
        assert metrics[f"router/layer{layer}/imbalance"] == pytest.approx(max(load) / mean_load)
        assert metrics[f"router/layer{layer}/maxvio"] == pytest.approx((max(load) - mean_load) / mean_load)
        assert result.maxvio_batch[n] == pytest.approx(sum(per_batch_maxvio) / 3)
        assert metrics[f"router/layer{layer}/dropped"] == pytest.approx(dropped / assignments)
        assert metrics[f"router/layer{layer}/entropy"] == pytest.approx(entropy)
        assert metrics[f"router/layer{layer}/top1_prob"] == pytest.approx(top1)
        assert result.choice_share[n].tolist() == pytest.approx(shares)
        assert result.aux_loss[n] == pytest.approx(sum(b[1][layer][5] for b in batches) / 3)
        assert result.z_loss[n] == pytest.approx(sum(b[1][layer][6] for b in batches) / 3)
        if top_k == 1:
            assert result.coselection is None
        else:
            expected = np.sum([b[1][layer][7] for b in batches], axis=0)
            np.testing.assert_array_equal(result.coselection[n], expected)
        if capacity_factor is None:
            assert dropped == 0
    assert metrics["train/dropped_frac"] == pytest.approx(float(result.dropped.sum() / result.assignments.sum()))
    assert metrics["train/aux_loss"] == pytest.approx(float(result.aux_loss.mean()))


def test_no_moe_layer_gives_zero_losses_and_no_router_keys():
    assert RoutingAccumulator().reduce() is None
    assert routing_metrics(None) == {"train/aux_loss": 0.0, "train/z_loss": 0.0}


def test_append_rows_grows_a_loadable_npy_and_refuses_another_shape(tmp_path):
    path = tmp_path / "x.npy"
    chunks = [np.arange(6, dtype=np.int64).reshape(2, 3) + 10 * n for n in range(12)]
    for chunk in chunks:
        append_rows(path, chunk)
    np.testing.assert_array_equal(np.load(path), np.concatenate(chunks))
    np.testing.assert_array_equal(np.load(path, mmap_mode="r")[-2:], chunks[-1])
    with pytest.raises(ValueError, match="another shape.*new --run-dir"):
        append_rows(path, np.zeros((1, 4), dtype=np.int64))

    # a run killed after writing rows but before updating the header: the file still loads, and the
    # next append overwrites the orphaned bytes
    with open(path, "ab") as handle:
        handle.write(b"\x01" * 20)
    np.testing.assert_array_equal(np.load(path), np.concatenate(chunks))
    append_rows(path, chunks[0])
    np.testing.assert_array_equal(np.load(path), np.concatenate([*chunks, chunks[0]]))


def test_routing_log_writes_one_row_per_layer_per_interval(tmp_path):
    model = _tiny_model(2, 1.0, bias_rate=0.01)
    logger = MetricsLogger(tmp_path, {}, "t", "disabled", "p")
    log = RoutingLog(tmp_path, logger, charts_every=0)
    results = []
    for step in (5, 10, 15):
        accumulator = RoutingAccumulator()
        for stats in _micro_batches(model, 2):
            accumulator.add(stats)
        for layer in model.moe_layers().values():  # biases that change between intervals
            layer.router.update_bias(torch.arange(4.0))
        results.append(accumulator.reduce(biases=balancing_biases(model)))
        log.append(step, results[-1])
    logger.close()

    fields = read_routing(tmp_path)
    assert fields["step"].tolist() == [5, 5, 10, 10, 15, 15] and fields["layer"].tolist() == [0, 1] * 3
    assert fields["tokens_per_expert"].shape == (6, 4) and fields["coselection"].shape == (6, 4, 4)
    assert fields["choice_share"].shape == (6, 2)
    np.testing.assert_array_equal(fields["tokens_per_expert"][4:], results[2].tokens_per_expert)
    np.testing.assert_allclose(fields["imbalance"][2:4], results[1].imbalance)
    np.testing.assert_allclose(fields["maxvio"], fields["imbalance"] - 1)
    bias = model.moe_layers()[1].router.expert_bias
    np.testing.assert_allclose(fields["expert_bias"][-1], bias.numpy())
    assert all(len(v) == 6 for v in fields.values())


def test_read_routing_names_the_folder_when_there_is_none(tmp_path):
    with pytest.raises(FileNotFoundError, match="no routing statistics"):
        read_routing(tmp_path)
