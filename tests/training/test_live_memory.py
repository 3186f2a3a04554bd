"""The live tensor peak a CPU run logs (``training/live_memory.py``): exact on tensors of known sizes, measured on
the session's steps 1, 2, 4, 8, ..., and within 10% of the memory model's prediction (the banner's) for three
tiny runs: a capacity-limited MoE (balanced routing, bf16), a dense model (fp32) and dropless experts under
multi-head latent attention (bf16)."""

from __future__ import annotations

import json

import pytest
import torch

import train
from training.live_memory import LiveTensorPeak, live_tensor_bytes, measured_step

MB = 1_000_000


def test_the_peak_is_the_live_bytes_at_the_fullest_moment(capfd):
    """A tensor alive before the step, one freed inside it and the temporaries of an operator: the peak is what
    was alive at once, to the byte, whatever was freed before the peak; a tensor freed inside the step that the
    step did not allocate is counted until the end (c10 says nothing about it)."""
    before = torch.ones(MB, dtype=torch.uint8)  # 1 MB, alive when the step starts and freed inside it
    peak = LiveTensorPeak(torch.device("cpu"))
    start = live_tensor_bytes()
    with peak.measure():
        a = torch.ones(2 * MB, dtype=torch.uint8)
        b = a.to(torch.int32)  # 8 MB
        del a, before
        c = b + b  # 8 MB more: 1 + 8 + 8 alive at once
        del b, c
    assert peak.peak == start + 16 * MB
    assert "unknown size" not in capfd.readouterr().err


def test_the_steps_measured_are_the_powers_of_two():
    assert [count for count in range(1, 40) if measured_step(count)] == [1, 2, 4, 8, 16, 32]
    peak = LiveTensorPeak(torch.device("cpu"))
    for size in (1, 2, 6, 4, 7):  # steps 1, 2 and 4 measured: their largest is 4 MB; steps 3 and 5 are not
        with peak.measure():
            held = torch.ones(size * MB, dtype=torch.uint8)
            del held
    assert peak.peak == live_tensor_bytes() + 4 * MB


TINY = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64", "model.ffn_hidden=128",
        "moe.num_experts=4", "moe.expert_hidden=64", "train.global_batch_size=16", "train.steps=2",
        "train.eval_batches=1", "train.eval_interval=0", "logging.wandb=disabled", "logging.progress=lines",
        "logging.plots=false", "logging.log_interval=1", "checkpoint.final=false", "checkpoint.interval=null"]
MLA = ["model.n_kv_heads=null", "model.kv_lora_rank=32", "model.q_lora_rank=48", "model.qk_nope_head_dim=16",
       "model.qk_rope_head_dim=8", "model.v_head_dim=16"]


@pytest.mark.parametrize("config, overrides", [
    ("moe-8x", ["moe.force_balance=true", "train.precision=bf16"]),
    ("dense", ["train.precision=fp32"]),
    ("dropless", [*MLA, "train.precision=bf16"]),
], ids=["capacity-bf16", "dense-fp32", "dropless-mla-bf16"])
def test_the_banners_prediction_is_within_10_percent_of_the_measured_live_peak(tmp_path, capsys, config, overrides):
    """The banner predicts live tensor bytes and the run measures live tensor bytes (perf/memory_peak_gib, logged
    at each step and in the summary); the resident peak beside it is another, larger quantity."""
    assert train.main(["--config", config, "--run-dir", str(tmp_path), "--set", *TINY, *overrides]) == 0
    err = capsys.readouterr().err
    assert "of live tensors per rank" in err and "live tensor peak of its steps 1, 2, 4, 8" in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    predicted, measured = summary["perf/memory_predicted_gib"], summary["perf/memory_peak_gib"]
    assert abs(measured / predicted - 1) < 0.10, (predicted, measured)
    assert summary["perf/memory_resident_peak_gib"] > 5 * measured  # the interpreter and torch's libraries too
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["perf/memory_peak_gib"] for r in logged if "perf/memory_peak_gib" in r][-1] == measured
