"""``inference.load_model``: one call loads a run directory, a checkpoint, an export or an HF folder, and the
model holds exactly the checkpoint's tensors (read back by DCP into a plain model, the independent path)."""

import shutil

import pytest
import torch

from config.errors import ConfigError
from inference import load_model
from interop.export import consolidated_state, export_checkpoint
from parallel.checkpoint import CheckpointCorruptError


def test_a_run_directory_a_checkpoint_and_an_export_load_the_same_tensors(trained_run, tmp_path):
    expected, _, checkpoint = consolidated_state(trained_run / "checkpoints")
    assert checkpoint.name == "step_0000003"  # the final checkpoint, the newest
    exported = tmp_path / "model.safetensors"
    export_checkpoint(checkpoint, exported)
    for source in (trained_run, trained_run / "checkpoints", checkpoint, exported):
        loaded = load_model(source)
        state = loaded.model.state_dict()
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(state[name], value), (source, name)
        assert not loaded.model.training and loaded.config.moe.capacity_factor is None  # eval, dropless
        assert loaded.tokenizer is not None and loaded.tokenizer.vocab_size == 256
        assert torch.equal(loaded.model.rope_cos, expected_rope(loaded))


def expected_rope(loaded):
    """cos of RoFormer's angles (eq. 34) written out: position p, channel pair i turns by p / theta^(2i / d)."""
    config = loaded.config.model
    pairs = torch.arange(0, config.head_size, 2, dtype=torch.float32) / config.head_size
    return torch.outer(torch.arange(config.seq_len, dtype=torch.float32), 1.0 / config.rope_theta ** pairs).cos()


def test_dtype_casts_the_weights_and_keeps_the_tables(trained_run):
    model = load_model(trained_run, dtype=torch.bfloat16).model
    assert model.tok_embeddings.weight.dtype == torch.bfloat16 and model.rope_cos.dtype == torch.float32


def test_bad_sources_are_named(trained_run, tmp_path):
    with pytest.raises(ConfigError, match="no such file or folder"):
        load_model(tmp_path / "nowhere")
    empty_run = tmp_path / "empty"
    empty_run.mkdir()
    (empty_run / "config.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError, match="a run directory without a checkpoint"):
        load_model(empty_run)
    damaged = tmp_path / "damaged"
    shutil.copytree(trained_run / "checkpoints" / "step_0000003", damaged)
    shard = next(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptError, match="distcp"):
        load_model(damaged)
