"""Make megablocks 0.10.0's CUDA sources compile with CUDA 13.

    python scripts/patch_megablocks.py SOURCE_DIR

``csrc/cumsum.h`` passes CUB's ``debug_synchronous`` flag to ``cub::DeviceScan::ExclusiveSum`` and
``InclusiveSum``; CUB deprecated that overload in CUDA 12 and CCCL 3 (CUDA 13) removed it. The calls
without the flag exist in every CUB version megablocks supports, so dropping it is safe everywhere; the
wrapper keeps its (now unused) parameter so no caller changes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FLAG = re.compile(r",\s*debug_synchronous\s*\)\s*\)")


def patch_cumsum(text: str) -> tuple[str, int]:
    """``text`` with the flag removed from each CUB call, and how many calls were changed."""
    return FLAG.subn("))", text)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/patch_megablocks.py SOURCE_DIR", file=sys.stderr)
        return 2
    header = Path(argv[0]) / "csrc" / "cumsum.h"
    if not header.is_file():
        print(f"patch_megablocks: {header} not found: is {argv[0]} an unpacked megablocks source?", file=sys.stderr)
        return 2
    text, changed = patch_cumsum(header.read_text())
    header.write_text(text)
    print(f"patch_megablocks: {header}: removed debug_synchronous from {changed} CUB call(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
