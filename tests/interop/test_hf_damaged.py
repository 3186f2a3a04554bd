"""Damaged Hugging Face folders (a download cut short, a garbled index or config) are one message naming the file,
exit status 2 and no traceback, through `moe-hf import`, `train.py --init-from hf:` and upcycling alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import train
from interop.hf import main as hf_main
from interop.hf_shards import INDEX_FILE, SINGLE_FILE
from interop.upcycle import main as upcycle_main
from tests.interop.test_hf import TINY_RUN, make_hf

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Mixtral in one file and in shards, and a tiny Llama (a dense source for upcycling)."""
    root = tmp_path_factory.mktemp("hf")
    make_hf(root / "single")
    make_hf(root / "sharded", shard=True)
    torch_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    torch_model.save_pretrained(root / "llama")
    return root


def _truncate(path: Path, keep: float) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def _weights(folder: Path) -> Path:
    return folder / SINGLE_FILE


DAMAGE = {
    "weights cut short": ("single", lambda f: _truncate(_weights(f), 0.6), SINGLE_FILE),
    "weights empty": ("single", lambda f: _weights(f).write_bytes(b""), SINGLE_FILE),
    "weights garbage": ("single", lambda f: _weights(f).write_bytes(b"\x07garbage" * 64), SINGLE_FILE),
    "index a list": ("sharded", lambda f: (f / INDEX_FILE).write_text("[]"), INDEX_FILE),
    "index cut short": ("sharded", lambda f: _truncate(f / INDEX_FILE, 0.5), INDEX_FILE),
    "index without weight_map": ("sharded", lambda f: (f / INDEX_FILE).write_text('{"metadata": {}}'), INDEX_FILE),
    "config a list": ("single", lambda f: (f / "config.json").write_text("[1, 2]"), "config.json"),
    "config not UTF-8": ("single", lambda f: (f / "config.json").write_bytes(b'{"a": "\xe9"}'), "config.json"),
}


def _damaged(folders: Path, tmp_path: Path, case: str) -> tuple[Path, str]:
    source, damage, named = DAMAGE[case]
    folder = tmp_path / source
    shutil.copytree(folders / source, folder)
    damage(folder)
    return folder, named


def _one_message(capsys, named: str) -> None:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert named in err, err


@pytest.mark.parametrize("case", list(DAMAGE))
def test_import_of_a_damaged_folder_is_one_message_naming_the_file(folders, tmp_path, capsys, case):
    folder, named = _damaged(folders, tmp_path, case)
    out = tmp_path / "ours.safetensors"
    assert hf_main(["import", str(folder), "--out", str(out), "--seq-len", "16"]) == 2
    _one_message(capsys, named)
    assert not out.exists()


@pytest.mark.parametrize("case", ["weights cut short", "index without weight_map", "config a list"])
def test_init_from_a_damaged_folder_is_one_message_naming_the_file(folders, tmp_path, capsys, case):
    folder, named = _damaged(folders, tmp_path, case)
    status = train.main(["--init-from", f"hf:{folder}", "--run-dir", str(tmp_path / "run"), "--set", *TINY_RUN])
    assert status == 2
    _one_message(capsys, named)


@pytest.mark.parametrize("damage", ["cut short", "config a list"])
def test_upcycling_a_damaged_dense_folder_is_one_message_naming_the_file(folders, tmp_path, capsys, damage):
    folder = tmp_path / "llama"
    shutil.copytree(folders / "llama", folder)
    if damage == "cut short":
        _truncate(_weights(folder), 0.6)
        named = SINGLE_FILE
    else:
        (folder / "config.json").write_text(json.dumps([1]))
        named = "config.json"
    out = tmp_path / "moe.safetensors"
    assert upcycle_main([str(folder), "--experts", "4", "--top-k", "2", "--out", str(out),
                         "--set", "model.seq_len=16"]) == 2
    _one_message(capsys, named)
    assert not out.exists()
