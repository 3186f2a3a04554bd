"""MetricsLogger: metrics.jsonl, summary.json, and what an offline wandb run records."""

from __future__ import annotations

import json
import math
import struct
import time
import zlib
from pathlib import Path

import pytest

from config.errors import ConfigError
from training.metrics import MetricsLogger, read_metrics


@pytest.fixture(autouse=True)
def quiet_wandb(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Keep wandb silent and its side files (cache, settings) inside the test's directory."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.delenv("WANDB_MODE", raising=False)


def _logger(run_dir: Path, enabled: bool = True, wandb_mode: str = "disabled") -> MetricsLogger:
    config = {"train": {"steps": 3}}
    return MetricsLogger(run_dir, config, "test-run", wandb_mode, "moe-tests", enabled=enabled)


def test_jsonl_one_object_per_log_call_with_exact_values(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "a"
    with _logger(run_dir) as logger:
        logger.log(1, {"train/loss": 3.25, "train/lr": 1e-4, "perf/tokens_per_s": 1200})
        logger.log(2, {"train/loss": math.nan, "router/layer0/load": [10.0, 6.0, 0.0, 16.0]})
        logger.log(3, {"train/grad_norm": math.inf, "train/aux_loss": -math.inf})

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "train/loss": 3.25, "train/lr": 1e-4, "perf/tokens_per_s": 1200},
        {"step": 2, "train/loss": "nan", "router/layer0/load": [10.0, 6.0, 0.0, 16.0]},
        {"step": 3, "train/grad_norm": "inf", "train/aux_loss": "-inf"},
    ]
    assert "NaN" not in lines[1]  # strict JSON: no bare NaN token


def test_tensors_and_numpy_values_become_plain_numbers(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    with _logger(tmp_path) as logger:
        logger.log(5, {
            "train/loss": torch.tensor(2.5),
            "perf/mfu": np.float32(0.25),
            "router/layer1/load": torch.tensor([3, 1]),
            "val/loss": np.array([1.5, 0.5]),
        })
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 5, "train/loss": 2.5, "perf/mfu": 0.25, "router/layer1/load": [3, 1], "val/loss": [1.5, 0.5],
    }


def test_read_metrics_round_trips(tmp_path: Path) -> None:
    records = [
        {"step": 10, "train/loss": 3.5, "router/layer0/load": [1.0, 2.0, math.inf]},
        {"step": 20, "train/loss": math.nan, "val/loss": 3.0},
    ]
    with _logger(tmp_path) as logger:
        for record in records:
            logger.log(record["step"], {k: v for k, v in record.items() if k != "step"})
    back = read_metrics(tmp_path / "metrics.jsonl")
    assert len(back) == 2
    assert back[0] == records[0]
    assert back[1]["step"] == 20 and back[1]["val/loss"] == 3.0 and math.isnan(back[1]["train/loss"])


def test_read_metrics_skips_an_unterminated_last_line_but_rejects_corruption(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/lo')
    assert read_metrics(path) == [{"step": 1, "train/loss": 2.0}]
    path.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_metrics(path)


def test_log_appends_to_an_existing_file(tmp_path: Path) -> None:
    with _logger(tmp_path) as logger:
        logger.log(1, {"train/loss": 4.0})
    with _logger(tmp_path) as logger:
        logger.log(2, {"train/loss": 3.0})
    assert read_metrics(tmp_path / "metrics.jsonl") == [
        {"step": 1, "train/loss": 4.0}, {"step": 2, "train/loss": 3.0},
    ]


def test_disabled_logger_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "rank1"
    logger = _logger(run_dir, enabled=False, wandb_mode="offline")
    logger.log(1, {"train/loss": 1.0})
    logger.summary({"train/loss": 1.0})
    logger.close()
    assert not run_dir.exists()


def test_summary_json_written_and_replaced(tmp_path: Path) -> None:
    with _logger(tmp_path) as logger:
        logger.summary({"train/loss": 3.0, "val/loss": 3.5})
        logger.summary({"train/loss": 2.75, "val/loss": math.nan, "perf/tokens_per_s": 5000.0})
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "train/loss": 2.75, "val/loss": "nan", "perf/tokens_per_s": 5000.0,
    }
    # replaced through a temporary file that does not stay behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl", "summary.json"]


