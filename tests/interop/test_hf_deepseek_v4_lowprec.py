"""DeepSeek-V4's published low-precision folders (DeepSeek-V4-Flash, -Pro): a tiny V4 written in their layout —
DeepSeek's names, fp8 e4m3 linear weights with ue8m0 block scales under ``X.scale``, the routed experts packed
fp4 (E2M1 pairs in ``I8`` bytes, one E8M0 scale per 32 inputs), ``expert_dtype: fp4`` at config.json's top level —
quantised here by a naive encoder written from the formats' definitions (OCP MX v1.0: E2M1 values, E8M0 = 2^(b -
127); fp8 e4m3 through torch's cast). Our import equals a naive dequantiser's values bit for bit, and gives the
logits of ``transformers``' DeepSeek-V4 loaded from those dequantised weights; what the layout cannot be read as is
refused by name."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.errors import ConfigError
from config.run import load_config
from interop.hf import HFWeights, import_folder
from interop.hf_folder import HFFolder
from tests.interop.hf_models import edit_config, our_model
from tests.interop.test_hf_deepseek_v4 import SEQ, published_name, tokens
from tests.interop.test_hf_deepseek_v4_mtp import make_v4_with_mtp

transformers = pytest.importorskip("transformers")
BLOCK = (4, 16)  # the fp8 scale block (published: 128 × 128); small: several per matrix, some cut by its edge
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # OCP MX v1.0 table 5: the magnitudes of codes 0..7 (bit 3: sign)
FP8_WEIGHTS = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3")
QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                "weight_block_size": list(BLOCK)}
EXPERT = "layers.1.ffn.experts.2.w2"  # a routed expert's down projection [64, 32]: one scale per row


def e8m0_exponent(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """The power of two that brings ``amax`` within a format's ``largest`` value, rounded up (a power-of-two scale:
    DeepSeek's ``fast_round_scale``, 2^ceil(log2(amax / max)))."""
    return torch.ceil(torch.log2(amax.clamp(min=2.0 ** -100) / largest)).to(torch.int32)


