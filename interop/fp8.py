"""FP8 weights with block scales, dequantised as they are read.

DeepSeek-V3 publishes its linear weights as float8 e4m3 (``F8_E4M3``) with one fp32 scale per 128 × 128 block
(``quantization_config``: ``quant_method: fp8``, ``weight_block_size: [128, 128]``): the tensor ``X.weight``
[out, in] comes with ``X.weight_scale_inv`` [ceil(out / 128), ceil(in / 128)], and the weight is
``X.weight[i, j] · scale_inv[i // 128, j // 128]`` (despite the name, a multiplication: DeepSeek's own
``weight_dequant``). We train in bf16/fp32, so import dequantises each box it reads, to bf16 (the precision the
scales were fitted for; DeepSeek's own conversion writes bf16). Any box of a weight needs only the scale blocks
over it, so ``--init-from hf:DIR`` ranks still read just their part.
"""

from __future__ import annotations

import torch
from torch import Tensor

from config.errors import ConfigError

FP8_CODES = {"F8_E4M3"}  # the safetensors dtypes dequantised here
SCALE_SUFFIX = "_scale_inv"
SCALE_CODES = {"F32", "BF16", "F16"}  # what block scales may be stored as: floats, whose meaning is their value


def block_size(hf: dict) -> tuple[int, int] | None:
    """The (rows, columns) of a scale block from config.json's ``quantization_config``; None without one. A scheme
    other than block-scaled fp8 e4m3 is refused by name (``activation_scheme`` is inference's, and ignored)."""
    quantization = hf.get("quantization_config")
    if quantization is None:
        return None
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        raise ConfigError(f"config.json quantization_config={quantization!r} is not supported: only block-scaled "
                          "fp8 (quant_method 'fp8', DeepSeek-V3's) is dequantised on import")
    unknown = sorted(set(quantization) - {"quant_method", "fmt", "weight_block_size", "activation_scheme"})
    if unknown or quantization.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"config.json quantization_config={quantization!r} is not supported: fp8 e4m3 weights "
                          "with weight_block_size (and activation_scheme) only")
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"config.json quantization_config weight_block_size={block!r} must be two positive "
                          "integers (DeepSeek-V3: [128, 128])")
    return block[0], block[1]


def check_scaled(name: str, code: str, shape: tuple[int, ...], scales: tuple[str, tuple[int, ...]] | None,
                 block: tuple[int, int] | None) -> None:
    """Refuse by name an fp8 weight (safetensors dtype ``code``, ``shape``) that cannot be dequantised as
    DeepSeek-V3's: another fp8 format than the e4m3 ``quantization_config`` declares (a folder of mixed formats), no
    block size, no ``_scale_inv`` tensor (``scales``: its dtype code and shape, or None), scales that are not
    floats, or a scale grid other than the one ``weight_block_size`` gives the weight (each block would be scaled
    by another block's scale, or read past the grid)."""
    if block is None:
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
    if scale_code not in SCALE_CODES:
        raise ConfigError(f"'{name}{SCALE_SUFFIX}' holds {scale_code} values: block scales are floating point "
                          f"({', '.join(sorted(SCALE_CODES))}); integer scales would be cast without their meaning")
    grid = tuple(-(-size // step) for size, step in zip(shape, block, strict=True))
    if tuple(scale_shape) != grid:
        raise ConfigError(f"'{name}{SCALE_SUFFIX}' is {list(scale_shape)}, but weight_block_size {list(block)} over "
                          f"'{name}' {list(shape)} gives a {list(grid)} grid of scales: the block size does not match "
                          "the stored scales (each block would be dequantised with another block's scale)")


def scale_box(rows: slice, cols: slice, block: tuple[int, int]) -> tuple[slice, slice]:
    """The scale blocks that cover the weight box [rows, cols]."""
    return (slice(rows.start // block[0], (rows.stop - 1) // block[0] + 1),
            slice(cols.start // block[1], (cols.stop - 1) // block[1] + 1))


def dequantize(values: Tensor, scales: Tensor, rows: slice, cols: slice, block: tuple[int, int]) -> Tensor:
    """The box [rows, cols] of an fp8 weight (``values``), times the scales of its blocks (``scales``: the
    ``scale_box`` of that box), in bf16."""
    row_block = torch.arange(rows.start, rows.stop) // block[0] - rows.start // block[0]
    col_block = torch.arange(cols.start, cols.stop) // block[1] - cols.start // block[1]
    return (values.float() * scales.float()[row_block][:, col_block]).to(torch.bfloat16)
