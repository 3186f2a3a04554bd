"""``perf/mfu`` is one device's figure: a 2-rank run (cp=2, each rank computing half of every sequence) logs the
job's model FLOPs per second over two devices' peak, not one's. The same run is the 2-rank row of the loss goldens
(``test_loss_goldens.py``)."""

import contextlib
import io
from pathlib import Path

import yaml

import train
from config.run import config_from_dict
from moe.accounting import training_flops_per_token
from tests.spawn import spawn
from tests.training.test_data_loss import TINY
from tests.training.test_loss_goldens import assert_golden, logged
from training.metrics import read_metrics

PEAK = 3.0e9  # FLOP/s every rank's matmul measurement returns, so the expected figure is known exactly


CP_ROW = "mixtral (default), dropless, cp=2 on 2 ranks"


def _run_with_a_known_peak(rank, run_dir):
    import parallel.hardware

    parallel.hardware.measure_matmul_flops = lambda *args, **kwargs: PEAK
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = train.main(["--run-dir", run_dir, "--set", *TINY, "train.steps=3", "parallel.cp=2",
                             "moe.capacity_factor=null", "checkpoint.interval=null", "checkpoint.final=false"])
    assert status == 0, err.getvalue()


def run_cp_row(run_dir: Path) -> list[list[float]]:
    """The 2-rank run (cp=2); its logged values for the loss goldens."""
    spawn(_run_with_a_known_peak, 2, str(run_dir))
    return logged(run_dir)


def test_a_two_rank_run_logs_mfu_per_device_and_the_golden_losses(tmp_path):
    assert_golden(CP_ROW, run_cp_row(tmp_path))
    config = config_from_dict(yaml.safe_load(Path(tmp_path, "config.yaml").read_text()))
    flops = training_flops_per_token(config.model, config.moe)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "perf/mfu" in r]
    assert len(records) == 3
    for record in records:  # tokens_per_s is the job's: both ranks' tokens
        assert record["perf/mfu"] == record["perf/tokens_per_s"] * flops / (2 * PEAK)
