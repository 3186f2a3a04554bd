"""Comparing runs: summary.json says what each run was, figures are titled with the run, and
``python -m training.compare RUN RUN`` (docs/journeys.md) draws each run's logged losses in one figure."""

import json

import pytest

import train
from training.compare import compare_figure, main, run_record
from training.metrics import read_metrics
from training.run_plots import run_figures, run_label

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.seq_len=32", "model.ffn_hidden=64",
        "moe.num_experts=4", "moe.expert_hidden=32", "train.global_batch_size=4", "train.warmup_steps=0",
        "train.precision=fp32", "train.eval_interval=2", "train.eval_batches=1", "logging.wandb=disabled",
        "logging.log_interval=1", "logging.progress=lines", "train.steps=4", "checkpoint.interval=null",
        "checkpoint.final=false", "logging.plots=false"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    for name, optimizer in (("adamw", "adamw"), ("muon", "muon")):
        assert train.main(["--run-dir", str(root / name), "--set", *TINY, f"train.optimizer={optimizer}"]) == 0
    return root / "adamw", root / "muon"


def test_summary_says_the_run_its_optimizer_precision_and_layout_and_plots_are_titled_with_it(two_runs):
    adamw, muon = two_runs
    summary = json.loads((muon / "summary.json").read_text())
    assert {key: summary[key] for key in ("run", "config", "optimizer", "precision", "layout")} == {
        "run": "muon", "config": "moe-8x", "optimizer": "muon", "precision": "fp32", "layout": "1 rank"}
    assert run_label(muon) == "muon (moe-8x, muon, fp32, 1 rank)"
    assert run_figures(muon, run_label(muon))["loss.png"].axes[0].get_title().startswith("muon (moe-8x, muon")
    assert run_label(adamw) != run_label(muon)


def test_the_compare_command_draws_each_runs_logged_losses_in_one_figure(two_runs, tmp_path, capsys):
    out = tmp_path / "compare.png"
    assert main([*map(str, two_runs), "--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in table] == [run_label(run) for run in two_runs]
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = compare_figure([run_record(run) for run in two_runs]).axes[0].lines
    for run, (train_line, val_line) in zip(two_runs, zip(lines[::2], lines[1::2], strict=True), strict=True):
        records = read_metrics(run / "metrics.jsonl")
        assert train_line.get_label() == f"{run_label(run)}: training"
        assert list(train_line.get_ydata()) == [r["train/loss"] for r in records if "train/loss" in r]
        assert list(val_line.get_xdata()) == [2, 4]
        assert list(val_line.get_ydata()) == [r["val/loss"] for r in records if "val/loss" in r]
    tokens = compare_figure([run_record(two_runs[0])], x="tokens").axes[0].lines[0]
    assert list(tokens.get_xdata()) == [128, 256, 384, 512]  # steps x 4 sequences x 32 tokens
    assert main([str(two_runs[0]), "--out", str(tmp_path / "one.png")]) == 2  # one run: nothing to compare
    assert main([str(two_runs[0]), str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2  # not a run directory
