"""``perf/mfu`` is one device's figure: a 2-rank run (cp=2, each rank computing half of every sequence) logs the
job's model FLOPs per second over two devices' peak, not one's."""

import contextlib
import io
from pathlib import Path

import yaml

import train
from config.run import config_from_dict
from moe.accounting import training_flops_per_token
from tests.spawn import spawn
from tests.training.test_data_loss import TINY
from training.metrics import read_metrics

PEAK = 3.0e9  # FLOP/s every rank's matmul measurement returns, so the expected figure is known exactly


def _run_with_a_known_peak(rank, run_dir):
    import parallel.hardware

    parallel.hardware.measure_matmul_flops = lambda *args, **kwargs: PEAK
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = train.main(["--run-dir", run_dir, "--set", *TINY, "train.steps=2", "parallel.cp=2",
                             "moe.capacity_factor=null", "checkpoint.interval=null", "checkpoint.final=false"])
    assert status == 0, err.getvalue()


def test_a_two_rank_run_logs_mfu_per_device(tmp_path):
    spawn(_run_with_a_known_peak, 2, str(tmp_path))
    config = config_from_dict(yaml.safe_load(Path(tmp_path, "config.yaml").read_text()))
    flops = training_flops_per_token(config.model, config.moe)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "perf/mfu" in r]
    assert len(records) == 2
    for record in records:  # tokens_per_s is the job's: both ranks' tokens
        assert record["perf/mfu"] == record["perf/tokens_per_s"] * flops / (2 * PEAK)
