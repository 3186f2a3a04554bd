"""What the Hugging Face interop tests share: tiny random models saved as folders, our files read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from config.errors import ConfigError
from config.run import config_from_dict
from interop.export import CONFIG_METADATA_KEY
from interop.hf import import_folder
from moe.transformer import MoETransformer
from parallel.materialize import load_weights_file


def randomise_norms(model: torch.nn.Module) -> None:
    """Norm weights away from 1 (q/k norms too), so a swapped or dropped norm shows in the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))


def save_random(model: torch.nn.Module, folder: Path, shard: bool = False) -> torch.nn.Module:
    """``model`` (a transformers model, freshly built) with its norms randomised, saved to ``folder`` in 20 KB
    shards or one file; returned in eval mode."""
    randomise_norms(model)
    model.save_pretrained(folder, max_shard_size="20KB" if shard else "5GB")
    return model.eval()


def our_model(file: Path) -> MoETransformer:
    """Our model as one of our safetensors files holds it: its config from the metadata, then its weights."""
    with safe_open(str(file), framework="pt") as handle:
        config = config_from_dict(yaml.safe_load(handle.metadata()[CONFIG_METADATA_KEY]))
    model = MoETransformer(config.model, config.moe).eval()
    load_weights_file(model, file)
    return model


def hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def assert_same_tensors(original_folder: Path, returned_folder: Path, tied: bool) -> None:
    """The folder an export wrote holds the original folder's tensors, bit for bit, and no others (a tied model's
    ``lm_head.weight``, which an export leaves to the embedding, aside)."""
    original, returned = hf_tensors(original_folder), hf_tensors(returned_folder)
    if tied:
        original.pop("lm_head.weight", None)
    assert original.keys() == returned.keys()
    for name, value in original.items():
        assert torch.equal(value, returned[name]), name


def assert_oracle_and_export_back(folder: Path, hf, ours: MoETransformer, x: torch.Tensor, architecture: str,
                                  tied: bool, dtype: str | None = None, named: bool = False) -> None:
    """``ours`` (imported from ``folder``/hf as ``folder``/ours.safetensors) gives the oracle ``hf``'s logits on ``x``;
    our file exported to ``folder``/back (in ``dtype``, default the family's) is an ``architecture`` folder that
    transformers loads and runs to the same logits, every tensor bit-exact with the original folder's. ``named``:
    the export names ``architecture`` (a family whose models an earlier family expresses too: GLM-5's are
    DeepSeek-V3.2's), else it must pick it itself."""
    import transformers

    from interop.hf import export_folder

    with torch.no_grad():
        expected = hf(x).logits
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-5)
    export_folder(folder / "ours.safetensors", folder / "back", architecture if named else None, dtype=dtype)
    back = transformers.AutoModelForCausalLM.from_pretrained(folder / "back").eval()
    assert type(back).__name__ == architecture
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, expected, rtol=0, atol=1e-5)
    assert_same_tensors(folder / "hf", folder / "back", tied=tied)


def edit_config(folder: Path, **changes) -> None:
    """Set keys of a saved folder's config.json."""
    path = folder / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def assert_each_edit_refused(folder: Path, cases: list[tuple[dict, str]], out: Path, base: Path, seq_len: int) -> None:
    """Each ``(changes, message)`` of ``cases``, applied alone to ``folder``'s config.json, makes the import refuse
    the folder with a ConfigError matching ``message``; the config is restored afterwards."""
    original = (folder / "config.json").read_text()
    try:
        for changes, message in cases:
            (folder / "config.json").write_text(original)
            edit_config(folder, **changes)
            with pytest.raises(ConfigError, match=message):
                import_folder(folder, out, base, seq_len=seq_len)
    finally:
        (folder / "config.json").write_text(original)
