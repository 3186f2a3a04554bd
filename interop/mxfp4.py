"""MXFP4 dequantisation: GPT-OSS's published checkpoints store their expert weights so (``*_blocks``, ``*_scales``).

The format (OCP Microscaling Formats (MX) v1.0, sec. 5.3 and 6.3): values come in blocks of 32 that share one
scale. Each value is an E2M1 float (FP4: 1 sign bit, 2 exponent bits with bias 1, 1 mantissa bit; so 0, 0.5,
1, 1.5, 2, 3, 4, 6 and their negatives), packed two to a byte, the element with the lower index in the low
nibble; the block's scale is an E8M0 byte, the power of two 2^(byte - 127) (255 is NaN). A checkpoint's
``blocks`` tensor is [..., G, 16] bytes (G blocks of 32 values per row) and ``scales`` [..., G].

Dequantised here from that definition (the E2M1 fields decoded arithmetically, the scale applied with
``ldexp``), a chunk of rows at a time so a large expert stack needs only its output and one chunk's
temporaries. An import calls this one tensor at a time as it streams a checkpoint.

In a checkpoint (GPT-OSS's, ``quantization_config: {quant_method: mxfp4}``) the tensor ``X`` is stored as
``X_blocks`` [E, out, G, 16] and ``X_scales`` [E, out, G]: its rows are the output channels and the blocks run
along the input. The experts use ``X`` as [E, in, out] (``transformers``' conversion transposes the last two dims
after dequantising), so ``read_box`` gives a box of that transposed view, reading only the blocks under it.

DeepSeek-V4 stores its routed experts in the same format, one matrix at a time and laid out as the matrix
(``expert_dtype: fp4`` beside an fp8 ``quantization_config``; ``interop/fp8.py``): ``X.weight`` [out, in / 2] of
``I8`` (two E2M1 values per byte, packed along the input, the lower index in the low nibble) and ``X.scale``
[out, in / 32] of ``F8_E8M0``. Sources: DeepSeek's ``inference/model.py`` (an fp4 ``Linear`` holds a weight
[out, in // 2] of ``float4_e2m1fn_x2`` and a scale [out, in // 32] of ``float8_e8m0fnu``, "1 scale per 32 fp4
elements along K") and ``inference/convert.py`` (its ``FP4_TABLE`` decodes ``x & 0x0F`` before ``x >> 4``), as
quoted by the projects that port them; a published index lists ``layers.0.ffn.experts.0.w1.weight I8 [2048, 2048]``
and ``.scale F8_E8M0 [2048, 128]`` (Flash: in = 4096); ``transformers``' ``FP8Experts`` allocates fp4 experts alike
(``int8``, K halved, scales per row and 32 along K) and its ``Fp8Dequantize`` unpacks ``int8`` low nibble first.
``read_packed_box`` reads a box of such a matrix through ``dequantize_mxfp4``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from config.errors import ConfigError

VALUES_PER_BLOCK = 32  # MX block size: values sharing one scale
BYTES_PER_BLOCK = VALUES_PER_BLOCK // 2  # two E2M1 values per byte
E8M0_BIAS = 127
E8M0_NAN = 255
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
# quantization_config keys besides quant_method: which modules stay unquantised (the tensors say it too) and
# transformers' own loading switch; neither changes what the bytes mean
_CONFIG_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}
PACKED_CODE = "I8"  # DeepSeek-V4's packed E2M1 pairs
PACKED_SCALE_CODES = {"F8_E8M0", "U8"}  # E8M0 exponents, as the float8 type or as bytes


def decode_e2m1(codes: Tensor) -> Tensor:
    """4-bit E2M1 codes (integers 0..15) -> their fp32 values: sign bit 3, exponent bits 2..1, mantissa bit 0.

    Exponent 0 is subnormal: 0.5 · mantissa (0 or 0.5); otherwise 2^(exponent - 1) · (1 + mantissa / 2).
    """
    codes = codes.to(torch.int32)
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).float()
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).float()
    normal = torch.ldexp(1.0 + mantissa / 2, (exponent - 1).float())
    return sign * torch.where(exponent == 0, mantissa / 2, normal)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.bfloat16, name: str = "blocks",
                     rows_per_chunk: int = 1 << 16) -> Tensor:
    """[..., G, 16] packed E2M1 bytes and [..., G] E8M0 scales -> [..., G · 32] values in ``dtype``.

    Exact in bf16 and fp32 wherever the value is representable (each is an FP4 value times a power of two).
    ``name``: the tensor's name, for the error a mismatched pair raises before any work.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales are uint8 bytes, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BYTES_PER_BLOCK or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}: MXFP4 blocks of shape {tuple(blocks.shape)} do not match scales of shape "
                         f"{tuple(scales.shape)}: blocks must be [..., G, {BYTES_PER_BLOCK}] (32 values, two per "
                         f"byte, per scale) with scales [..., G]")
    *prefix, groups, _ = blocks.shape
    rows = math.prod(prefix) * groups
    packed = blocks.reshape(rows, BYTES_PER_BLOCK)
    exponents = scales.reshape(rows, 1).to(torch.int32)
    out = torch.empty(rows, VALUES_PER_BLOCK, dtype=dtype, device=blocks.device)
    for start in range(0, rows, rows_per_chunk):
        chunk = slice(start, start + rows_per_chunk)
        pairs = torch.stack((packed[chunk] & 0x0F, packed[chunk] >> 4), dim=-1)  # low nibble first
        values = decode_e2m1(pairs).reshape(-1, VALUES_PER_BLOCK)
        scaled = torch.ldexp(values, (exponents[chunk] - E8M0_BIAS).float())
        scaled = torch.where(exponents[chunk] == E8M0_NAN, torch.nan, scaled)
        out[chunk] = scaled.to(dtype)
    return out.reshape(*prefix, groups * VALUES_PER_BLOCK)


