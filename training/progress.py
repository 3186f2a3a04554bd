"""What a person sees in the terminal while a run trains: a live bar on a terminal, plain lines otherwise.

Plain lines (logs, CI, ``| tee``) read like::

    step  40/300 | loss 3.412 | aux 0.0123 | z 0.0021 | dropped 1.2% | 12.3k tok/s | ETA 1m23s

The bar redraws one line with ``\\r`` and stays within 100 columns (fewer on a narrower terminal).
The ETA is the average time per step times the steps left, measured from the first step the
progress display saw, so the first step's warm-up (compilation, allocator growth) is left out.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

PROGRESS_MODES = ("auto", "bar", "lines")
MAX_COLUMNS = 100
BAR_WIDTH = 24
TICK_INTERVAL_S = 0.25  # bar redraws from tick() at most this often

# The closing table's rows: summary key -> label, in this order; other val/<name> keys follow under their names.
# Keys said elsewhere (steps and time in the "done" line, the peak's maximum in its per-rank row) are left out.
_SUMMARY_LABELS = {
    "train/loss": "train loss",
    "val/loss": "val loss",
    "perf/tokens_per_s": "throughput",
    "perf/memory_peak_gib_per_rank": "peak memory",
    "perf/memory_resident_peak_gib": "resident peak",
    "precision": "precision",
}
_SAID_ELSEWHERE = {"steps", "trained_steps", "time_s", "perf/memory_peak_gib", "perf/memory_before_model_gib_per_rank",
                   "perf/memory_predicted_gib", "run", "config", "optimizer", "layout"}  # the last: by the banner


def format_duration(seconds: float) -> str:
    """``45s``, ``3m07s``, ``2h05m``; ``?`` when unknown (NaN, infinite)."""
    if not math.isfinite(seconds):
        return "?"
    total = max(0, int(round(seconds)))
    if total < 60:
        return f"{total}s"
    if total < 3600:
        return f"{total // 60}m{total % 60:02d}s"
    return f"{total // 3600}h{total % 3600 // 60:02d}m"


def format_count(n: float) -> str:
    """Three significant digits with a k/M/G/T suffix: ``950``, ``12.3k``, ``4.56M``."""
    if not math.isfinite(n):
        return str(n)
    if abs(n) < 999.5:
        return str(int(round(n)))
    value = float(n)
    for suffix in ("k", "M", "G", "T"):
        value /= 1000.0
        for decimals in (2, 1, 0):
            if abs(value) < 10 ** (3 - decimals) - 0.5 * 10**-decimals:
                return f"{value:.{decimals}f}{suffix}"
    return f"{value:.0f}T"


def _fields(metrics: dict[str, Any]) -> list[str]:
    """The metric fields of a progress line, for whichever of the known keys are present."""
    fields = []
    if "train/loss" in metrics:
        fields.append(f"loss {float(metrics['train/loss']):.3f}")
    if "train/aux_loss" in metrics:
        fields.append(f"aux {float(metrics['train/aux_loss']):.3g}")
    if "train/z_loss" in metrics:
        fields.append(f"z {float(metrics['train/z_loss']):.3g}")
    if "train/dropped_frac" in metrics:
        fields.append(f"dropped {100 * float(metrics['train/dropped_frac']):.1f}%")
    if "perf/tokens_per_s" in metrics:
        fields.append(f"{format_count(float(metrics['perf/tokens_per_s']))} tok/s")
    return fields


class Progress:
    """Progress display for ``total_steps`` optimizer steps; ``step`` arguments count completed steps."""

    def __init__(
        self,
        total_steps: int,
        mode: str = "auto",
        stream: TextIO = sys.stderr,
        start_step: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if mode not in PROGRESS_MODES:
            raise ValueError(
                f"logging.progress={mode!r} is not a progress mode; valid: {', '.join(PROGRESS_MODES)}"
            )
        self.total_steps = total_steps
        self.stream = stream
        self.clock = clock
        if mode == "auto":
            is_tty = getattr(stream, "isatty", lambda: False)()
            mode = "bar" if is_tty and os.environ.get("TERM") != "dumb" else "lines"
        self.mode = mode
        self._start_time = clock()
        self._start_step = start_step
        self._anchor: tuple[float, int] | None = None  # (time, step) of the first step seen
        self._step = start_step
        self._metrics: dict[str, Any] = {}
        self._last_draw = -math.inf
        self._drawn_width = 0  # length of the bar line currently on screen
        self._closed = False

    # -- timing -------------------------------------------------------------------------------

    def _observe(self, step: int) -> float:
        now = self.clock()
        if self._anchor is None:
            self._anchor = (now, step)
        self._step = step
        return now

    def eta_seconds(self, now: float | None = None) -> float:
        """Seconds left, from the mean time per step since the first step seen; NaN before any progress."""
        now = self.clock() if now is None else now
        steps_left = max(0, self.total_steps - self._step)
        if self._anchor is not None and self._step > self._anchor[1]:
            per_step = (now - self._anchor[0]) / (self._step - self._anchor[1])
        elif self._step > self._start_step:  # only one step seen: its time includes the warm-up
            per_step = (now - self._start_time) / (self._step - self._start_step)
        else:
            return math.nan
        return steps_left * per_step

    # -- output -------------------------------------------------------------------------------

    def _columns(self) -> int:
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = MAX_COLUMNS
        return min(MAX_COLUMNS, columns) - 1  # the last column would wrap on some terminals

    def _line(self, now: float) -> str:
        width = len(str(self.total_steps))
        parts = [f"step {self._step:>{width}}/{self.total_steps}", *_fields(self._metrics)]
        parts.append(f"ETA {format_duration(self.eta_seconds(now))}")
        return " | ".join(parts)

    def _bar_line(self, now: float) -> str:
        fraction = min(1.0, max(0.0, self._step / self.total_steps)) if self.total_steps > 0 else 1.0
        filled = int(fraction * BAR_WIDTH)
        bar = "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"
        parts = [f"{bar} {self._step}/{self.total_steps}"]
        if "train/loss" in self._metrics:
            parts.append(f"loss {float(self._metrics['train/loss']):.3f}")
        if "perf/tokens_per_s" in self._metrics:
            parts.append(f"{format_count(float(self._metrics['perf/tokens_per_s']))} tok/s")
        parts.append(f"ETA {format_duration(self.eta_seconds(now))}")
        return " ".join(parts)[: self._columns()]

    def _draw_bar(self, now: float) -> None:
        text = self._bar_line(now)
        self.stream.write("\r" + text.ljust(self._drawn_width))
        self.stream.flush()
        self._drawn_width = len(text)
        self._last_draw = now

    def _clear_bar(self) -> None:
        if self._drawn_width:
            self.stream.write("\r" + " " * self._drawn_width + "\r")
            self._drawn_width = 0

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """At a logging step: a plain line, or a bar redraw, with the latest metrics."""
        now = self._observe(step)
        self._metrics = dict(metrics)
        if self.mode == "bar":
            self._draw_bar(now)
        else:
            self.stream.write(self._line(now) + "\n")
            self.stream.flush()

    def tick(self, step: int) -> None:
        """Every step: records timing; in bar mode redraws at most every ``TICK_INTERVAL_S`` seconds."""
        now = self._observe(step)
        if self.mode == "bar" and now - self._last_draw >= TICK_INTERVAL_S:
            self._draw_bar(now)

    def message(self, text: str) -> None:
        """A line printed above the bar (or between the plain lines), e.g. ``val loss 3.21 at step 100``."""
        if self.mode == "bar":
            self._clear_bar()
            self.stream.write(text + "\n")
            self._draw_bar(self.clock())
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self, summary: dict[str, Any] | None = None, files: dict[str, Path] | None = None,
              run_dir: Path | None = None) -> None:
        """End the bar line and print the closing table: the steps this session trained (of the run's total),
        its time, the final figures in ``summary``, and ``files`` (label -> path, shown relative to ``run_dir``
        when inside it)."""
        if self._closed:
            return
        self._closed = True
        now = self.clock()
        if self.mode == "bar" and self._drawn_width:
            self.stream.write("\n")
        trained = self._step - self._start_step
        span = f" ({self._start_step + 1}-{self._step} of {self.total_steps})" if self._start_step else ""
        lines = [f"done: {trained} steps{span} in {format_duration(now - self._start_time)}"]
        lines += [f"  {label:<14} {value}" for label, value in summary_rows(summary or {})]
        if files:
            lines.append(f"files in {run_dir}:" if run_dir else "files:")
            lines += [f"  {label:<14} {_relative(Path(path), run_dir)}" for label, path in files.items()]
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()


def _relative(path: Path, run_dir: Path | None) -> str:
    """A folder ends with "/"; inside ``run_dir`` the path is shown relative to it."""
    shown = path.relative_to(run_dir) if run_dir is not None and path.is_relative_to(run_dir) else path
    return f"{shown}/" if path.is_dir() else str(shown)


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """The closing table's (label, text) rows: known keys first, with units; lists summarised, never dumped."""
    keys = [k for k in _SUMMARY_LABELS if k in summary]
    keys += [k for k in summary if k not in _SUMMARY_LABELS and k not in _SAID_ELSEWHERE]
    rows = []
    for key in keys:
        value = summary[key]
        if key == "perf/tokens_per_s":
            text = f"{format_count(float(value))} tokens/s (mean of this session)"
        elif key == "perf/memory_peak_gib_per_rank":
            text = _memory_text(value, summary)
        elif key == "perf/memory_resident_peak_gib":
            text = f"{value:.2f} GiB (the process's memory, tensors or not: the largest rank's)"
        elif key == "train/loss":
            text = f"{value:.4f} (mean of the last log interval)"
        elif isinstance(value, list):
            text = f"{len(value)} values, {min(value):.4g} to {max(value):.4g}" if value else "none"
        else:
            text = f"{value:.4f}" if key.startswith("val/") and isinstance(value, float) else _number(value)
        rows.append((_SUMMARY_LABELS.get(key, key), text))
    return rows


def _span(values: list[float]) -> str:
    """``0.36``, or ``0.35-0.37`` when the ranks differ at the printed digits."""
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def _memory_text(peaks: list[float], summary: dict[str, Any]) -> str:
    """``0.79 GiB (0.33 GiB of it before the model; memory model 0.80 GiB)``, as a range over several ranks."""
    before = summary.get("perf/memory_before_model_gib_per_rank") or []
    text = f"{_span(peaks)} GiB" + (f" per rank over {len(peaks)} ranks" if len(peaks) > 1 else "")
    notes = [f"{_span(before)} GiB of it held before the model"] if before else []
    if isinstance(summary.get("perf/memory_predicted_gib"), (int, float)):
        notes.append(f"memory model {summary['perf/memory_predicted_gib']:.2f} GiB")
    return text + (f" ({'; '.join(notes)})" if notes else "")
