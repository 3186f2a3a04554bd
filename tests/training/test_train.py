"""End to end: train.py learns real text, writes its run directory, and fails cleanly on bad input."""

import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import train
from config.run import load_config
from moe.transformer import MoETransformer
from training.metrics import read_metrics
from training.optim import build_optimizer
from training.step import IntervalStats, StepContext, train_step

ROOT = Path(__file__).resolve().parents[2]

# A tiny MoE (2 layers, 4 experts top-2) that trains in a few seconds on 2 cores.
TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.seq_len=64", "model.ffn_hidden=128",
        "moe.num_experts=4", "moe.expert_hidden=64", "train.global_batch_size=8", "train.warmup_steps=5",
        "train.precision=fp32", "logging.wandb=disabled", "logging.log_interval=10", "train.eval_batches=4",
        "logging.plots=false"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    status = train.main(["--config", "moe-8x", "--run-dir", str(run_dir), "--set", *TINY,
                         "train.steps=60", "train.eval_interval=30", "logging.plots=true", "logging.tensorboard=true"])
    return status, run_dir


def test_loss_falls_well_below_the_uniform_byte_baseline(trained_run):
    """ln(256) = 5.55 nats is a model that knows nothing; measured here: val loss ~2.9 after 60 steps."""
    status, run_dir = trained_run
    assert status == 0
    records = read_metrics(run_dir / "metrics.jsonl")
    train_losses = [r["train/loss"] for r in records if "train/loss" in r]
    val_losses = [r["val/loss"] for r in records if "val/loss" in r]
    assert train_losses[0] > 4.0  # starts near the baseline
    assert train_losses[-1] < 3.5 and val_losses[-1] < 3.5 < math.log(256)
    assert val_losses[-1] < val_losses[0]


def test_run_directory_holds_config_metrics_and_summary(trained_run):
    _, run_dir = trained_run
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["train"]["steps"] == 60 and resolved["moe"]["num_experts"] == 4
    records = read_metrics(run_dir / "metrics.jsonl")
    logged = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in logged] == [10, 20, 30, 40, 50, 60]
    expected_keys = {"step", "train/loss", "train/lm_loss", "train/aux_loss", "train/z_loss", "train/lr",
                     "train/grad_norm", "train/dropped_frac", "perf/tokens_per_s", "perf/mfu",
                     "router/layer0/load", "router/layer0/imbalance", "router/layer0/dropped",
                     "router/layer0/entropy", "router/layer1/load"}
    assert expected_keys <= logged[-1].keys()
    load = logged[-1]["router/layer0/load"]
    assert len(load) == 4 and sum(load) == pytest.approx(1.0)
    assert logged[-1]["router/layer0/imbalance"] == pytest.approx(max(load) / (1 / 4))
    assert 0 < logged[-1]["perf/mfu"] < 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60 and summary["val/loss"] == pytest.approx([r["val/loss"] for r in records
                                                                           if "val/loss" in r][-1])


