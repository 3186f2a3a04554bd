"""``moe.workspace``: kept CPU storages handed out again only once nothing refers to them."""

import pytest
import torch

from moe import workspace


@pytest.fixture
def pool(monkeypatch):
    """A fresh workspace whose every storage of 1 KiB or more is kept (tests use small tensors)."""
    fresh = workspace.Workspace()
    monkeypatch.setattr(workspace, "MIN_BYTES", 1024)
    monkeypatch.setattr(workspace, "_CPU_WORKSPACE", fresh)
    return fresh


def address(tensor):
    return tensor.untyped_storage().data_ptr()


def test_a_buffer_is_reused_only_once_its_tensors_are_gone(pool):
    first = workspace.empty((64, 32), torch.float32, torch.device("cpu"))
    kept = address(first)
    view = first[:8]
    del first
    second = workspace.empty((64, 32), torch.float32, torch.device("cpu"))
    assert address(second) != kept  # a view still refers to the first storage
    del view
    third = workspace.empty((32, 64), torch.float32, torch.device("cpu"))
    assert address(third) == kept and third.shape == (32, 64)
    assert len(pool.storages()) == 2


def test_a_tensor_autograd_saved_stays_busy_until_backward(pool):
    weight = torch.randn(64, 32, requires_grad=True)
    buffer = workspace.empty((64, 32), torch.float32, torch.device("cpu")).fill_(2.0)
    kept = address(buffer)
    loss = (weight * buffer).sum()  # mul saves the buffer for weight's gradient
    del buffer
    other = workspace.empty((64, 32), torch.float32, torch.device("cpu")).fill_(5.0)
    assert address(other) != kept
    loss.backward()
    assert torch.equal(weight.grad, torch.full((64, 32), 2.0))  # the saved buffer was not overwritten
    del loss  # the graph and what it saved are gone: the buffer is idle
    assert address(workspace.empty((64, 32), torch.float32, torch.device("cpu"))) == kept
    assert address(other) != kept


def test_a_kept_storage_serves_requests_slightly_smaller_only(pool):
    kept = address(workspace.empty((1000, 16), torch.float32, torch.device("cpu")))
    slightly = workspace.empty((980, 16), torch.float32, torch.device("cpu"))  # 2% smaller: the same storage
    assert address(slightly) == kept
    del slightly
    much = workspace.empty((500, 16), torch.float32, torch.device("cpu"))  # half: a storage of its own
    assert address(much) != kept and much.untyped_storage().nbytes() == 500 * 16 * 4


def test_idle_storages_never_exceed_busy_ones_after_a_new_allocation(pool):
    for rows in (100, 200, 300, 400):  # each freed at once: idle
        workspace.empty((rows, 16), torch.float32, torch.device("cpu"))
    busy = workspace.empty((1000, 16), torch.float32, torch.device("cpu"))
    sizes = {storage.nbytes() for storage in pool.storages()}
    assert busy.untyped_storage().nbytes() in sizes
    idle = sum(size for size in sizes if size != busy.untyped_storage().nbytes())
    assert idle <= busy.untyped_storage().nbytes()
    assert 400 * 16 * 4 in sizes and 100 * 16 * 4 not in sizes  # the least recently used went first
    workspace.release_workspace()
    assert [storage.nbytes() for storage in pool.storages()] == [busy.untyped_storage().nbytes()]


def test_small_tensors_and_other_devices_are_not_kept(pool):
    small = workspace.empty((8, 8), torch.float32, torch.device("cpu"))  # 256 bytes < MIN_BYTES
    meta = workspace.empty((4096, 4096), torch.float32, torch.device("meta"))
    assert small.shape == (8, 8) and meta.device.type == "meta"
    assert pool.storages() == []


def test_bypassed_hands_out_allocator_buffers(pool):
    """Memory measurements read the allocator's events: inside ``bypassed`` nothing is kept or reused."""
    kept = address(workspace.empty((64, 32), torch.float32, torch.device("cpu")))
    with workspace.bypassed():
        fresh = workspace.empty((64, 32), torch.float32, torch.device("cpu"))
    assert address(fresh) != kept and len(pool.storages()) == 1