def declared(hf: dict) -> bool:
    """Whether config.json's ``quantization_config`` declares MXFP4 weights; an MXFP4 setting that changes what
    the bytes mean is refused by name."""
    quantization = hf.get("quantization_config")
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "mxfp4":
        return False
    unknown = sorted(set(quantization) - _CONFIG_KEYS)
    if unknown:
        raise ConfigError(f"config.json quantization_config setting '{unknown[0]}' is not supported: MXFP4 weights "
                          f"are read with {', '.join(sorted(_CONFIG_KEYS))} only")
    return True


def logical_shape(name: str, blocks: tuple[int, ...], scales: tuple[int, ...],
                  codes: tuple[str, str] = ("U8", "U8")) -> tuple[int, ...]:
    """The [E, in, out] shape of checkpoint tensor ``name`` stored as ``name_blocks`` [E, out, G, 16] and
    ``name_scales`` [E, out, G] (``codes``: their safetensors dtypes); an error naming the tensor when the two do not
    match, or either is not bytes (E8M0 scales are bytes by definition: a float or wider integer scale is another
    format, which would be cast without its meaning)."""
    for suffix, code in zip((BLOCKS_SUFFIX, SCALES_SUFFIX), codes, strict=True):
        if code != "U8":
            raise ConfigError(f"MXFP4 tensor '{name}{suffix}' holds {code} values: MXFP4 blocks (two E2M1 values per "
                              "byte) and their E8M0 scales are stored as U8 bytes; another dtype is another format")
    if len(blocks) != 4 or blocks[-1] != BYTES_PER_BLOCK or tuple(blocks[:-1]) != tuple(scales):
        raise ConfigError(f"MXFP4 tensor '{name}{BLOCKS_SUFFIX}' of shape {list(blocks)} does not match "
                          f"'{name}{SCALES_SUFFIX}' of shape {list(scales)}: an expert stack's blocks are "
                          f"[E, out, G, {BYTES_PER_BLOCK}] with scales [E, out, G] (32 values per scale)")
    experts, out, groups, _ = blocks
    return experts, groups * VALUES_PER_BLOCK, out


