"""MXFP4 dequantisation against the format's 16 E2M1 values written out, and against ``transformers``' own
conversion (``convert_moe_packed_tensors``, the oracle, used only here) on synthetic packed expert stacks."""

import pytest
import torch

from interop.mxfp4 import decode_e2m1, dequantize_mxfp4

mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")

# OCP MX v1.0 table of E2M1 values, codes 0..7 positive, 8..15 their negatives
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_e2m1_codes_decode_to_the_formats_table():
    decoded = decode_e2m1(torch.arange(16))
    assert decoded.tolist() == E2M1 + [-v for v in E2M1]
    assert torch.signbit(decoded[8])  # code 8 is -0


def test_one_block_by_hand():
    """Byte 0x21 holds code 1 (0.5) in its low nibble, the first value, and code 2 (1.0) in its high nibble;
    scale byte 129 is 2^2."""
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21
    blocks[0, 15] = 0xF7  # 6.0 then -6.0
    out = dequantize_mxfp4(blocks, torch.tensor([129], dtype=torch.uint8), torch.float32)
    expected = torch.zeros(32)
    expected[0], expected[1], expected[30], expected[31] = 2.0, 4.0, 24.0, -24.0
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 8, 2), (2, 12, 1), (4, 6, 3)])  # experts, rows, blocks per row
def test_matches_transformers_conversion_bit_for_bit(shape, dtype):
    """Random bytes and scales (2^-20 .. 2^20, the range real checkpoints use, and the extremes that stay finite
    in bf16) on [E, rows, G, 16] stacks; theirs returns [E, G·32, rows] (transposed for their experts)."""
    generator = torch.Generator().manual_seed(sum(shape))
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(107, 148, shape, dtype=torch.uint8, generator=generator)
    scales.view(-1)[:2] = torch.tensor([1, 254], dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, dtype, rows_per_chunk=5)  # chunks that split the rows unevenly
    theirs = mxfp4.convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
    assert ours.shape == (*shape[:2], shape[2] * 32) and ours.dtype == dtype
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_nan_scale_byte_gives_nan():
    out = dequantize_mxfp4(torch.full((1, 16), 0x22, dtype=torch.uint8), torch.tensor([255], dtype=torch.uint8))
    assert out.isnan().all()


@pytest.mark.parametrize("blocks_shape, scales_shape", [((2, 3, 16), (2, 4)), ((2, 3, 15), (2, 3)), ((16,), ())])
def test_mismatched_blocks_and_scales_are_refused_by_name(blocks_shape, scales_shape):
    with pytest.raises(ValueError, match="mlp.experts.down_proj_blocks: MXFP4 blocks of shape"):
        dequantize_mxfp4(torch.zeros(blocks_shape, dtype=torch.uint8), torch.zeros(scales_shape, dtype=torch.uint8),
                         name="mlp.experts.down_proj_blocks")