def test_tensorboard_event_file_holds_the_logged_scalars(trained_run):
    """logging.tensorboard: read back with TensorBoard's own reader, the scalars are metrics.jsonl's (float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir = trained_run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    records = read_metrics(run_dir / "metrics.jsonl")
    for key in ("train/loss", "val/loss", "router/layer1/imbalance", "router/layer0/load/3"):
        name, _, index = key.partition("/load/")
        logged = [(r["step"], r[name + "/load"][int(index)] if index else r[key]) for r in records
                  if (name + "/load" if index else key) in r]
        read = [(event.step, event.value) for event in events.Scalars(key)]
        assert [step for step, _ in read] == [step for step, _ in logged] and len(read) >= 2
        assert [value for _, value in read] == pytest.approx([value for _, value in logged], rel=1e-6)


def test_run_leaves_png_plots_drawn_from_its_metrics(trained_run):
    """plots/*.png are valid images; each figure's lines are the metrics' values (not made up or resampled)."""
    from PIL import Image

    from training.run_plots import run_figures

    _, run_dir = trained_run
    for name in ("loss", "throughput", "memory", "routing"):
        with Image.open(run_dir / "plots" / f"{name}.png") as image:
            image.verify()
            assert image.format == "PNG" and image.size[0] >= 400 and image.size[1] >= 200
    records = read_metrics(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    figures = run_figures(run_dir, "tiny")
    train_line, val_line = figures["loss.png"].axes[0].lines[:2]
    assert list(train_line.get_xdata()) == [10, 20, 30, 40, 50, 60]
    assert list(train_line.get_ydata()) == [r["train/loss"] for r in records if "train/loss" in r]
    assert list(val_line.get_ydata()) == [r["val/loss"] for r in records if "val/loss" in r]
    assert list(figures["throughput.png"].axes[0].lines[0].get_ydata()) == [
        r["perf/tokens_per_s"] for r in records if "perf/tokens_per_s" in r]
    layer1 = figures["routing.png"].axes[0].lines[1]
    assert layer1.get_label() == "layer 1"
    assert list(layer1.get_ydata()) == [r["router/layer1/imbalance"] for r in records if "train/loss" in r]
    bars = figures["memory.png"].axes[0].patches  # the part before the model, then the rest on top of it
    assert bars[0].get_height() + bars[1].get_height() == pytest.approx(summary["perf/memory_peak_gib_per_rank"][0])
    assert bars[0].get_height() == pytest.approx(summary["perf/memory_before_model_gib_per_rank"][0])


def test_gradient_accumulation_matches_the_full_batch(tmp_path):
    """Two micro-batches of 4 give the same step as one batch of 8 (dropless, so routing is per token)."""
    common = [*TINY, "train.steps=3", "train.eval_interval=0", "moe.capacity_factor=null",
              "logging.log_interval=1"]
    assert train.main(["--run-dir", str(tmp_path / "full"), "--set", *common]) == 0
    assert train.main(["--run-dir", str(tmp_path / "accum"), "--set", *common, "train.micro_batch_size=4"]) == 0
    full = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if "train/loss" in r]
    accum = [r for r in read_metrics(tmp_path / "accum" / "metrics.jsonl") if "train/loss" in r]
    for a, b in zip(full, accum, strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-3)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "moe.top_k=9"], "moe.top_k=9 must be between 1 and moe.num_experts=8"),
        (["--config", "moe-9x"], "did you mean 'moe-8x'"),
        (["--set", "data.source=/nonexistent/corpus"], "data.source"),
        (["--set", "parallel.sequence_parallel=true"], "parallel.sequence_parallel=true shards over the "
                                                        "tensor-parallel ranks, but parallel.tp=1"),
    ],
)
def test_errors_exit_non_zero_with_the_message_on_stderr(args, message, tmp_path):
    command = [sys.executable, "train.py", "--run-dir", str(tmp_path / "r"), *args, "--set", "logging.wandb=disabled"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr


def test_a_diverging_run_stops_with_a_clear_message(tmp_path):
    command = [sys.executable, "train.py", "--run-dir", str(tmp_path / "r"), "--set", *TINY, "train.steps=20",
               "train.lr=1e30", "train.warmup_steps=0", "train.eval_interval=0"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert "gradient norm" in result.stderr and "train.lr" in result.stderr
    assert "Traceback" not in result.stderr


def test_aux_loss_free_bias_follows_the_whole_steps_load():
    """The bias update uses the load summed over every micro-batch of the step, not just the last one."""
    rate = 0.01
    config = load_config("moe-8x", [*TINY, "moe.aux_loss_coef=0", f"moe.bias_update_rate={rate}"])
    torch.manual_seed(0)
    model = MoETransformer(config.model, config.moe)
    inputs = torch.randint(0, 256, (8, 64))
    inputs[:4] = 32  # all spaces: every token of the first micro-batch routes alike, unlike the second
    with torch.no_grad():  # the load each micro-batch will produce, before any update
        loads = []
        for half in (inputs[:4], inputs[4:]):
            model(half)
            loads.append(model.moe_layers()[0].last_stats.tokens_per_expert.float())
    step_load = loads[0] + loads[1]
    expected = rate * torch.sign(step_load.mean() - step_load)

    train_step(StepContext(model, build_optimizer(model, config.train), 4, 1.0, contextlib.nullcontext), inputs,
               inputs, IntervalStats())
    torch.testing.assert_close(model.moe_layers()[0].router.expert_bias, expected)
    assert not torch.equal(torch.sign(loads[1].mean() - loads[1]), torch.sign(step_load.mean() - step_load))


def test_training_with_aux_loss_free_balancing_runs(tmp_path):
    assert train.main(["--run-dir", str(tmp_path / "r"), "--set", *TINY, "train.steps=4", "train.eval_interval=0",
                       "moe.aux_loss_coef=0", "moe.bias_update_rate=0.001"]) == 0


def test_torchrun_single_process(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "train.py", "--run-dir", str(tmp_path / "r"), "--set", *TINY, "train.steps=3", "train.eval_interval=0"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "train/loss" in r] == [3]


def test_training_with_multi_token_prediction_logs_its_loss_apart(tmp_path):
    """DeepSeek-V3's architecture at toy size with one MTP module trains through train.py: the MTP loss is logged
    beside the LM loss (``train/loss`` stays the LM loss), and both fall."""
    settings = ["model.mtp_depth=1", "model.mtp_loss_weight=0.3", "model.first_moe_layer=1", "model.n_kv_heads=null",
                "model.kv_lora_rank=16", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=8",
                "moe.score_func=sigmoid", "moe.n_group=2", "moe.topk_group=1", "moe.routed_scaling_factor=2.5",
                "moe.num_shared_experts=1", "moe.bias_update_rate=0.001"]
    assert train.main(["--run-dir", str(tmp_path / "r"), "--set", *TINY, "train.steps=6", "train.eval_interval=0",
                       "logging.log_interval=1", *settings]) == 0
    records = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "train/loss" in r]
    assert all("train/mtp_loss" in r and r["train/loss"] == r["train/lm_loss"] for r in records)
    assert records[-1]["train/mtp_loss"] < records[0]["train/mtp_loss"]
    assert records[-1]["train/loss"] < records[0]["train/loss"]
