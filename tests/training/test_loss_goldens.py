"""Loss goldens: each model family's first steps on a tiny model (fp32, one process; and one 2-rank row in
``test_mfu.py``) against the losses recorded in ``loss_goldens.json``, so that a change which moves any family's
numbers is seen at once, naming the family. And bitwise repeatability: the same command twice gives identical
losses and weights, and so does a run stopped and resumed.

A deliberate change of the numbers (a new initialisation, a fixed loss) regenerates the file:

    python -m tests.training.test_loss_goldens        # rewrites tests/training/loss_goldens.json

and the diff of the JSON, reviewed with the change, shows which families moved and by how much. The tolerance
(``TOLERANCE``) allows the last bits another CPU's matmul kernels may round differently, far below what any change
of the model, the data order or the optimizer moves in three steps.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

from tests.parallel.parity import GPT_OSS
from tests.parallel.test_parity import DEEPSEEK_V3
from tests.training.stopped_run import stopped_after_step
from tests.training.test_data_loss import main
from training.metrics import read_metrics

GOLDENS = Path(__file__).with_name("loss_goldens.json")
TOLERANCE = 2e-5  # relative, per logged value
STEPS = ["train.steps=3", "checkpoint.interval=null", "checkpoint.final=false"]
# one row per family, at the toy size of TINY (tests/training/test_data_loss.py) and fp32
FAMILIES = {
    "mixtral (default: grouped-query, softmax top-2)": [],
    "deepseek-v3 (latent attention, groups, shared expert, MTP)": [*DEEPSEEK_V3, "model.mtp_depth=1"],
    "qwen3-moe (q/k norms, wide heads)": ["model.qk_norm=true", "model.head_dim=16", "moe.capacity_factor=null"],
    "glm-4.5 (q/k/v biases, partial rotary, sigmoid)": ["model.qkv_bias=true", "model.rotary_dim=4",
                                                        "model.qk_norm=true", "model.first_moe_layer=1",
                                                        "moe.score_func=sigmoid", "moe.num_shared_experts=1",
                                                        "moe.routed_scaling_factor=2.5"],
    "gpt-oss (sinks, sliding window, biased clamped SwiGLU)": GPT_OSS,
    "kimi-k2 (deepseek-v3 under MuonClip)": [*DEEPSEEK_V3, "train.optimizer=muon", "train.muon_ns_dtype=fp32",
                                             "train.qk_clip_threshold=5"],
}
LOGGED = ("train/loss", "train/grad_norm")


def logged(run_dir: Path) -> list[list[float]]:
    """Each step's LOGGED values, from the run's metrics.jsonl."""
    return [[record[key] for key in LOGGED] for record in read_metrics(run_dir / "metrics.jsonl")
            if "train/loss" in record]


def run(run_dir: Path, *settings: str) -> list[list[float]]:
    """train.py on the tiny model (one process) with ``settings``; the logged values."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(run_dir, *settings)
    assert status == 0, err.getvalue()
    return logged(run_dir)


def assert_golden(row: str, values: list[list[float]]) -> None:
    expected = json.loads(GOLDENS.read_text())[row]
    flat = lambda rows: [value for step in rows for value in step]  # noqa: E731 - pytest.approx takes flat lists
    assert len(values) == len(expected) and flat(values) == pytest.approx(flat(expected), rel=TOLERANCE), (
        f"{row}: the losses moved from the goldens (if on purpose, regenerate: python -m "
        f"tests.training.test_loss_goldens)")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_first_steps_give_the_golden_losses(tmp_path, family):
    assert_golden(family, run(tmp_path, *STEPS, *FAMILIES[family]))


def test_the_same_command_twice_and_a_resumed_run_give_identical_losses_and_weights(tmp_path, monkeypatch):
    settings = ["train.steps=4", "checkpoint.interval=2", "checkpoint.final=true", "checkpoint.keep=4", *DEEPSEEK_V3]
    first, second = run(tmp_path / "a", *settings), run(tmp_path / "b", *settings)
    with stopped_after_step(monkeypatch, 3), contextlib.redirect_stderr(io.StringIO()):
        main(tmp_path / "c", *settings)
    resumed = run(tmp_path / "c", *settings)  # the same command again: resumes from step 2's checkpoint
    assert first == second == resumed  # bit for bit: == on floats
    # the weights, AdamW moments and balancing biases: the SHA-256 of each DCP data file, from the manifests
    digests = [{name: entry["sha256"] for name, entry in json.loads(
        (tmp_path / run_dir / "checkpoints" / "step_0000004" / "manifest.json").read_text())["files"].items()
        if name.endswith(".distcp")} for run_dir in "abc"]
    assert digests[0] and digests[0] == digests[1] == digests[2]


def regenerate() -> None:
    """Rewrite loss_goldens.json from this checkout: every family's row here, and the 2-rank row of test_mfu.py."""
    import tempfile

    from tests.training.test_mfu import CP_ROW, run_cp_row

    goldens = {}
    with tempfile.TemporaryDirectory() as folder:
        for number, (family, settings) in enumerate(FAMILIES.items()):
            goldens[family] = run(Path(folder, str(number)), *STEPS, *settings)
        goldens[CP_ROW] = run_cp_row(Path(folder, "cp"))
    rows = ",\n".join(f" {json.dumps(row)}: {json.dumps(values)}" for row, values in goldens.items())
    GOLDENS.write_text("{\n" + rows + "\n}\n")  # a row per line: a change's diff names the families it moved
    print(f"wrote {GOLDENS}", file=sys.stderr)


if __name__ == "__main__":
    regenerate()
