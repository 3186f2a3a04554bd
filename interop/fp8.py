"""FP8 weights with block scales, dequantised as they are read.

DeepSeek-V3 publishes its linear weights as float8 e4m3 (``F8_E4M3``) with one fp32 scale per 128 × 128 block
(``quantization_config``: ``quant_method: fp8``, ``weight_block_size: [128, 128]``): the tensor ``X.weight``
[out, in] comes with ``X.weight_scale_inv`` [ceil(out / 128), ceil(in / 128)], and the weight is
``X.weight[i, j] · scale_inv[i // 128, j // 128]`` (despite the name, a multiplication: DeepSeek's own
``weight_dequant``). We train in bf16/fp32, so import dequantises each box it reads, to bf16 (the precision the
scales were fitted for; DeepSeek's own conversion writes bf16). Any box of a weight needs only the scale blocks
over it, so ``--init-from hf:DIR`` ranks still read just their part.

``scale_fmt: ue8m0`` (DeepSeek-V3.1's, V3.2's and V4's configs) says the scales are powers of two. V3.1/V3.2
store them as fp32 all the same; DeepSeek-V4's published folders store them as ``F8_E8M0`` (torch's
``float8_e8m0fnu``: the byte b means 2^(b - 127), 255 NaN; the OCP MX v1.0 E8M0), under ``X.scale`` rather than
``X.weight_scale_inv`` (``transformers``' fine-grained fp8 quantizer renames ``.scale`` so "e.g.
DeepSeek-V4-Flash"; a published index lists ``layers.0.attn.wq_a.weight F8_E4M3`` beside ``layers.0.attn.wq_a.scale
F8_E8M0``). Under ``ue8m0`` scales stored as bytes (``U8``) are read as those exponents (``transformers``'
``Fp8Dequantize`` does so for MXFP8 checkpoints); otherwise an integer scale is refused.

``expert_dtype: fp4`` (DeepSeek-V4: at config.json's top level in the published folders, inside
``quantization_config`` in V4.1's and in what ``transformers`` saves) says the routed experts are MXFP4 instead:
``interop/mxfp4.py`` reads them (``read_packed_box``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from config.errors import ConfigError

FP8_CODES = {"F8_E4M3"}  # the safetensors dtypes dequantised here
SCALE_SUFFIX = "_scale_inv"
SCALE_CODES = {"F32", "BF16", "F16", "F8_E8M0"}  # block scales whose value is their meaning (E8M0: a power of two)
E8M0_BYTES = "U8"  # a scale stored as its E8M0 exponent byte: read so only where config.json says ue8m0
SCALE_FORMATS = ("float", "ue8m0")  # quantization_config's scale_fmt: transformers' FineGrainedFP8Config's values
EXPERT_FORMATS = ("fp8", "fp4")  # expert_dtype: likewise
_CONFIG_KEYS = {"quant_method", "fmt", "weight_block_size", "activation_scheme", "scale_fmt", "expert_dtype"}


@dataclass(frozen=True)
class Scheme:
    """What config.json's fp8 ``quantization_config`` says of the stored weights."""

    block: tuple[int, int]  # (rows, columns) of an fp8 weight's scale block
    ue8m0: bool  # scale_fmt ue8m0: the scales are powers of two (bytes are read as E8M0 exponents)
    fp4_experts: bool  # expert_dtype fp4: the routed experts are packed MXFP4 (``interop/mxfp4.py``)

    @property
    def scale_codes(self) -> set[str]:
        """The safetensors dtypes a block scale may have under this scheme."""
        return SCALE_CODES | ({E8M0_BYTES} if self.ue8m0 else set())


def scheme(hf: dict) -> Scheme | None:
    """The fp8 scheme of config.json's ``quantization_config``; None without one. A scheme other than block-scaled
    fp8 e4m3 (with its ``scale_fmt`` and ``expert_dtype``) is refused by name (``activation_scheme`` is
    inference's, and ignored)."""
    quantization = hf.get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        raise ConfigError(f"config.json quantization_config={quantization!r} is not supported: only block-scaled "
                          "fp8 (quant_method 'fp8', DeepSeek-V3's and V4's) is dequantised on import")
    unknown = sorted(set(quantization) - _CONFIG_KEYS)
    if unknown or quantization.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config.json quantization_config={quantization!r} is not supported: fp8 e4m3 weights "
                          f"with {', '.join(sorted(_CONFIG_KEYS - {'quant_method', 'fmt'}))} only")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"config.json quantization_config weight_block_size={block!r} must be two positive "
                          "integers (DeepSeek-V3: [128, 128])")
    scale_fmt = quantization.get("scale_fmt", "float")
    if scale_fmt not in SCALE_FORMATS:
        raise ConfigError(f"config.json quantization_config scale_fmt={scale_fmt!r} is not supported: one of "
                          f"{list(SCALE_FORMATS)}; dequantise the folder to bf16 first")
    experts = quantization.get("expert_dtype", hf.get("expert_dtype", "fp8"))
    if "expert_dtype" in hf and hf["expert_dtype"] != experts:
        raise ConfigError(f"config.json expert_dtype={hf['expert_dtype']!r} disagrees with quantization_config's "
                          f"expert_dtype={experts!r}: say it once")
    if experts not in EXPERT_FORMATS:
        raise ConfigError(f"config.json expert_dtype={experts!r} is not supported: routed experts stored as "
                          f"{' or '.join(EXPERT_FORMATS)} (DeepSeek-V4's) are dequantised; convert the folder's "
                          "experts to one of those, or to bf16, first")
    return Scheme((block[0], block[1]), scale_fmt == "ue8m0", experts == "fp4")


