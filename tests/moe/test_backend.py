"""``moe.backend``: the megablocks backend refused clearly where it cannot run, and its call contract.

No GPU here: the megablocks kernels themselves are checked in ``tests/gpu/test_megablocks_parity.py``. On CPU we
check the refusals, that ``auto`` is the torch backend, and that the layer hands ``grouped_gemm.ops.gmm`` exactly
what its C++ entry point accepts (``csrc/grouped_gemm.cu``'s checks, restated by ``_strict_gmm``), through a
stand-in module computing the reference maths per expert.
"""

import sys
import types

import pytest
import torch

from config.errors import ConfigError
from config.model import MoEConfig
from config.run import load_config
from moe.experts import ComputeCopies, GroupedExperts, _auto_backend, check_backend, expert_ffn
from moe.init import initialize
from moe.layer import MoELayer
from tests.test_cli_faults import refused
from tests.training.test_data_loss import TINY


def test_megablocks_on_a_cpu_is_refused_saying_why_and_how_to_install():
    with pytest.raises(ConfigError, match=r"moe.backend=megablocks: it runs only on CUDA GPUs.*"
                                          r"scripts/install_megablocks.sh.*moe.backend=torch"):
        check_backend("megablocks", "cpu")


def test_megablocks_without_grouped_gemm_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "grouped_gemm", None)  # importing it now fails, installed or not
    with pytest.raises(ConfigError, match=r"grouped_gemm cannot be imported.*install_megablocks.sh"):
        check_backend("megablocks", "cuda")


def test_torch_and_auto_pass_anywhere():
    for backend in ("torch", "auto"):
        check_backend(backend, "cpu")
        check_backend(backend, "cuda")


def test_megablocks_with_fp32_and_unknown_backends_are_config_errors():
    with pytest.raises(ConfigError, match="moe.backend=megablocks computes in bf16 only"):
        load_config("moe-8x", ["moe.backend=megablocks", "train.precision=fp32"])
    with pytest.raises(ConfigError, match=r"moe.backend: 'cutlass' is not one of 'torch', 'megablocks', 'auto'"):
        load_config("moe-8x", ["moe.backend=cutlass"])


def test_train_py_refuses_megablocks_on_a_cpu_before_any_work(tmp_path, capsys, monkeypatch):
    import training.loop
    monkeypatch.setattr(training.loop, "build_model", lambda *a, **k: pytest.fail("built the model"))
    refused(capsys, ["--run-dir", str(tmp_path / "r"), "--set", *TINY, "moe.backend=megablocks",
                     "train.precision=bf16"], "moe.backend=megablocks: it runs only on CUDA GPUs")
    assert not (tmp_path / "r").exists()


def test_auto_is_the_torch_backend_on_a_cpu():
    assert _auto_backend(torch.device("cpu")) == "torch"
    torch.manual_seed(0)
    x, tokens = torch.randn(10, 8), torch.tensor([3, 0, 7])
    weights = [torch.randn(3, 8, 16), torch.randn(3, 8, 16), torch.randn(3, 16, 8)]
    assert torch.equal(expert_ffn(x, tokens, *weights, ComputeCopies(), backend="auto"),
                       expert_ffn(x, tokens, *weights, ComputeCopies()))


def _strict_gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm's ``gmm`` as its C++ entry point accepts it (cuBLAS build), computed per expert."""
    assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.int64 and batch_sizes.ndim == 1
    assert a.ndim == 2 and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert b.ndim == 3 and b.dtype == torch.bfloat16 and b.is_contiguous() and not trans_b
    assert b.shape[0] == batch_sizes.shape[0] and b.shape[1] == a.shape[1]
    assert int(batch_sizes.sum()) == a.shape[0]
    blocks = a.split(batch_sizes.tolist())
    return torch.cat([block.float() @ b[e].float() for e, block in enumerate(blocks)]).to(torch.bfloat16)


@pytest.fixture
def fake_grouped_gemm(monkeypatch):
    ops = types.ModuleType("grouped_gemm.ops")
    ops.gmm = _strict_gmm
    package = types.ModuleType("grouped_gemm")
    package.ops = ops
    monkeypatch.setitem(sys.modules, "grouped_gemm", package)
    monkeypatch.setitem(sys.modules, "grouped_gemm.ops", ops)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_megablocks_backend_hands_gmm_our_stacked_weights_as_they_are(fake_grouped_gemm, capacity_factor):
    """The layer's output and gradients on the megablocks path (through the stand-in) equal the torch path's,
    both in bf16 autocast: the weights go in as stored ([E, D, H], [E, H, D]) and the group sizes as host int64."""
    config = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, capacity_factor=capacity_factor)
    layers = {}
    for backend in ("torch", "megablocks"):
        torch.manual_seed(0)
        layers[backend] = MoELayer(16, MoEConfig(**{**config.__dict__, "backend": backend}))
        initialize(layers[backend], 0, 0.2, 0.2)
    x = torch.randn(2, 24, 16)
    results = {}
    for backend, layer in layers.items():
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(inputs)
        out.float().square().sum().backward()
        results[backend] = [out.float(), inputs.grad] + [p.grad for p in layer.parameters()]
    for torch_value, megablocks_value in zip(results["torch"], results["megablocks"], strict=True):
        torch.testing.assert_close(megablocks_value.float(), torch_value.float(), rtol=2e-2, atol=2e-2)


def test_megablocks_refuses_fp32_tensors_at_the_call(fake_grouped_gemm):
    experts = GroupedExperts(2, 8, 16, backend="megablocks")
    torch.nn.init.normal_(experts.w_in)
    torch.nn.init.normal_(experts.w_gate)
    torch.nn.init.normal_(experts.w_out)
    with pytest.raises(ConfigError, match="computes in bf16 only"):
        experts(torch.randn(5, 8), torch.tensor([2, 3]))
