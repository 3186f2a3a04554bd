"""Quantised weights are checked, not trusted: an fp8 ``weight_block_size`` that does not give the stored scale
grid, integer scales, an integer correction bias, an fp8 weight of another format among e4m3 ones, a weight
without its scales, and MXFP4 scales that are not E8M0 bytes are each refused by name before anything is written
(a wrong block size used to dequantise with other blocks' scales, or raise an IndexError; the others were cast
without a word, or crashed in ``torch.stack``)."""

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.errors import ConfigError
from config.run import load_config
from interop.hf import import_folder
from tests.interop.hf_models import edit_config
from tests.interop.test_hf_deepseek_v3 import BLOCK, SEQ, make_deepseek, quantize_folder
from tests.interop.test_hf_gpt_oss import make_gpt_oss, quantize_experts

FP8 = {"quant_method": "fp8", "fmt": "e4m3"}
ATTENTION = "model.layers.0.self_attn.q_proj.weight"  # [40, 32]: stored scales [3, 4] for BLOCK (16, 8)
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


@pytest.fixture(scope="module")
def fp8_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8") / "hf"
    make_deepseek(folder, q_lora_rank=None, num_hidden_layers=2)
    quantize_folder(folder)
    return folder


def changed(source, target, block=None, tensors=None):
    """A copy of ``source`` with ``weight_block_size`` and some tensors changed (``tensors``: edits the dict)."""
    shutil.copytree(source, target)
    if block is not None:
        edit_config(target, quantization_config=FP8 | {"weight_block_size": block})
    if tensors is not None:
        state = load_file(target / "model.safetensors")
        tensors(state)
        save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    return target


def refused(folder, message):
    """The import of ``folder`` refused with ``message`` (literal text), writing nothing."""
    out = folder.parent / f"{folder.name}.safetensors"
    with pytest.raises(ConfigError, match=re.escape(message)):
        import_folder(folder, out, load_config("moe-8x"), seq_len=SEQ)
    assert not out.exists()


def test_a_block_size_that_does_not_give_the_stored_scale_grid_is_refused(fp8_folder, tmp_path):
    # smaller blocks need more scales than stored (was an IndexError); larger ones fewer (was silently wrong)
    for block, grid in (([8, 8], "[5, 4]"), ([32, 8], "[2, 4]")):
        refused(changed(fp8_folder, tmp_path / f"block{block[0]}", block=block),
                f"'{ATTENTION}_scale_inv' is [3, 4], but weight_block_size {block} over '{ATTENTION}' [40, 32] gives a "
                f"{grid} grid of scales: the block size does not match")
    assert list(BLOCK) == [16, 8]  # the stored grid is that of the fixture's block size, accepted:
    import_folder(fp8_folder, tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)


def test_integer_scales_and_correction_biases_are_refused(fp8_folder, tmp_path):
    def int_scales(state):
        state[f"{ATTENTION}_scale_inv"] = (state[f"{ATTENTION}_scale_inv"] * 1e3).to(torch.int32)

    def int_bias(state):
        name = "model.layers.1.mlp.gate.e_score_correction_bias"
        state[name] = (state[name] * 10).to(torch.int64)

    refused(changed(fp8_folder, tmp_path / "scales", tensors=int_scales),
            f"'{ATTENTION}_scale_inv' holds I32 values: block scales are floating point")
    refused(changed(fp8_folder, tmp_path / "bias", tensors=int_bias),
            "tensor 'model.layers.1.mlp.gate.e_score_correction_bias' has dtype I64: weights (and correction "
            "biases) are floating point")


def test_mixed_fp8_formats_and_missing_scales_are_refused(fp8_folder, tmp_path):
    def e5m2_expert(state):  # one expert of a stack in another fp8 format (was a RuntimeError in torch.stack)
        state[EXPERT] = state[EXPERT].float().to(torch.float8_e5m2)

    def no_scales(state):
        del state[f"{EXPERT}_scale_inv"]

    refused(changed(fp8_folder, tmp_path / "e5m2", tensors=e5m2_expert),
            f"tensor '{EXPERT}' is F8_E5M2, but quantization_config declares fp8 e4m3 (F8_E4M3) weights: a "
            "folder of mixed fp8 formats")
    refused(changed(fp8_folder, tmp_path / "noscales", tensors=no_scales),
            f"fp8 tensor '{EXPERT}' comes without its block scales '{EXPERT}_scale_inv'")


def test_mxfp4_scales_that_are_not_bytes_are_refused(tmp_path):
    make_gpt_oss(tmp_path / "hf", hidden_size=64, intermediate_size=32, num_hidden_layers=1)
    tensors = quantize_experts(tmp_path / "hf", torch.Generator().manual_seed(0))
    scales = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[scales] = tensors[scales].float()  # the exponent byte's value as a float: another format
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    refused(tmp_path / "hf", f"MXFP4 tensor '{scales}' holds F32 values: MXFP4 blocks (two E2M1 values per byte) "
                             "and their E8M0 scales are stored as U8 bytes")
