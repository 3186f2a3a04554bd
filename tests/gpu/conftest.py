"""Tests that need a CUDA GPU: every test here skips, saying so, where torch sees none.

They run on a GPU machine through ``scripts/gpu_check.sh`` (which also prints their results in its table).
One GPU means one process: multi-rank NCCL layouts are not tested here (they stay proved on gloo).
"""

import pytest
import torch

NO_GPU = "needs a CUDA GPU: torch sees none here (run scripts/gpu_check.sh on a GPU machine)"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)
