"""How a Hugging Face folder stores each tensor, and a box of it read as values: as floats, as fp8 with block
scales (DeepSeek-V3's and V4's, ``interop/fp8.py``), as MXFP4 expert stacks (GPT-OSS's ``_blocks``/``_scales``)
or as packed fp4 matrices (DeepSeek-V4's routed experts; both ``interop/mxfp4.py``). Quantised tensors are checked
against their scales when first seen (an error naming the tensor before anything is read) and dequantised to bf16
box by box, so a rank of ``--init-from hf:DIR`` reads only the bytes and scales under its part.
"""

from __future__ import annotations

import torch
from torch import Tensor

from config.errors import ConfigError
from interop import fp8, mxfp4
from interop.export import SAFETENSORS_DTYPES
from interop.hf_folder import HFFolder

DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()} | {"F8_E4M3": None, "F8_E5M2": None}
# the tensors that travel beside a quantised one, read with it
COMPANION_SUFFIXES = (fp8.SCALE_SUFFIX, mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX)


class StoredTensors:
    """A folder's tensors by HF name: the shape and dtype each is read as, and any box of it."""

    def __init__(self, folder: HFFolder):
        self.folder = folder
        self.mxfp4 = mxfp4.declared(folder.config)
        self.fp8 = None if self.mxfp4 else fp8.scheme(folder.config)
        self._checked: dict[str, tuple[str, torch.dtype | None]] = {}  # _stored's answers

    def blocked(self, hf_name: str) -> bool:
        """Whether ``hf_name`` is stored as MXFP4 blocks and scales rather than under its own name."""
        return self.mxfp4 and hf_name not in self.folder.files and hf_name + mxfp4.BLOCKS_SUFFIX in self.folder.files

    def _fp4(self, hf_name: str) -> bool:
        """Whether ``hf_name`` is a DeepSeek-V4 packed fp4 matrix: where config.json says the experts are fp4, its
        bytes (``I8``) or another integer tensor that comes with scales (refused by ``_packed_shape``, which checks
        both; an integer table without scales, ``tid2eid``, is not one). Integers with scales where config.json
        does not say fp4 are refused here, before their bytes' shape is taken for the matrix's."""
        code = self.folder.slice(hf_name).get_dtype()
        packed = code.startswith(("I", "U")) or code == "F4"  # I8.., U8..; F4: torch's float4_e2m1fn_x2
        scaled = packed and hf_name + fp8.SCALE_SUFFIX in self.folder.files
        if self.fp8 is None or not self.fp8.fp4_experts:
            if scaled:
                raise ConfigError(f"{self.folder.folder}: tensor '{hf_name}' is {code} with scales "
                                  f"'{hf_name}{fp8.SCALE_SUFFIX}': packed fp4, which config.json does not declare "
                                  "(expert_dtype 'fp4' beside an fp8 quantization_config, DeepSeek-V4's)")
            return False
        return code == mxfp4.PACKED_CODE or scaled

    def _scales(self, hf_name: str) -> tuple[str, tuple[int, ...]] | None:
        """The dtype code and shape of an fp8 or fp4 matrix's scales, None if the folder has none."""
        scale = hf_name + fp8.SCALE_SUFFIX
        if scale not in self.folder.files:
            return None
        part = self.folder.slice(scale)
        return part.get_dtype(), tuple(part.get_shape())

    def _named(self, check, *args):
        """``check(*args)``, its error prefixed with the folder."""
        try:
            return check(*args)
        except ConfigError as exc:
            raise ConfigError(f"{self.folder.folder}: {exc}") from None

    def _packed_shape(self, hf_name: str) -> tuple[int, int]:
        stored = self.folder.slice(hf_name)
        return self._named(mxfp4.packed_shape, hf_name, stored.get_dtype(), tuple(stored.get_shape()),
                           self._scales(hf_name), hf_name + fp8.SCALE_SUFFIX)

    def shape(self, hf_name: str) -> tuple[int, ...]:
        """The shape of ``hf_name``'s values (a packed matrix's twice as wide as its bytes)."""
        if self.blocked(hf_name):
            parts = [self.folder.slice(hf_name + suffix) for suffix in (mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX)]
            return self._named(mxfp4.logical_shape, hf_name, *(tuple(part.get_shape()) for part in parts),
                               tuple(part.get_dtype() for part in parts))
        if self._fp4(hf_name):
            return self._packed_shape(hf_name)
        return tuple(self.folder.slice(hf_name).get_shape())

    def dtype(self, hf_name: str) -> torch.dtype | None:
        """The dtype ``hf_name`` is read as, None for a quantised weight (dequantised to bf16)."""
        return self._stored(hf_name)[1]

    def _stored(self, hf_name: str) -> tuple[str, torch.dtype | None]:
        """How ``hf_name`` is stored ("mxfp4", "fp8", "fp4" or "plain") and the dtype it is read as, checked once:
        an fp8 weight against its scales (``fp8.check_scaled``), an fp4 one or MXFP4 stack likewise, anything else
        floating point (an integer weight or correction bias would be cast without a word)."""
        if hf_name not in self._checked:
            if self.blocked(hf_name):
                self.shape(hf_name)
                self._checked[hf_name] = ("mxfp4", None)
                return self._checked[hf_name]
            stored = self.folder.slice(hf_name)
            code = stored.get_dtype()
            if code.startswith("F8_"):
                self._named(fp8.check_scaled, hf_name, code, tuple(stored.get_shape()), self._scales(hf_name),
                            self.fp8)
                self._checked[hf_name] = ("fp8", DTYPES.get(code))
            elif self._fp4(hf_name):
                self._packed_shape(hf_name)
                self._checked[hf_name] = ("fp4", None)
            elif DTYPES.get(code) is None or not DTYPES[code].is_floating_point:
                raise ConfigError(f"{self.folder.folder}: tensor '{hf_name}' has dtype {code}: weights (and "
                                  "correction biases) are floating point; an integer tensor would be cast without "
                                  "its meaning")
            else:
                self._checked[hf_name] = ("plain", DTYPES[code])
        return self._checked[hf_name]

    def box(self, hf_name: str, box: tuple[slice, ...]) -> Tensor:
        """The box of ``hf_name``'s values: as stored, or dequantised to bf16 (an fp8 weight with block scales, an
        MXFP4 expert stack, a packed fp4 matrix)."""
        kind, dtype = self._stored(hf_name)
        if dtype is not None:  # not quantised: read as stored
            return self.folder.slice(hf_name)[box]
        if kind == "mxfp4":
            return mxfp4.read_box(self.folder.slice(hf_name + mxfp4.BLOCKS_SUFFIX),
                                  self.folder.slice(hf_name + mxfp4.SCALES_SUFFIX), box, hf_name)
        scales = self.folder.slice(hf_name + fp8.SCALE_SUFFIX)
        if kind == "fp4":
            return mxfp4.read_packed_box(self.folder.slice(hf_name), scales, box, hf_name)
        rows, cols = box
        return fp8.dequantize(self.folder.slice(hf_name)[box], scales[fp8.scale_box(rows, cols, self.fp8.block)],
                              rows, cols, self.fp8.block)
