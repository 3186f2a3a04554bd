"""``train.compile``: compiled blocks train as eager blocks do, and break the graph only where
``parallel/compile.py`` says (with a capacity factor at the kept-assignment selection; outside bf16 at the grouped
GEMMs). Through ``train.py`` on a tiny model, 3 optimizer steps each; compiled with the "aot_eager" backend
(Dynamo's capture and AOTAutograd as Inductor gets them, without C++ code generation, which takes minutes here).
"""

import pytest
import torch
import torch._dynamo

import parallel.compile
import train
from config.errors import ConfigError
from config.run import load_config
from parallel.hardware import check_hardware
from tests.parallel.parity import DOCUMENT_MASK
from tests.training.test_train import TINY
from training.metrics import read_metrics

STEPS = ["train.steps=3", "logging.log_interval=1", "train.eval_interval=0", "train.eval_batches=1"]


def losses(run_dir, *overrides):
    assert train.main(["--config", "moe-8x", "--run-dir", str(run_dir), "--set", *TINY, *STEPS, *overrides]) == 0
    return [r["train/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]


# the dropless bf16 row also masks packed documents from each other (data.document_mask): the blocks take the
# documents' mask and rotary tables as one more argument, and still compile whole
@pytest.mark.parametrize("routing, precision, data, breaks", [
    ("moe.capacity_factor=1.25", "fp32", [], {"nonzero", "disable"}),
    ("moe.capacity_factor=null", "bf16", DOCUMENT_MASK, set()),
], ids=["capacity-fp32", "dropless-bf16-document_mask"])
def test_compiled_blocks_train_like_eager_ones(tmp_path, monkeypatch, routing, precision, data, breaks):
    monkeypatch.setattr(parallel.compile, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    settings = [routing, f"train.precision={precision}", *data]
    eager = losses(tmp_path / "eager", *settings)
    compiled = losses(tmp_path / "compiled", *settings, "train.compile=true")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # it did compile
    tolerance = 1e-5 if precision == "fp32" else 2e-3  # bf16: decompositions may round intermediates differently
    assert compiled == pytest.approx(eager, rel=tolerance)
    reasons = " ".join(torch._dynamo.utils.counters["graph_break"]).lower()
    assert {word for word in ("nonzero", "disable") if word in reasons} == breaks, reasons


def test_compile_is_refused_where_torch_cannot_compile(monkeypatch):
    config = load_config("moe-8x", ["train.compile=true"])
    check_hardware(config, "cpu")  # g++ is here
    monkeypatch.setattr(parallel.compile.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match=r"train.compile=true: TorchInductor compiles CPU kernels with a C\+\+ "
                                          r"compiler and none is on PATH \(install g\+\+\); or set "
                                          r"train.compile=false"):
        check_hardware(config, "cpu")
    with pytest.raises(ConfigError, match="train.compile with pipeline parallelism"):
        load_config("moe-8x", ["train.compile=true", "parallel.pp=2"])
