"""A run killed after a step, for the tests that resume it: the step's checkpoint work is done as usual, then the
run stops as a killed job would, and the same command is run again."""

from __future__ import annotations

import contextlib

import pytest

from training.checkpointing import Checkpointer


class Stop(Exception):
    """Stands for a job killed after a step."""


@contextlib.contextmanager
def stopped_after_step(monkeypatch: pytest.MonkeyPatch, step: int):
    """Within the block, a run stops (``Stop``, expected) once ``Checkpointer.after_step`` of ``step`` is done;
    after it, runs go on as usual."""
    original = Checkpointer.after_step

    def stop(self, at, *args):
        original(self, at, *args)
        if at == step:
            raise Stop

    monkeypatch.setattr(Checkpointer, "after_step", stop)
    try:
        with pytest.raises(Stop):
            yield
    finally:
        monkeypatch.setattr(Checkpointer, "after_step", original)
