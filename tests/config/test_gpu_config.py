"""``configs/moe-8x-gpu.yaml``: refused clearly on a machine without a GPU, and sized to fit one H100."""

import pytest
import torch

from analysis.fit_check import check_fits
from config.errors import ConfigError
from config.run import load_config
from parallel.hardware import check_hardware
from parallel.resolve import resolve_layout
from tests.test_cli_faults import refused

H100_BYTES = 80 * 2**30


def test_the_gpu_config_fits_one_80_gib_gpu_by_the_memory_model():
    config = load_config("moe-8x-gpu")
    (need,) = check_fits(config, resolve_layout(config, 1), H100_BYTES, "bf16")
    assert 0.3 * H100_BYTES < need < 0.75 * H100_BYTES  # uses the GPU, with room for the allocator's slack


def test_a_gpu_config_on_a_cpu_is_refused_naming_the_config():
    with pytest.raises(ConfigError, match=r"config 'moe-8x-gpu' is sized for a GPU \(train.device=cuda\)"):
        check_hardware(load_config("moe-8x-gpu"), "cpu")
    check_hardware(load_config("moe-8x-gpu"), "cuda")
    check_hardware(load_config("moe-8x-gpu", ["train.device=auto"]), "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_train_py_refuses_the_gpu_config_before_any_work(tmp_path, capsys, monkeypatch):
    import training.loop
    monkeypatch.setattr(training.loop, "build_model", lambda *a, **k: pytest.fail("built the model"))
    refused(capsys, ["--config", "moe-8x-gpu", "--run-dir", str(tmp_path / "r")], "sized for a GPU")
    assert not (tmp_path / "r").exists()
