"""Writing a safetensors file is all or nothing, also against a second writer of the same path and an interrupt."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from interop.export import write_safetensors_streaming

ENTRIES = {"a": (torch.Size([3]), torch.float32), "b": (torch.Size([2, 2]), torch.float32)}


def _values(fill: float):
    return lambda name: torch.full(ENTRIES[name][0], fill)


def test_a_second_writer_of_the_same_path_never_mixes_with_the_first(tmp_path):
    out = tmp_path / "model.safetensors"

    def first(name):  # while the first writer is between its tensors, a second export to the same path runs whole
        if name == "b":
            write_safetensors_streaming(out, ENTRIES, _values(2.0), {"writer": "second"})
            assert (load_file(out)["a"] == 2.0).all()
        return _values(1.0)(name)

    write_safetensors_streaming(out, ENTRIES, first, {"writer": "first"})
    tensors = load_file(out)
    assert all((tensor == 1.0).all() for tensor in tensors.values())  # the last to finish, whole; no mix
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temporary file left behind


def test_an_interrupted_write_leaves_the_earlier_file_as_it_was(tmp_path):
    out = tmp_path / "model.safetensors"
    write_safetensors_streaming(out, ENTRIES, _values(1.0), {})
    before = out.read_bytes()

    def interrupted(name):
        if name == "b":
            raise KeyboardInterrupt
        return _values(3.0)(name)

    with pytest.raises(KeyboardInterrupt):
        write_safetensors_streaming(out, ENTRIES, interrupted, {})
    assert out.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_non_finite_weight_is_refused_naming_it_and_nothing_is_written(tmp_path):
    from config.errors import ConfigError

    out = tmp_path / "model.safetensors"
    with pytest.raises(ConfigError, match=r"writing .*model\.safetensors: tensor 'b' holds 4 NaN or infinite"):
        write_safetensors_streaming(out, ENTRIES, lambda name: _values(1.0 if name == "a" else float("inf"))(name), {})
    assert list(tmp_path.iterdir()) == []


def folder_bytes(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_a_folder_export_interrupted_leaves_the_earlier_folder_whole(tmp_path):
    from storage.files import atomic_folder

    out = tmp_path / "hf"
    with atomic_folder(out) as folder:  # an earlier export: two shards and an index
        for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "index.json"):
            (folder / name).write_text(f"old {name}")
    before = folder_bytes(out)
    with pytest.raises(KeyboardInterrupt), atomic_folder(out) as folder:  # Ctrl-C mid re-export
        (folder / "model-00001-of-00003.safetensors").write_text("new")
        raise KeyboardInterrupt
    assert folder_bytes(out) == before and [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_two_folder_exports_at_once_never_mix_and_the_last_to_publish_wins_whole(tmp_path):
    from storage.files import atomic_folder

    out = tmp_path / "hf"
    with atomic_folder(out) as first:
        (first / "model-00001-of-00002.safetensors").write_text("first")
        with atomic_folder(out) as second:  # a second export to the same folder runs whole meanwhile
            (second / "model.safetensors").write_text("second")
        assert folder_bytes(out) == {"model.safetensors": b"second"}
        (first / "model-00002-of-00002.safetensors").write_text("first")
    assert folder_bytes(out) == {"model-00001-of-00002.safetensors": b"first",
                                 "model-00002-of-00002.safetensors": b"first"}
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # nothing temporary or replaced left behind
