"""Weighted mixtures (data/mixture.py, the mixture side of data/sampler.py, data.sources).

The schedule's reference is written out here independently: every source's samples placed at their ideal positions
``(j + 1/2) / w_i`` in exact fractions and sorted (ties to the lower source), the Sainte-Laguë sequence the module
promises to compute in closed form. The samplers are checked on streams whose token values say which source a
window came from.
"""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
import yaml

import train
from config.errors import ConfigError
from config.run import load_config
from data.mixture import MixtureSchedule
from data.sampler import TokenSampler, eval_batches
from training.metrics import read_metrics

SEQ = 8
WEIGHTS = [0.5, 0.3, 0.2]


def reference_schedule(weights: list[int], n: int) -> list[tuple[int, int]]:
    """The first ``n`` (source, index) pairs of the merged ideal positions, in exact arithmetic."""
    total = sum(weights)
    entries = [(Fraction(2 * j + 1, 2) / Fraction(w, total), i, j)
               for i, w in enumerate(weights) for j in range(n * w // total + 2)]
    return [(i, j) for _, i, j in sorted(entries)[:n]]


@pytest.mark.parametrize("weights", [[5, 3, 2], [1, 1], [1, 1, 1], [14, 2, 2, 1, 1], [1, 2, 3, 4, 5, 6, 7]])
def test_the_schedule_is_the_exact_sainte_lague_sequence(weights):
    n = 3000
    schedule = MixtureSchedule(weights)
    source, index = schedule.locate(np.arange(n))
    # the reference takes the weights as the schedule rounded them (to 2^-20 of their total): exact ties stay ties
    assert list(zip(source.tolist(), index.tolist(), strict=True)) == reference_schedule(schedule.scaled.tolist(), n)
    # and any sample number alone, far into a run, agrees with its neighbourhood computed together
    far = np.arange(10**9, 10**9 + 500)
    alone = [MixtureSchedule(weights).locate(np.array([g])) for g in far[::97]]
    together = MixtureSchedule(weights).locate(far)
    assert [(int(s[0]), int(j[0])) for s, j in alone] == list(zip(together[0][::97].tolist(),
                                                                   together[1][::97].tolist(), strict=True))


@pytest.mark.parametrize("weights", [WEIGHTS, [0.7, 0.1, 0.1, 0.05, 0.05], [1, 1, 1]])
def test_proportions_hold_over_every_window_up_to_rounding(weights):
    schedule = MixtureSchedule(weights)
    n = 20_000
    source, _ = schedule.locate(np.arange(n))
    total = sum(weights)
    assert np.abs(schedule.proportions - np.array(weights) / total).max() < 2**-19  # the weights, rounded
    cumulative = np.vstack([np.zeros(len(weights), int), np.cumsum(np.eye(len(weights), dtype=int)[source], axis=0)])
    for window in (1, 10, 100, 1000, 10_000):
        counts = cumulative[window:] - cumulative[:-window]  # every window of this many consecutive samples
        assert np.abs(counts - window * schedule.proportions).max() < 2.5, window  # measured: at most 2.1
    assert schedule.counts(n).tolist() == np.bincount(source).tolist()


def streams(lengths=(4000, 3000, 2000)) -> list[np.ndarray]:
    """Source i's tokens are i*1000 + position % 1000: a window's first token says its source."""
    return [(i * 1000 + np.arange(n) % 1000).astype(np.uint16) for i, n in enumerate(lengths)]


def test_mixture_batches_come_from_the_scheduled_sources_and_are_layout_independent_and_resumable():
    data = streams()
    one = TokenSampler(data, SEQ, seed=3, weights=WEIGHTS, names=["a", "b", "c"])
    batches = [one.next_batch(20)[0] for _ in range(30)]
    sources = torch.cat(batches)[:, 0] // 1000
    expected, _ = MixtureSchedule(WEIGHTS).locate(np.arange(600))
    assert sources.tolist() == expected.tolist()
    assert one.source_counts() == {"a": 300, "b": 180, "c": 120}

    # two ranks, checkpointed after 10 batches, resumed on one process: exactly the uninterrupted samples
    ranks = [TokenSampler(data, SEQ, seed=3, dp_rank=r, dp_size=2, weights=WEIGHTS, names=["a", "b", "c"])
             for r in range(2)]
    for step in range(10):
        halves = [r.next_batch(20) for r in ranks]
        assert torch.equal(torch.cat([h[0] for h in halves]), batches[step])
        assert torch.equal(torch.cat([h[1] for h in halves])[:, :-1], batches[step][:, 1:])
    resumed = TokenSampler(data, SEQ, seed=3, weights=WEIGHTS, names=["a", "b", "c"])
    resumed.load_state_dict(json.loads(json.dumps(ranks[0].state_dict())))
    for step in range(10, 30):
        assert torch.equal(resumed.next_batch(20)[0], batches[step])

    # another mixture (or seed) would silently change the order: refused
    other = TokenSampler(data, SEQ, seed=3, weights=[0.4, 0.4, 0.2], names=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"mixture=.*does not match.*data\.sources \(names and weights\)"):
        other.load_state_dict(ranks[0].state_dict())


def test_each_source_goes_through_all_its_windows_before_repeating():
    data = streams((401, 241, 161))  # 50, 30 and 20 windows of 8
    sampler = TokenSampler(data, SEQ, seed=0, weights=WEIGHTS)
    rows = torch.cat([sampler.next_batch(10)[0] for _ in range(20)])  # 200 samples: 100, 60, 40, two epochs each
    for i, windows in enumerate((50, 30, 20)):
        starts = (rows[rows[:, 0] // 1000 == i][:, 0] % 1000).tolist()
        assert len(starts) == 2 * windows
        for epoch in (starts[:windows], starts[windows:]):  # each epoch: every window once
            assert sorted(epoch) == list(range(0, 8 * windows, 8))


def test_validation_is_fixed_and_shared_out_by_weight():
    data = streams()
    batches = list(eval_batches(data, SEQ, batch_size=10, num_batches=4, weights=WEIGHTS))
    again = list(eval_batches(data, SEQ, batch_size=10, num_batches=4, weights=WEIGHTS))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    sources = torch.cat([b[0] for b in batches])[:, 0] // 1000
    assert np.bincount(sources.numpy()).tolist() == [20, 12, 8]
    halves = [list(eval_batches(data, SEQ, 10, 4, dp_rank=r, dp_size=2, weights=WEIGHTS)) for r in range(2)]
    assert torch.equal(torch.cat([torch.cat([h[b][0] for h in halves]) for b in range(4)]),
                       torch.cat([b[0] for b in batches]))


@pytest.mark.parametrize(("sources", "message"), [
    ("[{path: a, weight: 0}]", r"data\.sources\[a\]\.weight=0\.0: must be positive"),
    ("[{path: a, weight: -1}]", r"data\.sources\[a\]\.weight=-1\.0: must be positive"),
    ("[{path: a, weight: .nan}]", r"data\.sources\[0\]\.weight: nan is not a finite number"),
    ("[{path: x/a}, {path: y/a}]", r"names \['a', 'a'\] repeat"),
    ("[{path: t.bin}]", r"data\.sources\[t\.bin\]\.token_dtype=None with path 't\.bin': a \.bin needs its dtype"),
    ("[{path: ''}]", r"\.path is empty"),
])
def test_bad_sources_are_refused_by_the_config(sources, message):
    with pytest.raises(ConfigError, match=message):
        load_config("moe-8x", [f"data.sources={sources}"])


@pytest.mark.parametrize(("validation", "message"), [
    ("[{path: a, name: loss}]", r"none may be 'loss'"),
    ("[{path: x/a}, {path: y/a}]", r"names \['a', 'a'\] must differ"),
    ("[{path: a, weight: 2}]", r"data\.validation\[a\]\.weight=2\.0: a validation set has no weight"),
    ("[{path: v.bin}]", r"data\.validation\[v\.bin\]\.token_dtype=None"),
    ("[{path: stdlib}]", r"data\.validation\[stdlib\]\.path='stdlib' is the training source 'stdlib': its loss "
                         r"would be measured on text the model trains on"),
])
def test_bad_validation_sets_are_refused_by_the_config(validation, message):
    with pytest.raises(ConfigError, match=message):
        load_config("moe-8x", [f"data.validation={validation}"])


def test_a_validation_set_that_is_a_training_source_or_a_bin_under_bpe_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("text")
    sources = f"[{{path: {tmp_path / 'a.txt'}}}, {{path: {tmp_path}/b}}]"
    with pytest.raises(ConfigError, match=r"is the training source '.*a\.txt'"):  # however the path is written
        load_config("moe-8x", [f"data.sources={sources}", f"data.validation=[{{path: {tmp_path}/./a.txt}}]"])
    with pytest.raises(ConfigError, match=r"data\.validation\[v\.bin\]: a \.bin is already tokenised \(by some "
                                          r"tokenizer\), so data\.tokenizer='bpe\.json' does not say"):
        load_config("moe-8x", ["data.tokenizer=bpe.json", "data.validation=[{path: v.bin, token_dtype: uint16}]"])


def test_a_mixture_and_data_source_together_are_refused():
    with pytest.raises(ConfigError, match=r"data\.source='x' and data\.sources: a mixture names every corpus"):
        load_config("moe-8x", ["data.source=x", "data.sources=[{path: a}]"])


TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.global_batch_size=4", "train.warmup_steps=0",
        "train.precision=fp32", "train.eval_interval=0", "train.eval_batches=1", "logging.wandb=disabled",
        "logging.log_interval=2", "logging.progress=lines", "train.steps=4", "data.val_fraction=0.2"]


def test_a_run_trains_on_a_mixture_and_logs_the_realised_shares(tmp_path, capsys):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "a.txt").write_bytes(bytes(range(32, 127)) * 40)
    with open(tmp_path / "chat.jsonl", "w") as out:
        for i in range(60):
            out.write(json.dumps({"text": f"record {i}: " + "lorem ipsum " * 5}) + "\n")
    sources = f"[{{path: {tmp_path / 'code'}, weight: 3}}, {{path: {tmp_path / 'chat.jsonl'}, weight: 1, name: chat}}]"
    (tmp_path / "held.txt").write_text("held out text, never trained on. " * 40)
    with open(tmp_path / "chat-held.jsonl", "w") as out:  # a training source is refused as a validation set
        for i in range(60):
            out.write(json.dumps({"text": f"held record {i}: " + "dolor sit amet " * 5}) + "\n")
    validation = f"[{{path: {tmp_path / 'held.txt'}, name: held}}, {{path: {tmp_path / 'chat-held.jsonl'}}}]"
    run = tmp_path / "run"
    assert train.main(["--run-dir", str(run), "--set", *TINY, f"data.sources={sources}",
                       f"data.validation={validation}", f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    err = capsys.readouterr().err
    assert "data: mixture of code (weight 0.7500, realised 0.7500), chat (weight 0.2500, realised 0.2500)" in err
    records = [r for r in read_metrics(run / "metrics.jsonl") if "data/share/code" in r]
    assert [(r["data/share/code"], r["data/share/chat"]) for r in records] == [(0.75, 0.25), (0.75, 0.25)]
    for r in records:  # each source's loss over its rows; weighted by its rows (3:1 here) they give the whole loss
        assert r["train/loss/code"] != r["train/loss/chat"]
        assert 0.75 * r["train/loss/code"] + 0.25 * r["train/loss/chat"] == pytest.approx(r["train/loss"], rel=1e-6)
    final = [r for r in read_metrics(run / "metrics.jsonl") if "val/loss" in r]
    assert len(final) == 1 and {"val/held", "val/chat-held.jsonl"} <= set(final[0])  # each named set, by its name
    assert final[0]["val/held"] != final[0]["val/chat-held.jsonl"]
    saved = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert [s["weight"] for s in saved["sources"]] == [3.0, 1.0] and saved["document_end"] == "\n\n"
