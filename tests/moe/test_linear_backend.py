"""``model.linear_backend``: which kernels compute the gated delta rule, refused before any work where fla cannot
run, and the torch reference wherever ``auto`` finds no fla (the GPU check holds fla equal to it:
``tests/gpu/test_fla_delta_rule.py``)."""

from __future__ import annotations

import pytest
import torch

from config.errors import ConfigError
from config.model import ModelConfig
from config.run import RunConfig
from moe.attention import delta_rule_fla
from moe.attention.delta_rule_fla import check_linear_backend, fla_unavailable, uses_fla
from parallel.hardware import check_hardware
from tests.moe.test_gated_delta import HYBRID


def test_fla_is_refused_before_any_work_where_it_cannot_run():
    with pytest.raises(ConfigError, match="model.linear_backend=fla: fla's kernels are Triton kernels for CUDA GPUs "
                                          "and this run computes on cpu.*model.linear_backend=torch"):
        check_hardware(RunConfig(model=ModelConfig(**HYBRID, linear_backend="fla")), "cpu")
    check_hardware(RunConfig(model=ModelConfig(**HYBRID, linear_backend="torch")), "cpu")
    check_hardware(RunConfig(model=ModelConfig(**HYBRID, linear_backend="auto")), "cpu")
    # a model without linear layers never asks for fla, whatever the key says
    check_hardware(RunConfig(model=ModelConfig(linear_backend="fla")), "cpu")


def test_a_gpu_without_fla_core_is_told_how_to_install_it(monkeypatch):
    monkeypatch.setattr(delta_rule_fla, "fla_unavailable", lambda device_type: "fla-core cannot be imported (...)")
    with pytest.raises(ConfigError, match=r"fla-core cannot be imported.*pip install fla-core.*--prepare DIR"):
        check_linear_backend("fla", "cuda")
    assert not uses_fla("auto", torch.device("cuda"))  # auto falls back to the reference, as megablocks' does
    check_linear_backend("auto", "cuda")


def test_auto_and_torch_choose_the_reference_on_a_cpu():
    assert fla_unavailable("cpu") is not None
    assert not uses_fla("auto", torch.device("cpu")) and not uses_fla("torch", torch.device("cpu"))
    assert uses_fla("fla", torch.device("cuda"))
