"""A tiny run with wandb offline: routing figures agree in metrics.jsonl, routing/*.npy and wandb's records."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

import train
from tests.training.test_metrics import _items_by_key, _read_transaction_log
from tests.training.test_train import TINY
from training.metrics import read_metrics
from training.routing_stats import read_routing

SCALARS = ("imbalance", "maxvio", "dropped", "entropy", "top1_prob")


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """6 steps logged every 2; charts at the first logging interval, every 2nd, and the last (steps 2 and 6)."""
    root = tmp_path_factory.mktemp("wandb-run")
    env = {"WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(root / "c"), "WANDB_CACHE_DIR": str(root / "cc"),
           "WANDB_DATA_DIR": str(root / "d")}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        patch.delenv("WANDB_MODE", raising=False)
        status = train.main(["--run-dir", str(root / "run"), "--set", *TINY, "train.steps=6", "train.eval_interval=0",
                             "logging.log_interval=2", "logging.router_charts_every=2", "logging.wandb=offline",
                             "checkpoint.interval=null"])  # (the default's save after step 1 logs its time there)
    assert status == 0
    return root / "run"


def _records(log: Path, timeout: float = 60.0) -> list:
    """The .wandb file's records once wandb has written its final "exit" record.

    ``run.finish()`` can return before wandb's writer has flushed the last records (seen on a loaded
    machine), so wait for the record that closes the log rather than read a half-written one: a chunk still
    being written fails its checksum, and is read again until the timeout (then the failure stands).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = _read_transaction_log(log)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
            continue
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.5)


def _history(run_dir: Path) -> tuple[Path, dict[int, dict]]:
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (log,) = offline.glob("*.wandb")
    rows = {}
    for record in _records(log):
        if record.WhichOneof("record_type") == "history":
            row = _items_by_key(record.history.item)
            rows.setdefault(row["_step"], {}).update(row)
    return offline / "files", rows


def test_wandb_history_holds_the_router_scalars_of_metrics_jsonl(offline_run):
    _, history = _history(offline_run)
    records = [r for r in read_metrics(offline_run / "metrics.jsonl") if "train/loss" in r]
    trained = sorted(step for step, row in history.items() if "train/loss" in row)  # (step 1 logs its save)
    assert [r["step"] for r in records] == [2, 4, 6] and trained == [2, 4, 6]
    for record in records:
        row = history[record["step"]]
        for layer in (0, 1):
            for name in SCALARS:
                key = f"router/layer{layer}/{name}"
                assert row[key] == pytest.approx(record[key], rel=1e-12), key
            load = record[f"router/layer{layer}/load"]
            assert [row[f"router/layer{layer}/load/{e}"] for e in range(4)] == pytest.approx(load, rel=1e-12)
            assert record[f"router/layer{layer}/maxvio"] == pytest.approx(max(load) * 4 - 1)
        assert row["train/dropped_frac"] == pytest.approx(record["train/dropped_frac"], rel=1e-12)


def test_load_charts_appear_every_second_interval_and_hold_the_logged_load(offline_run):
    files, history = _history(offline_run)
    records = {r["step"]: r for r in read_metrics(offline_run / "metrics.jsonl") if "train/loss" in r}
    assert not any(key.startswith("router/load_matrix") for key in history[4])
    for step in (2, 6):
        row, record = history[step], records[step]
        for layer in (0, 1):
            assert row[f"router/layer{layer}/load_bar_table/_type"] == "table-file"
            table = json.loads((files / row[f"router/layer{layer}/load_bar_table/path"]).read_text())
            assert table["columns"] == ["expert", "load"]
            assert [r[0] for r in table["data"]] == ["0", "1", "2", "3"]
            assert [r[1] for r in table["data"]] == pytest.approx(record[f"router/layer{layer}/load"], rel=1e-12)
        matrix = json.loads((files / row["router/load_matrix/path"]).read_text())
        assert matrix["columns"] == ["layer", "0", "1", "2", "3"]
        assert [r[0] for r in matrix["data"]] == [0, 1]
        for layer, data_row in enumerate(matrix["data"]):
            assert data_row[1:] == pytest.approx(record[f"router/layer{layer}/load"], rel=1e-12)
        assert row["router/load_heatmap/_type"] == "image-file"
        assert (files / row["router/load_heatmap/path"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_routing_npy_rows_agree_with_metrics_jsonl(offline_run):
    fields = read_routing(offline_run)
    records = [r for r in read_metrics(offline_run / "metrics.jsonl") if "train/loss" in r]
    assert fields["step"].tolist() == [2, 2, 4, 4, 6, 6] and fields["layer"].tolist() == [0, 1] * 3
    assert "expert_bias" not in fields  # no aux-loss-free balancing in this run
    for n, (step, layer) in enumerate(zip(fields["step"], fields["layer"], strict=True)):
        record = next(r for r in records if r["step"] == step)
        for name, column in (("imbalance", "imbalance"), ("maxvio", "maxvio"), ("dropped", "dropped_frac"),
                             ("entropy", "entropy"), ("top1_prob", "top1_prob")):
            assert fields[column][n] == pytest.approx(record[f"router/layer{layer}/{name}"], rel=1e-12)
        tokens = fields["tokens_per_expert"][n]
        assert (tokens / tokens.sum()).tolist() == pytest.approx(record[f"router/layer{layer}/load"], rel=1e-12)
        assert tokens.sum() == fields["assignments"][n] == 2 * 8 * 64 * 2  # 2 steps of 8 x 64 tokens, top-2
        np.testing.assert_array_equal(np.diag(fields["coselection"][n]), tokens)
        assert fields["choice_share"][n].sum() == pytest.approx(1.0)
