"""Too little memory for a layout is refused before any work, naming the stage, the bytes and layouts that fit."""

from __future__ import annotations

import json
import re

import pytest

import train
from analysis import fit_check
from analysis.fit_check import check_fits, predicted_bytes
from analysis.memory import GIB
from config.errors import ConfigError
from config.run import load_config
from parallel.resolve import resolve_layout

MODEL = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.seq_len=64", "model.ffn_hidden=128",
         "moe.num_experts=4", "moe.expert_hidden=64", "train.global_batch_size=16", "train.precision=fp32"]


def test_a_layout_that_does_not_fit_names_the_stage_the_bytes_and_layouts_that_fit():
    config = load_config("moe-8x", [*MODEL, "parallel.pp=2", "parallel.dp_shard=4"])
    needs = predicted_bytes(config, resolve_layout(config, 8), "fp32")
    assert check_fits(config, resolve_layout(config, 8), max(needs), "fp32") == needs  # exactly enough: accepted
    assert check_fits(config, resolve_layout(config, 8), None, "fp32") == needs  # unknown memory: no check
    available = max(needs) - 1
    with pytest.raises(ConfigError) as refused:
        check_fits(config, resolve_layout(config, 8), available, "fp32")
    message = str(refused.value)
    worst = needs.index(max(needs))
    assert f"the ranks of pipeline stage {worst}" in message
    assert f"need(s) {max(needs) / GIB:.2f} GiB" in message and f"has {available / GIB:.2f} GiB" in message
    suggested = re.findall(r"\(([\d.]+) GiB\)", message.split("fastest first:")[1])
    assert suggested and all(float(gib) <= available / GIB + 0.005 for gib in suggested)


def test_train_refuses_before_any_work_and_says_when_no_layout_fits(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(fit_check, "available_bytes_per_rank", lambda device_type: 1 << 20)  # 1 MiB
    run_dir = tmp_path / "run"
    assert train.main(["--set", *MODEL, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: not enough memory: every rank") and "no layout of 1 rank(s) fits" in err
    assert not run_dir.exists()  # nothing was started or written


@pytest.mark.parametrize("requested", ["auto", "bf16"])
def test_the_banners_memory_prediction_uses_the_precision_the_run_trains_in(tmp_path, capsys, requested):
    """One rule (parallel.hardware.auto_precision): the banner's prediction, the precision line and the summary
    name the same precision, and the prediction is the memory model's for it on this device."""
    settings = [*MODEL, f"train.precision={requested}", "train.steps=1", "train.eval_batches=1",
                "train.eval_interval=0", "logging.wandb=disabled", "logging.progress=lines", "checkpoint.final=false",
                "checkpoint.interval=null"]
    assert train.main(["--run-dir", str(tmp_path), "--set", *settings]) == 0
    err = capsys.readouterr().err
    predicted, banner = re.search(r"memory model: ([0-9.]+) GiB of live tensors per rank \((\w+);", err).groups()
    trained = re.search(r"precision: (\w+) on cpu", err).group(1)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert banner == trained == summary["precision"]
    if requested == "bf16":
        assert trained == "bf16"
    config = load_config("moe-8x", settings)
    assert float(predicted) == pytest.approx(predicted_bytes(config, resolve_layout(config, 1), trained, "cpu")[0]
                                             / GIB, abs=0.006)


def test_the_banner_says_what_its_prediction_counts():
    """Live tensor bytes, as the run measures them: a CPU run's live tensor peak (its resident peak, which holds
    glibc's kept memory and oneDNN's caches too, logged apart), a GPU's allocated memory, not reserved."""
    cpu, gpu = train.memory_banner([2**30], "bf16", "cpu"), train.memory_banner([2**30], "bf16", "cuda")
    assert cpu.startswith("memory model: 1.00 GiB of live tensors per rank (bf16; the run measures the live tensor "
                          "peak of its steps 1, 2, 4, 8, ... as perf/memory_peak_gib")
    assert "perf/memory_resident_peak_gib" in cpu and "glibc keeps" in cpu and "oneDNN's caches" in cpu
    assert "allocated, not reserved" in gpu and "glibc" not in gpu
