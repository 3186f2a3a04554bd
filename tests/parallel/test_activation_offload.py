"""``parallel.activation_offload``: the refusals, the saved-tensor bookkeeping, and the memory model's count.

The copies themselves (side stream, pinned memory, ``record_stream``) need a GPU:
``tests/gpu/test_activation_offload.py``. Here the offloader runs with a host "transport" (plain clones, no
streams) so its hooks, its prefetch order and the gradients through it can be checked on a CPU.
"""

import copy

import pytest
import torch
from torch import nn

from analysis.memory_activations import micro_batch_activations
from config.errors import ConfigError
from config.run import load_config
from moe.transformer import MoETransformer
from parallel.activation_offload import ActivationOffloader, apply_activation_offload
from parallel.hardware import check_hardware
from parallel.resolve import resolve_layout
from parallel.tensor import lm_loss
from tests.test_cli_faults import refused
from tests.training.test_data_loss import TINY


class HostTransport(ActivationOffloader):
    """The offloader with clones for copies, recording what moves when."""

    def __init__(self):
        super().__init__()
        self.events = []
        self.moved = []  # the tensors sent out, kept alive so that their addresses are not reused

    def _offloads(self, tensor):
        return not isinstance(tensor, nn.Parameter)

    def _to_host(self, tensor):
        self.events.append(("out", id(tensor)))
        self.moved.append(tensor)
        return tensor.detach().clone()

    def _unpack(self, index, saved):
        self.events.append(("request", index))
        return super()._unpack(index, saved)

    def _start_restore(self, saved):
        if saved.restored is None:
            self.events.append(("restore", self._module_of(saved)))
            saved.restored = saved.host.clone()

    def _wait(self, saved):
        self.events.append(("unpack", self._module_of(saved)))
        return saved.restored

    def _module_of(self, saved):
        return next(i for i, group in self.saved.items() if any(s is saved for s in group))


def tiny_model(*overrides):
    config = load_config("moe-8x", [*TINY, "model.n_layers=3", *overrides])
    torch.manual_seed(0)
    return MoETransformer(config.model, config.moe, seed=0), config


def gradients(model, config):
    """One forward and backward in bf16 autocast (so the experts keep bf16 weight copies); the gradients."""
    tokens = torch.randint(0, 256, (2, config.model.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["blocks", "moe"])
def test_offloaded_modules_give_the_same_gradients_and_restore_in_order(mode):
    model, config = tiny_model()
    reference = gradients(copy.deepcopy(model), config)
    offloader = HostTransport()
    modules = list(model.layers.values()) if mode == "blocks" else list(model.moe_layers().values())
    for index, module in enumerate(modules):
        offloader.wrap(module, index)
    names = [name for name, _ in model.named_parameters()]
    for got, expected in zip(gradients(model, config), reference, strict=True):
        assert torch.equal(got, expected)
    assert [name for name, _ in model.named_parameters()] == names
    assert all(offloader.saved[i] for i in range(len(modules)))  # each module offloaded something
    # the experts' bf16 weight copies, kept for the step, stay where they are
    copies = [c.untyped_storage().data_ptr() for m in model.modules() if hasattr(m, "compute_copies")
              for c in m.compute_copies.tensors()]
    assert copies and not set(copies) & {tensor.untyped_storage().data_ptr() for tensor in offloader.moved}
    moved = sum(len(group) for group in offloader.saved.values())
    assert sum(kind == "out" for kind, _ in offloader.events) == moved
    # every module but the last (the first in backward: copied back on demand) comes back whole, prefetched
    for i in range(len(modules) - 1):
        assert offloader.events.count(("restore", i)) == len(offloader.saved[i])
    # backward runs the modules last to first: module i-1's copies back start when module i's backward first asks
    # for a tensor (not before: two modules on the device at most), and are all started before module i-1's first
    # unpack (they overlap module i's backward)
    events = [event for event in offloader.events if event[0] != "out"]
    for i in range(1, len(modules)):
        restores = [n for n, event in enumerate(events) if event == ("restore", i - 1)]
        assert events.index(("request", i)) < min(restores)
        assert max(restores) < events.index(("unpack", i - 1))


def test_refused_on_cpu_with_checkpointing_pipelines_and_compile(tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"parallel.activation_offload=moe moves activations from GPU memory to "
                                          r"pinned host memory, and this run has no GPU"):
        check_hardware(load_config("moe-8x", ["parallel.activation_offload=moe"]), "cpu")
    check_hardware(load_config("moe-8x", ["parallel.activation_offload=moe"]), "cuda")
    with pytest.raises(ConfigError, match="choose one"):
        load_config("moe-8x", ["parallel.activation_offload=blocks", "parallel.activation_checkpointing=full"])
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        load_config("moe-8x", ["parallel.activation_offload=blocks", "parallel.pp=2"])
    with pytest.raises(ConfigError, match="train.compile with parallel.activation_offload"):
        load_config("moe-8x", ["parallel.activation_offload=blocks", "train.compile=true"])
    with pytest.raises(ValueError, match="not one of none, blocks, moe"):
        apply_activation_offload(tiny_model()[0], "layers")
    if not torch.cuda.is_available():
        refused(capsys, ["--run-dir", str(tmp_path / "r"), "--set", *TINY, "parallel.activation_offload=blocks"],
                "this run has no GPU")
        assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("mode", ["blocks", "moe"])
def test_the_memory_model_keeps_two_offloaded_modules_on_the_device(mode):
    """moe-8x's four blocks are alike: offloading keeps what is outside the offloaded modules plus two of them."""
    base = load_config("moe-8x", ["train.precision=fp32"])
    offloaded = load_config("moe-8x", ["train.precision=fp32", f"parallel.activation_offload={mode}"])
    layout = resolve_layout(base, 1)[0]
    before = micro_batch_activations(base, layout, 16, "fp32")
    after = micro_batch_activations(offloaded, layout, 16, "fp32")
    moved = ("norms", "attention", "MoE router", "MoE experts", "MoE combine") if mode == "blocks" else \
        ("MoE router", "MoE experts", "MoE combine")
    per_module = sum(before[name] for name in moved) // base.model.n_layers
    assert after == {**{k: v for k, v in before.items() if k not in moved},
                     f"offloaded {mode} in flight": 2 * per_module}
    assert sum(after.values()) < sum(before.values())