def encode_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp8 e4m3 values, E8M0 scale bytes per BLOCK, and the naive dequantisation (value · 2^(byte - 127))."""
    grid = [math.ceil(size / step) for size, step in zip(weight.shape, BLOCK, strict=True)]
    values, exponents = torch.empty_like(weight), torch.empty(grid, dtype=torch.int32)
    reference = torch.empty_like(weight)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
            exponents[i, j] = e8m0_exponent(weight[part].abs().max(), 448.0)  # e4m3's largest finite value
            values[part] = weight[part] / 2.0 ** exponents[i, j].item()
    quantized = values.to(torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
            reference[part] = quantized[part].float() * 2.0 ** exponents[i, j].item()
    return quantized, (exponents + 127).to(torch.uint8), reference


def encode_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> E2M1 codes packed two to a byte (the lower index in the low nibble) as int8 [out, in / 2],
    E8M0 scale bytes [out, in / 32], and the naive dequantisation (table value · 2^(byte - 127))."""
    out, inputs = weight.shape
    blocks = weight.reshape(out, inputs // 32, 32)
    exponents = e8m0_exponent(blocks.abs().amax(dim=-1), 6.0)  # E2M1's largest value
    scaled = blocks / torch.pow(2.0, exponents.float()).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1)
    nearest = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = (nearest + 8 * (scaled < 0)).reshape(out, inputs).to(torch.uint8)
    decoded = torch.where(codes >= 8, -1.0, 1.0) * magnitudes[(codes & 7).long()]
    reference = (decoded.reshape(out, inputs // 32, 32) * torch.pow(2.0, exponents.float()).unsqueeze(-1))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8)
    return packed, (exponents + 127).to(torch.uint8), reference.reshape(out, inputs)


def publish(folder: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Rewrite a ``make_v4`` folder in the published layout; returns the dequantised reference of every tensor
    (under ``transformers``' names, as fp32) and every fp4 code written."""
    reference, published, codes = {}, {}, []
    for name, tensor in load_file(folder / "model.safetensors").items():
        short = published_name(name).removesuffix(".weight")
        if short.endswith(FP8_WEIGHTS):
            quantized, exponents, reference[name] = encode_fp8(tensor)
            published[short + ".weight"] = quantized
            published[short + ".scale"] = exponents.view(torch.float8_e8m0fnu)
        elif ".ffn.experts." in short:
            packed, exponents, reference[name] = encode_fp4(tensor)
            published[short + ".weight"], published[short + ".scale"] = packed, exponents.view(torch.float8_e8m0fnu)
            codes.append(torch.stack((packed.view(torch.uint8) & 15, packed.view(torch.uint8) >> 4)).flatten())
        else:
            reference[name] = published[published_name(name)] = tensor
    save_file(published, folder / "model.safetensors", metadata={"format": "pt"})
    edit_config(folder, quantization_config=QUANTIZATION, expert_dtype="fp4")
    return reference, torch.cat(codes)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """The published folder (with its MTP layer, quantised alike), its reference, and a float folder of that
    reference (``transformers``' layout)."""
    root = tmp_path_factory.mktemp("v4")
    make_v4_with_mtp(root / "float", hidden_size=64, moe_intermediate_size=32)  # inputs a multiple of 32, as fp4
    shutil.copytree(root / "float", root / "published")
    reference, codes = publish(root / "published")
    save_file(reference, root / "float" / "model.safetensors", metadata={"format": "pt"})
    return root, reference, codes


def test_published_low_precision_folder_imports_as_its_dequantisation(v4):
    """Every fp8 and fp4 weight imports bit for bit as the naive dequantisation (all 16 E2M1 codes occur, -0
    included); the model gives the logits of ``transformers``' V4 loaded from those dequantised weights; a box
    across a 32-value block boundary reads the same values as the whole."""
    root, reference, codes = v4
    assert torch.equal(torch.unique(codes), torch.arange(16, dtype=torch.uint8))
    config = import_folder(root / "published", root / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    state = load_file(root / "ours.safetensors")
    assert state["layers.1.moe.experts.w_out"].dtype == torch.bfloat16
    assert torch.equal(state["layers.1.moe.experts.w_out"][2].float(),
                       reference["model.layers.1.ffn.experts.2.w2.weight"].t())
    assert torch.equal(state["layers.2.moe.experts.w_gate"][3].float(),
                       reference["model.layers.2.ffn.experts.3.w1.weight"].t())
    assert torch.equal(state["layers.0.moe.shared_experts.w_out.weight"].float(),
                       reference["model.layers.0.ffn.shared_experts.w2.weight"])
    assert torch.equal(state["layers.1.attn.q_a_proj.weight"].float(), reference["model.layers.1.attn.wq_a.weight"])
    ours = our_model(root / "ours.safetensors")
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(root / "float").eval()
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), oracle(tokens()).logits, rtol=0, atol=1e-5)

    with_mtp = load_config("moe-8x", ["model.mtp_depth=1"])
    import_folder(root / "published", root / "mtp.safetensors", with_mtp, seq_len=SEQ)
    state = load_file(root / "mtp.safetensors")
    assert torch.equal(state["mtp.0.block.moe.experts.w_in"][1].float(),
                       reference["mtp.0.ffn.experts.1.w3.weight"].t())
    assert torch.equal(state["mtp.0.block.attn.o_b_proj.weight"].float(), reference["mtp.0.attn.wo_b.weight"])

    with HFFolder(root / "published") as folder:
        weights = HFWeights.of_family(folder, config.model, config.moe)
        name = "layers.1.moe.experts.w_gate"
        assert weights.dtype(name) == torch.bfloat16 and weights.shape(name) == (4, 64, 32)
        box = (slice(1, 3), slice(20, 45), slice(3, 11))
        assert torch.equal(weights.read(name, box), weights.read(name, ())[box])


def test_transformers_reads_the_folder_as_the_reference(v4, monkeypatch):
    """``transformers``' own dequantising load of the published folder (``FineGrainedFP8Config(dequantize=True)``,
    the rest from its config.json: its ``.scale`` renaming, fp4 unpacking and E8M0 decoding) holds the naive
    dequantisation bit for bit: the folder is in the layout ``transformers`` reads too, and our import equals both.
    (Its fp8 quantizer asks for ``accelerate``, for device placement, which a dequantising CPU load does not use
    and this environment lacks: the check is answered yes.)"""
    from transformers.quantizers import quantizer_finegrained_fp8

    root, reference = v4[0], transformers.DeepseekV4ForCausalLM.from_pretrained(v4[0] / "float").state_dict()
    monkeypatch.setattr(quantizer_finegrained_fp8, "is_accelerate_available", lambda: True)
    theirs = transformers.DeepseekV4ForCausalLM.from_pretrained(
        root / "published", quantization_config=transformers.FineGrainedFP8Config(dequantize=True)).state_dict()
    assert theirs.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(theirs[name].float(), value.float()), name


def refused(source: Path, target: Path, message: str, tensors=None, **config) -> None:
    """A copy of ``source`` with ``tensors`` (an edit of the published dict) and ``config`` changed: its import
    refused with ``message`` (literal text), writing nothing."""
    shutil.copytree(source, target)
    if tensors is not None:
        state = load_file(target / "model.safetensors")
        tensors(state)
        save_file(state, target / "model.safetensors", metadata={"format": "pt"})
    if config:
        edit_config(target, **config)
    out = target.parent / f"{target.name}.safetensors"
    with pytest.raises(ConfigError, match=re.escape(message)):
        import_folder(target, out, load_config("moe-8x"), seq_len=SEQ)
    assert not out.exists()


def test_what_cannot_be_read_is_refused_by_name(v4, tmp_path):
    root = v4[0] / "published"
    weight, scales = f"model.{EXPERT}.weight", f"model.{EXPERT}.weight_scale_inv"

    def scale_of_16(state):  # one scale per 16 values: another format
        state[EXPERT + ".scale"] = state[EXPERT + ".scale"].repeat_interleave(2, dim=1)

    def float_scales(state):
        state[EXPERT + ".scale"] = state[EXPERT + ".scale"].float()

    def bytes_unsigned(state):
        state[EXPERT + ".weight"] = state[EXPERT + ".weight"].view(torch.uint8)

    refused(root, tmp_path / "block16", f"'{scales}' is [64, 2], but fp4 tensor '{weight}' [64, 16] holds [64, 32] "
                                        "values, which take one scale per 32 of a row: [64, 1]", scale_of_16)
    refused(root, tmp_path / "f32", f"'{scales}' holds F32 values: fp4 experts' scales are E8M0 exponents",
            float_scales)
    def float4_pairs(state):  # torch's float4_e2m1fn_x2 (safetensors F4): the same bytes, another dtype's shape
        state[EXPERT + ".weight"] = state[EXPERT + ".weight"].view(torch.float4_e2m1fn_x2)

    refused(root, tmp_path / "u8", f"tensor '{weight}' is U8, but expert_dtype fp4 experts are stored as I8",
            bytes_unsigned)
    refused(root, tmp_path / "f4", f"tensor '{weight}' is F4, but expert_dtype fp4 experts are stored as I8",
            float4_pairs)
    first = "model.layers.0.ffn.experts.0.w3.weight"  # the first expert read
    refused(root, tmp_path / "fp8experts", f"tensor '{first}' is I8 with scales '{first}_scale_inv': packed fp4, "
                                           "which config.json does not declare", expert_dtype="fp8")
    refused(root, tmp_path / "nvfp4", "expert_dtype='nvfp4' is not supported", expert_dtype="nvfp4",
            quantization_config=QUANTIZATION | {"expert_dtype": "nvfp4"})
    refused(root, tmp_path / "disagree", "config.json expert_dtype='fp4' disagrees with quantization_config's "
            "expert_dtype='fp8'", quantization_config=QUANTIZATION | {"expert_dtype": "fp8"})
    refused(root, tmp_path / "ue4m3", "scale_fmt='ue4m3' is not supported",
            quantization_config=QUANTIZATION | {"scale_fmt": "ue4m3"})


def test_ue8m0_scales_as_bytes_or_floats_read_as_their_powers_of_two(tmp_path):
    """The other ways a ue8m0 scale is stored: as its exponent byte (U8: read as 2^(b - 127), only where
    config.json says ue8m0) or as the power of two in fp32 (DeepSeek-V3.1's and V3.2's folders)."""
    from interop.fp8 import Scheme, check_scaled, dequantize

    weight = torch.randn(16, 32) * 3
    quantized, exponents, reference = encode_fp8(weight)
    box = (slice(0, 16), slice(0, 32))
    grid, as_floats = tuple(exponents.shape), torch.ldexp(torch.ones(exponents.shape), exponents.int() - 127)
    for stored in (exponents, as_floats, exponents.view(torch.float8_e8m0fnu)):
        assert torch.equal(dequantize(quantized, stored, *box, BLOCK), reference.to(torch.bfloat16))
    check_scaled("w", "F8_E4M3", (16, 32), ("U8", grid), Scheme(BLOCK, ue8m0=True, fp4_experts=False))
    with pytest.raises(ConfigError, match=re.escape("'w_scale_inv' holds U8 values: block scales are floating")):
        check_scaled("w", "F8_E4M3", (16, 32), ("U8", grid), Scheme(BLOCK, ue8m0=False, fp4_experts=False))


def test_config_json_as_published_declares_the_scheme():
    """The published config.json's ``quantization_config`` and top-level ``expert_dtype`` (V4), or the key inside
    ``quantization_config`` (V4.1, and what ``transformers`` saves), read alike."""
    from interop.fp8 import Scheme, scheme

    wanted = Scheme((128, 128), ue8m0=True, fp4_experts=True)
    published = QUANTIZATION | {"weight_block_size": [128, 128]}
    assert scheme({"quantization_config": published, "expert_dtype": "fp4"}) == wanted
    assert scheme({"quantization_config": published | {"expert_dtype": "fp4"}}) == wanted
    assert scheme({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}) == Scheme(
        (128, 128), ue8m0=False, fp4_experts=False)
