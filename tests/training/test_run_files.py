"""A run writes only files of its own: a symbolic link standing where a run file goes is refused by name or
replaced, never written through (its target may be any file the user can write: a link must not empty it)."""

import numpy as np
import pytest

from tests.training.test_data_loss import main
from training.metrics import MetricsLogger
from training.routing_stats import append_rows, truncate_routing
from training.run_plots import write_run_plots

PRECIOUS = "a file elsewhere that the run must leave alone\n"


@pytest.fixture
def precious(tmp_path):
    target = tmp_path / "elsewhere" / "precious.txt"
    target.parent.mkdir()
    target.write_text(PRECIOUS)
    return target


def test_a_linked_run_lock_is_refused_by_name_and_its_target_kept(tmp_path, precious, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").symlink_to(precious)
    assert main(run, "train.steps=1") == 2
    err = capsys.readouterr().err
    assert f"{run / 'run.lock'}" in err and "is a symbolic link" in err and "Traceback" not in err, err
    assert precious.read_text() == PRECIOUS


def test_a_linked_metrics_log_is_refused_and_its_target_kept(tmp_path, precious):
    (tmp_path / "metrics.jsonl").symlink_to(precious)
    with pytest.raises(OSError, match="is a symbolic link"):
        MetricsLogger(tmp_path, {}, "run", "disabled", "project")
    assert precious.read_text() == PRECIOUS


def test_routing_columns_never_write_through_a_link(tmp_path, precious):
    folder = tmp_path / "routing"
    folder.mkdir()
    (folder / "step.npy").symlink_to(precious)
    with pytest.raises(OSError, match="is a symbolic link"):  # an append in place
        append_rows(folder / "step.npy", np.arange(2))
    (folder / "step.npy").unlink()
    append_rows(folder / "step.npy", np.arange(4))
    (folder / ".step.npy.tmp").symlink_to(precious)  # the temporary name a rewind once used
    truncate_routing(tmp_path, 1)
    assert np.load(folder / "step.npy").tolist() == [0, 1]
    assert precious.read_text() == PRECIOUS


def test_links_where_a_run_writes_files_whole_are_replaced_not_followed(tmp_path):
    """config.yaml, summary.json and a checkpoint's temporary folder: each a dangling link (the run directory
    then holds no run yet); the run replaces or removes the link and creates nothing at its target; then the
    plots, drawn again over a link."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "summary.json"):
        (run / name).symlink_to(outside / name)
    (run / "checkpoints" / ".tmp_step_0000002").symlink_to(outside / "checkpoint", target_is_directory=True)
    assert main(run, "train.steps=2") == 0
    (run / "plots").mkdir()
    (run / "plots" / "loss.png").symlink_to(outside / "loss.png")
    assert len(write_run_plots(run, "run")) == 4
    assert not outside.exists()
    assert not any(path.is_symlink() for path in run.rglob("*"))
    assert (run / "checkpoints" / "step_0000002" / "manifest.json").is_file()