def read_box(blocks, scales, box: tuple[slice, slice, slice], name: str = "blocks") -> Tensor:
    """The [experts, in, out] ``box`` of the transposed, dequantised stack whose safetensors slices are ``blocks``
    and ``scales``, in bf16: only the 32-value blocks that cover ``box``'s input range are read."""
    experts, rows, cols = box
    first, last = rows.start // VALUES_PER_BLOCK, -(-rows.stop // VALUES_PER_BLOCK)
    values = dequantize_mxfp4(blocks[experts, cols, first:last], scales[experts, cols, first:last],
                              torch.bfloat16, name)  # [e, out, (last - first) · 32]
    offset = first * VALUES_PER_BLOCK
    return values[..., rows.start - offset:rows.stop - offset].transpose(1, 2)


def packed_shape(name: str, code: str, shape: tuple[int, ...], scales: tuple[str, tuple[int, ...]] | None,
                 scale_name: str) -> tuple[int, int]:
    """The [out, in] of DeepSeek-V4's packed matrix ``name`` (dtype ``code``, stored ``shape`` [out, in / 2]) with
    scales ``scale_name`` (``scales``: their dtype code and shape, or None); an error naming what does not match
    that layout (another dtype, no scales, non-E8M0 scales, or not one scale per 32 values of each row)."""
    if code != PACKED_CODE:
        raise ConfigError(f"tensor '{name}' is {code}, but expert_dtype fp4 experts are stored as {PACKED_CODE} (two "
                          "E2M1 values per byte, DeepSeek-V4's layout); convert it to that layout or to bf16")
    if len(shape) != 2:
        raise ConfigError(f"fp4 tensor '{name}' is not a matrix ({list(shape)}): DeepSeek-V4's fp4 experts are "
                          "[out, in / 2] bytes")
    if scales is None:
        raise ConfigError(f"fp4 tensor '{name}' comes without its E8M0 scales '{scale_name}'")
    scale_code, scale_shape = scales
    if scale_code not in PACKED_SCALE_CODES:
        raise ConfigError(f"'{scale_name}' holds {scale_code} values: fp4 experts' scales are E8M0 exponents "
                          f"({', '.join(sorted(PACKED_SCALE_CODES))}); another dtype is another format")
    out, columns = shape[0], shape[1] * 2
    if tuple(scale_shape) != (out, columns // VALUES_PER_BLOCK) or columns % VALUES_PER_BLOCK:
        raise ConfigError(f"'{scale_name}' is {list(scale_shape)}, but fp4 tensor '{name}' {list(shape)} holds "
                          f"[{out}, {columns}] values, which take one scale per {VALUES_PER_BLOCK} of a row: "
                          f"[{out}, {columns / VALUES_PER_BLOCK:g}]")
    return out, columns


def read_packed_box(packed, scales, box: tuple[slice, slice], name: str = "packed") -> Tensor:
    """The [rows, cols] ``box`` of DeepSeek-V4's packed matrix whose safetensors slices are ``packed``
    [out, in / 2] and ``scales`` [out, in / 32], dequantised to bf16: only the 32-value blocks under the box's
    columns are read."""
    rows, cols = box
    first, last = cols.start // VALUES_PER_BLOCK, -(-cols.stop // VALUES_PER_BLOCK)
    blocks = packed[rows, first * BYTES_PER_BLOCK:last * BYTES_PER_BLOCK].view(torch.uint8)
    exponents = scales[rows, first:last].view(torch.uint8)
    values = dequantize_mxfp4(blocks.reshape(*exponents.shape, BYTES_PER_BLOCK), exponents, torch.bfloat16, name)
    offset = first * VALUES_PER_BLOCK
    return values[:, cols.start - offset:cols.stop - offset]
