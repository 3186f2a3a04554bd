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
    assert train.main(["--run-dir", str(root / "with-aux"), "--set", *common, "checkpoint.interval=3"]) == 0
    assert train.main(["--run-dir", str(root / "no-aux"), "--set", *common, "moe.aux_loss_coef=0"]) == 0
    return root / "with-aux", root / "no-aux"


def test_notebook_executes_without_errors(two_runs, monkeypatch):
    run_dir, other = two_runs
    monkeypatch.setenv("MOE_RUN_DIR", str(run_dir))
    monkeypatch.setenv("MOE_COMPARE_RUN", str(other))
    monkeypatch.delenv("MOE_PROBE_WEIGHTS", raising=False)  # the probe takes the run's newest checkpoint
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()  # raises CellExecutionError on any error

    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert f"run {run_dir}: 2 MoE layers of 4 experts, top-2" in text
    assert f"probing with checkpoint {run_dir / 'checkpoints' / 'step_0000006'}" in text
    assert "layers 0 -> 1: NMI" in text
    # 2 load heatmaps, imbalance, dropped, entropy, top-1, co-selection, specialisation, comparison x2
    assert len(images) == 10


def test_probe_weights_default_to_the_newest_checkpoint(two_runs, monkeypatch):
    run_dir, _ = two_runs
    monkeypatch.delenv("MOE_PROBE_WEIGHTS", raising=False)
    loader, described = router.probe_weights_from_env(run_dir)
    assert described == f"checkpoint {run_dir / 'checkpoints' / 'step_0000006'}"
    final = loader()
    monkeypatch.setenv("MOE_PROBE_WEIGHTS", str(run_dir / "checkpoints" / "step_0000003"))
    at_step_3 = router.probe_weights_from_env(run_dir)[0]()
    initial = router.build_model(router.load_run_config(run_dir)).state_dict()
    assert final.keys() == initial.keys() == at_step_3.keys()
    assert any(not torch.equal(final[n], initial[n]) for n in initial if n.endswith("router.gate"))  # trained weights
    assert any(not torch.equal(final[n], at_step_3[n]) for n in final)  # the newest, not the first
