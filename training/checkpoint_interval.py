"""The optimal time between checkpoints, from the save time and the mean time between failures.

Saving often wastes the save time δ on every checkpoint; saving rarely loses more work at each failure.
With failures at rate 1/M the optimum compute time between saves is, to first order,

    Young (1974), CACM 17(9):530-531:        τ = √(2δM)

and with Daly's higher-order refinement (2006), FGCS 22(3):303-312:

    τ = √(2δM)·[1 + (1/3)·(δ/(2M))^½ + (1/9)·(δ/(2M))] − δ     for δ < 2M,   τ = M otherwise.

These are the forms in ``shared/REFERENCES.md`` sec. 6.1, where the Daly form reproduces the paper's three
published examples (δ = 5 min: M = 24 h → 117 min, 6 h → 57 min, 15 min → 9.1 min); the tests check them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def young_interval(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum √(2δM), in the units of the arguments."""
    _check(save_s, mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (see the module docstring); M when the save takes 2M or longer."""
    _check(save_s, mtbf_s)
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    ratio = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - save_s


def expected_lost_work(interval_s: float, save_s: float) -> float:
    """Work lost to one failure on average: half a save cycle (τ + δ), failures striking uniformly within it."""
    return 0.5 * (interval_s + save_s)


def _check(save_s: float, mtbf_s: float) -> None:
    if save_s < 0 or mtbf_s <= 0:
        raise ValueError(f"save time {save_s} s must be >= 0 and MTBF {mtbf_s} s positive")


@dataclass
class AutoInterval:
    """``checkpoint.interval: auto``: the Daly interval, re-estimated from each measured save time.

    The save time is an exponential moving average of the measured saves (the latest weighs
    ``smoothing``), so one slow save on a busy filesystem moves the interval without dominating it.
    Until the first save is measured there is no δ: the first checkpoint is taken after the first step.
    """

    mtbf_s: float
    smoothing: float = 0.5
    save_s: float | None = None

    def observe(self, save_s: float) -> None:
        """Record one measured save (the time training was blocked by it)."""
        self.save_s = save_s if self.save_s is None else (1 - self.smoothing) * self.save_s + self.smoothing * save_s

    @property
    def interval_s(self) -> float:
        """Seconds of training between saves; 0 until a save has been measured (save at once)."""
        return 0.0 if self.save_s is None else daly_interval(self.save_s, self.mtbf_s)

    def describe(self) -> str:
        """One log line: the chosen interval, Young's for comparison, and the expected lost work."""
        if self.save_s is None:
            return "checkpoint interval: auto, waiting for the first measured save"
        tau, delta = self.interval_s, self.save_s
        return (f"checkpoint interval: {tau:.1f} s (Daly; Young {young_interval(delta, self.mtbf_s):.1f} s) from "
                f"save time {delta:.3f} s and MTBF {self.mtbf_s / 3600:.2f} h; expected work lost per failure "
                f"{expected_lost_work(tau, delta):.1f} s, overhead {100 * delta / (tau + delta):.2f}% of time")
