"""router_analysis.ipynb runs top to bottom, headless, on two tiny runs made here; any cell error fails."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import nbformat
import pytest
import torch
from nbclient import NotebookClient

import train
from analysis import router
from tests.training.test_train import TINY

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "analysis" / "notebooks" / "router_analysis.ipynb"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same tiny model with and without the aux loss, 6 steps each, on a small Python text."""
    root = tmp_path_factory.mktemp("runs")
    corpus = root / "corpus.py"
    corpus.write_text(inspect.getsource(inspect) + inspect.getsource(os))  # ~150 KB of Python
    common = [*TINY, "train.steps=6", "train.eval_interval=0", "logging.log_interval=2",
              f"data.source={corpus}", f"data.cache_dir={root / 'cache'}"]
    assert train.main(["--run-dir", str(root / "with-aux"), "--set", *common]) == 0
    assert train.main(["--run-dir", str(root / "no-aux"), "--set", *common, "moe.aux_loss_coef=0"]) == 0
    weights = root / "weights.pt"
    torch.save(router.build_model(router.load_run_config(root / "with-aux")).state_dict(), weights)
    return root / "with-aux", root / "no-aux", weights


def test_notebook_executes_without_errors(two_runs, monkeypatch):
    run_dir, other, weights = two_runs
    monkeypatch.setenv("MOE_RUN_DIR", str(run_dir))
    monkeypatch.setenv("MOE_COMPARE_RUN", str(other))
    monkeypatch.setenv("MOE_PROBE_WEIGHTS", str(weights))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()  # raises CellExecutionError on any error

    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert f"run {run_dir}: 2 MoE layers of 4 experts, top-2" in text
    assert f"probing with {weights}" in text and "layers 0 -> 1: NMI" in text
    # 2 load heatmaps, imbalance, dropped, entropy, top-1, co-selection, specialisation, comparison x2
    assert len(images) == 10
