"""analysis.router's run-directory helpers: finding runs, reading routing columns, co-selection lift."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import yaml

from analysis import router
from config.errors import UserError
from config.run import load_config
from training.routing_stats import append_rows


def _fake_run(path, steps=(10, 20), layers=(0, 2), experts=4, mtime=None):
    """A run directory as training leaves it: config.yaml, metrics.jsonl and routing/*.npy."""
    path.mkdir(parents=True)
    config = load_config("moe-8x", ["moe.num_experts=4", "logging.wandb=disabled"])
    (path / "config.yaml").write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    (path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "train/loss": {5 - s / 10}}}\n' for s in steps))
    (path / "routing").mkdir()
    rng = np.random.default_rng(len(str(path)))
    for s in steps:
        append_rows(path / "routing" / "step.npy", np.full(len(layers), s))
        append_rows(path / "routing" / "layer.npy", np.array(layers))
        append_rows(path / "routing" / "imbalance.npy", rng.uniform(1, 2, len(layers)))
        append_rows(path / "routing" / "coselection.npy", rng.integers(0, 9, (len(layers), experts, experts)))
    if mtime is not None:
        os.utime(path / "metrics.jsonl", (mtime, mtime))
    return path


def test_newest_run_and_the_environment_choose_the_run(tmp_path, monkeypatch):
    now = time.time()
    old = _fake_run(tmp_path / "runs" / "old", mtime=now - 100)
    new = _fake_run(tmp_path / "runs" / "new", mtime=now)
    monkeypatch.delenv("MOE_RUN_DIR", raising=False)
    monkeypatch.delenv("MOE_COMPARE_RUN", raising=False)
    assert router.newest_run(tmp_path / "runs") == new
    assert router.run_dir_from_env(tmp_path / "runs") == new
    assert router.companion_run(new, tmp_path / "runs") == old
    assert router.companion_run(old, tmp_path / "runs") == new
    monkeypatch.setenv("MOE_RUN_DIR", str(old))
    assert router.run_dir_from_env(tmp_path / "runs") == old
    monkeypatch.setenv("MOE_RUN_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="MOE_RUN_DIR=.* is not a run directory"):
        router.run_dir_from_env()
    with pytest.raises(FileNotFoundError, match="no run under .*make train"):
        router.newest_run(tmp_path / "empty")


def test_run_data_selects_per_layer_columns_in_step_order(tmp_path):
    run = router.load_run(_fake_run(tmp_path / "r", steps=(10, 20, 30)))
    assert run.layers == [0, 2] and run.config.moe.num_experts == 4
    steps, values = run.per_layer("imbalance", 2)
    assert steps.tolist() == [10, 20, 30]
    np.testing.assert_array_equal(values, run.routing["imbalance"][[1, 3, 5]])
    np.testing.assert_array_equal(run.coselection(0), run.routing["coselection"][[0, 2, 4]].sum(0))
    np.testing.assert_array_equal(run.coselection(0, last_intervals=1), run.routing["coselection"][4])
    assert run.metric("train/loss")[1].tolist() == pytest.approx([4.0, 3.0, 2.0])
    with pytest.raises(UserError, match="no routing field 'entropy'"):
        run.per_layer("entropy", 0)


def test_coselection_lift_against_independent_choice():
    # 3 tokens, top-2 of 3 experts: {0,1}, {0,1}, {1,2}
    pairs = [(0, 1), (0, 1), (1, 2)]
    counts = np.zeros((3, 3), dtype=np.int64)
    for pair in pairs:
        for a in pair:
            for b in pair:
                counts[a, b] += 1
    lift = router.coselection_lift(counts)
    load = np.array([2, 3, 1])  # tokens per expert
    assert lift[0, 1] == pytest.approx(2 / (load[0] * load[1] / 3))
    assert lift[0, 2] == 0 and lift[1, 2] == pytest.approx(1 / (load[1] * load[2] / 3))
    assert np.isnan(np.diag(lift)).all()


def test_summary_averages_the_last_intervals_and_prints_one_line_per_run(tmp_path, capsys):
    run_dir = _fake_run(tmp_path / "a", steps=(10, 20, 30))
    for name in ("maxvio", "dropped_frac", "entropy"):
        for _ in range(3):
            append_rows(run_dir / "routing" / f"{name}.npy", np.array([0.1, 0.3]))
    with open(run_dir / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 30, "val/loss": 2.5}\n')
    run = router.load_run(run_dir)
    summary = router.summarise(run, last_intervals=2)
    assert summary.steps == 30 and summary.train_loss == pytest.approx(2.0) and summary.val_loss == 2.5
    assert summary.imbalance == pytest.approx(run.routing["imbalance"][2:].mean())
    assert summary.maxvio == pytest.approx(0.2)
    assert router.main(["summary", str(run_dir), str(run_dir), "--last", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines[1].split()[:4] == ["a", "30", "2.0000", "2.5000"]