def check_scaled(name: str, code: str, shape: tuple[int, ...], scales: tuple[str, tuple[int, ...]] | None,
                 quantized: Scheme | None) -> None:
    """Refuse by name an fp8 weight (safetensors dtype ``code``, ``shape``) that cannot be dequantised as
    DeepSeek-V3's: another fp8 format than the e4m3 ``quantization_config`` declares (a folder of mixed formats), no
    block size, no ``_scale_inv`` tensor (``scales``: its dtype code and shape, or None), scales that are not
    floats (or, under ``ue8m0``, E8M0 bytes), or a scale grid other than the one ``weight_block_size`` gives the
    weight (each block would be scaled by another block's scale, or read past the grid)."""
    if quantized is None:
        raise ConfigError(f"tensor '{name}' is {code}, but config.json has no fp8 quantization_config "
                          "(quant_method 'fp8' with weight_block_size) saying how to dequantise it")
    if code not in FP8_CODES:
        raise ConfigError(f"tensor '{name}' is {code}, but quantization_config declares fp8 e4m3 (F8_E4M3) weights: "
                          "a folder of mixed fp8 formats is not dequantised; convert it to one format")
    if len(shape) != 2:
        raise ConfigError(f"fp8 tensor '{name}' is not a matrix ({list(shape)}): only matrices with block scales "
                          "are dequantised")
    if scales is None:
        raise ConfigError(f"fp8 tensor '{name}' comes without its block scales '{name}{SCALE_SUFFIX}'")
    scale_code, scale_shape = scales
    if scale_code not in quantized.scale_codes:
        raise ConfigError(f"'{name}{SCALE_SUFFIX}' holds {scale_code} values: block scales are floating point "
                          f"({', '.join(sorted(quantized.scale_codes))}); integer scales would be cast without "
                          "their meaning")
    block = quantized.block
    grid = tuple(-(-size // step) for size, step in zip(shape, block, strict=True))
    if tuple(scale_shape) != grid:
        raise ConfigError(f"'{name}{SCALE_SUFFIX}' is {list(scale_shape)}, but weight_block_size {list(block)} over "
                          f"'{name}' {list(shape)} gives a {list(grid)} grid of scales: the block size does not match "
                          "the stored scales (each block would be dequantised with another block's scale)")


def scale_values(scales: Tensor) -> Tensor:
    """Block scales as fp32 values: E8M0 exponent bytes (uint8; ``check_scaled`` lets them in under ue8m0 only)
    decoded as 2^(byte - 127), 255 NaN, as ``float8_e8m0fnu`` reads them; any float as its value."""
    if scales.dtype == torch.uint8:
        return scales.view(torch.float8_e8m0fnu).float()
    return scales.float()


def scale_box(rows: slice, cols: slice, block: tuple[int, int]) -> tuple[slice, slice]:
    """The scale blocks that cover the weight box [rows, cols]."""
    return (slice(rows.start // block[0], (rows.stop - 1) // block[0] + 1),
            slice(cols.start // block[1], (cols.stop - 1) // block[1] + 1))


def dequantize(values: Tensor, scales: Tensor, rows: slice, cols: slice, block: tuple[int, int]) -> Tensor:
    """The box [rows, cols] of an fp8 weight (``values``), times the scales of its blocks (``scales``: the
    ``scale_box`` of that box), in bf16."""
    row_block = torch.arange(rows.start, rows.stop) // block[0] - rows.start // block[0]
    col_block = torch.arange(cols.start, cols.stop) // block[1] - cols.start // block[1]
    return (values.float() * scale_values(scales)[row_block][:, col_block]).to(torch.bfloat16)