def test_close_is_idempotent(tmp_path: Path) -> None:
    logger = _logger(tmp_path)
    logger.log(1, {"train/loss": 1.0})
    logger.close()
    logger.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "train/loss": 1.0}]


def test_unknown_wandb_mode_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="logging.wandb='offfline'.*offline, online, disabled"):
        _logger(tmp_path, wandb_mode="offfline")


def _read_transaction_log(path: Path) -> list:
    """The protobuf records of a wandb ``.wandb`` file.

    The file is a 7-byte header (``:W&B``, magic 0xBEE1 little-endian, version 0) followed by a
    LevelDB-style log: 32 KiB blocks of chunks, each ``crc32 (4) | length (2, LE) | type (1) | data``,
    type 1 = full record, 2/3/4 = first/middle/last piece; the CRC is zlib's CRC-32 of the type byte
    and the data; a block tail shorter than a chunk header is zero padding.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0)
    block, header = 32768, 7
    records, pending, pos = [], b"", 7
    while pos + header <= len(data):
        if block - pos % block < header:
            pos += block - pos % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        chunk = data[pos + header:pos + header + length]
        pos += header + length
        if kind == 0 and length == 0:  # preallocated zeros at the end
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == checksum
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _records_once_written(path: Path, kinds: tuple[str, ...], timeout: float = 30.0) -> list:
    """The file's records once every kind in ``kinds`` is among them, or whatever is there after ``timeout``.

    wandb's service writes the file from its own process. Twice, full-suite runs on a machine loaded several
    times over found no ``run`` record in it right after ``finish`` returned (not reproduced alone, even under
    load); if the service's writes can lag ``finish``, waiting covers it. It changes nothing that the test
    asserts about the records.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = _read_transaction_log(path)
        except AssertionError:  # a chunk the service is still writing fails its checksum: read again, until timeout
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        present = {record.WhichOneof("record_type") for record in records}
        if set(kinds) <= present or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _items_by_key(items) -> dict[str, object]:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def test_wandb_offline_run_records_logged_values(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "offline"
    with MetricsLogger(run_dir, {"train": {"steps": 20}}, "offline-test", "offline", "moe-tests") as logger:
        logger.log(10, {"train/loss": 3.5, "router/layer0/load": [7.0, 9.0]})
        logger.log(20, {"train/loss": 3.25, "val/loss": 3.375})
        logger.summary({"train/loss": 3.25, "val/loss": 3.375})

    offline_dirs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline_dirs) == 1
    logs = list(offline_dirs[0].glob("*.wandb"))
    assert len(logs) == 1
    records = _records_once_written(logs[0], ("run", "summary"))

    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "offline-test" and run.project == "moe-tests"
    assert _items_by_key(run.config.update)["train"] == {"steps": 20}

    history = [_items_by_key(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    logged = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history]
    assert logged == [
        {"train/loss": 3.5, "router/layer0/load/0": 7.0, "router/layer0/load/1": 9.0},
        {"train/loss": 3.25, "val/loss": 3.375},
    ]
    assert [h["_step"] for h in history] == [10, 20]

    summary: dict[str, object] = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update(_items_by_key(record.summary.update))
    assert summary["train/loss"] == 3.25 and summary["val/loss"] == 3.375
    assert json.loads((run_dir / "summary.json").read_text()) == {"train/loss": 3.25, "val/loss": 3.375}


def test_wandb_failure_to_start_names_the_way_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import wandb

    def broken_init(**kwargs):
        raise OSError("wandb-core could not start")

    monkeypatch.setattr(wandb, "init", broken_init)
    with pytest.raises(ConfigError, match="logging.wandb=disabled"):  # exit status 2, no traceback
        _logger(tmp_path, wandb_mode="offline")


def test_tensorboard_without_its_package_is_refused_before_any_work(monkeypatch, tmp_path, capsys):
    """logging.tensorboard=true where tensorboard is not installed: exit 2 naming the key and the fix, no run dir."""
    import importlib.util

    import train

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "tensorboard"
                        else find_spec(name, *rest))
    run_dir = tmp_path / "run"
    assert train.main(["--run-dir", str(run_dir), "--set", "logging.tensorboard=true", "logging.wandb=disabled"]) == 2
    error = capsys.readouterr().err
    assert "logging.tensorboard=true needs the tensorboard package" in error and "pip install tensorboard" in error
    assert "Traceback" not in error and not run_dir.exists()
