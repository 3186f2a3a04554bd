"""What of ``scripts/gpu_check.sh`` and ``scripts/install_megablocks.sh`` a CPU machine can check: their usage,
their refusals without a GPU or a CUDA torch, the CUDA 13 patch on megablocks' own text, and the summary table.
The GPU run itself is docs/gpu.md's to report."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import gpu_summary  # noqa: E402
import patch_megablocks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def script(*args, status):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}
    done = subprocess.run(["bash", *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == status, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_both_scripts_print_their_usage():
    assert "--prepare DIR" in script("scripts/gpu_check.sh", "--help", status=0)
    assert "--from DIR" in script("scripts/install_megablocks.sh", "--help", status=0)
    assert "unknown argument '--bogus'" in script("scripts/gpu_check.sh", "--bogus", status=2)
    assert "--wheels needs a value" in script("scripts/gpu_check.sh", "--wheels", status=2)
    assert "--only: no step 'compile'" in script("scripts/gpu_check.sh", "--only", "gpu_tests,compile", status=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a machine without a GPU")
def test_without_a_gpu_both_refuse_saying_why():
    out = script("scripts/gpu_check.sh", status=2)
    assert "no CUDA GPU is visible" in out and "--prepare DIR" in out
    assert "is a CPU build" in script("scripts/install_megablocks.sh", status=2)


# csrc/cumsum.h of megablocks 0.10.0, the two calls as they are written there
CUMSUM_CALLS = """    CUDA_CALL(cub::DeviceScan::ExclusiveSum(d_temp_storage,
\t\t\t\t\t    temp_storage_bytes,
\t\t\t\t\t    d_in,
\t\t\t\t\t    d_out,
\t\t\t\t\t    num_items,
\t\t\t\t\t    stream,
\t\t\t\t\t    debug_synchronous));
    CUDA_CALL(cub::DeviceScan::InclusiveSum(d_temp_storage, temp_storage_bytes, d_in, d_out, num_items,
\t\t\t\t\t    stream, debug_synchronous));
"""


def test_the_cuda_13_patch_drops_the_flag_from_both_cub_calls_only():
    patched, changed = patch_megablocks.patch_cumsum("bool debug_synchronous = false) {\n" + CUMSUM_CALLS)
    assert changed == 2
    assert patched.count("debug_synchronous") == 1  # the wrapper's own (unused) parameter stays
    assert patched.count("stream));") == 2
    assert patch_megablocks.patch_cumsum(patched) == (patched, 0)  # a second run changes nothing


def test_the_summary_reports_steps_tests_and_figures(tmp_path, capsys):
    (tmp_path / "device.txt").write_text("NVIDIA H100 80GB HBM3 | torch 2.11.0+cu130 | CUDA 13.0\n")
    (tmp_path / "steps.tsv").write_text("install\t0\t3\nmegablocks_build\t1\t200\n")
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_a" name="test_ok"/>'
        '<testcase classname="tests.gpu.test_a" name="test_skip"><skipped message="no megablocks"/></testcase>'
        '<testcase classname="tests.gpu.test_b" name="test_bad"><failure message="loss 3.1 vs 2.9"/></testcase>'
        '</testsuite></testsuites>')
    (tmp_path / "train_step.json").write_text('[{"config": "mixtral-slice", "mfu": 0.4123}]')
    assert gpu_summary.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in out and "FAILED (1)" in out
    assert "1 passed, 1 failed, 1 skipped" in out and "(no megablocks)" in out and "(loss 3.1 vs 2.9)" in out
    assert "train_step: config=mixtral-slice, mfu=0.4123" in out and "moe_layer.json: not written" in out
