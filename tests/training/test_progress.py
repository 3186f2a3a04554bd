"""Progress: plain lines, the live bar, ETA with a fake clock, the summary, and the format helpers."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from training.progress import Progress, format_count, format_duration


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (45, "45s"), (59.4, "59s"), (59.6, "1m00s"), (187, "3m07s"), (3599, "59m59s"),
    (7500, "2h05m"), (90000, "25h00m"), (-3, "0s"), (float("nan"), "?"), (float("inf"), "?"),
])
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


@pytest.mark.parametrize(("n", "text"), [
    (0, "0"), (950, "950"), (999.4, "999"), (999.6, "1.00k"), (1234, "1.23k"), (12_345, "12.3k"),
    (123_456, "123k"), (999_600, "1.00M"), (4_560_000, "4.56M"), (2.5e9, "2.50G"), (7e12, "7.00T"),
])
def test_format_count(n: float, text: str) -> None:
    assert format_count(n) == text


def test_line_mode_format() -> None:
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(300, stream=stream, clock=clock)
    assert progress.mode == "lines"  # StringIO is not a terminal
    progress.tick(1)  # first step: its time (warm-up) is left out of the ETA
    clock.now += 39 * 2.0
    progress.update(40, {
        "train/loss": 3.4123, "train/aux_loss": 0.01234, "train/z_loss": 0.0021,
        "train/dropped_frac": 0.012, "perf/tokens_per_s": 12_345.0, "train/lr": 1e-3,
    })
    # 260 steps left at 2 s/step = 520 s
    assert stream.getvalue() == (
        "step  40/300 | loss 3.412 | aux 0.0123 | z 0.0021 | dropped 1.2% | 12.3k tok/s | ETA 8m40s\n"
    )


def test_line_mode_uses_only_present_keys_and_tick_prints_nothing() -> None:
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(50, mode="lines", stream=stream, clock=clock)
    progress.tick(1)
    progress.tick(2)
    assert stream.getvalue() == ""
    clock.now += 9 * 1.5  # steps 2..10 after the first
    progress.update(10, {"train/loss": 2.0})
    assert stream.getvalue() == "step 10/50 | loss 2.000 | ETA 1m00s\n"  # 40 steps * 1.5 s


def test_eta_ignores_warmup_and_decreases() -> None:
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(100, stream=stream, clock=clock)
    clock.now += 30.0  # slow first step (compilation)
    progress.update(1, {})
    first_eta = progress.eta_seconds()
    assert first_eta == pytest.approx(99 * 30.0)  # one step seen: its own time is all there is
    etas = []
    for step in range(2, 101):
        clock.now += 0.5
        progress.update(step, {})
        etas.append(progress.eta_seconds())
    assert etas[0] == pytest.approx(98 * 0.5)  # warm-up excluded from then on
    assert all(later < earlier for earlier, later in zip(etas[:-1], etas[1:], strict=True))
    assert etas[-1] == 0.0
    lines = stream.getvalue().splitlines()
    assert lines[1].endswith("ETA 49s") and lines[-1].endswith("ETA 0s")


def test_eta_unknown_before_any_step() -> None:
    stream = io.StringIO()
    progress = Progress(10, stream=stream, clock=FakeClock())
    progress.update(0, {"train/loss": 5.0})
    assert stream.getvalue() == "step  0/10 | loss 5.000 | ETA ?\n"


def test_resumed_run_measures_from_start_step() -> None:
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(300, stream=stream, clock=clock, start_step=200)
    clock.now += 10.0
    progress.update(210, {})  # 10 steps in 10 s, 90 left
    assert progress.eta_seconds() == pytest.approx(90.0)


def test_bar_mode_redraws_in_place_within_100_columns() -> None:
    stream, clock = FakeTty(), FakeClock()
    progress = Progress(300, stream=stream, clock=clock)
    assert progress.mode == "bar"
    progress.tick(1)
    clock.now += 2.0
    progress.update(150, {
        "train/loss": 3.4123, "train/aux_loss": 0.01, "train/z_loss": 0.002,
        "train/dropped_frac": 0.5, "perf/tokens_per_s": 4_560_000.0,
    })
    out = stream.getvalue()
    assert "\n" not in out and out.startswith("\r")
    frames = out.split("\r")[1:]
    assert all(len(frame) <= 100 for frame in frames)
    last = frames[-1]
    assert re.fullmatch(r"\[#{12}\.{12}\] 150/300 loss 3\.412 4\.56M tok/s ETA \d+s *", last), last


def test_bar_tick_redraws_at_most_four_times_a_second() -> None:
    stream, clock = FakeTty(), FakeClock()
    progress = Progress(1000, mode="bar", stream=stream, clock=clock)
    for step in range(1, 101):  # 100 steps in 1 s
        clock.now += 0.01
        progress.tick(step)
    frames = stream.getvalue().split("\r")[1:]
    assert 3 <= len(frames) <= 5
    last_drawn = int(re.search(r" (\d+)/1000 ", frames[-1]).group(1))
    assert 75 <= last_drawn <= 100  # the bar lags the step counter by at most a quarter second
    progress.update(100, {"train/loss": 2.0})  # a logging step always redraws
    assert " 100/1000 loss 2.000 " in stream.getvalue().split("\r")[-1]


def test_bar_message_goes_above_the_bar() -> None:
    stream, clock = FakeTty(), FakeClock()
    progress = Progress(300, mode="bar", stream=stream, clock=clock)
    progress.update(100, {"train/loss": 3.3})
    progress.message("val loss 3.21 at step 100")
    out = stream.getvalue()
    before, after = out.split("val loss 3.21 at step 100\n")
    assert before.endswith("\r") and before.rstrip("\r").split("\r")[-1].strip() == ""  # bar erased first
    assert after.startswith("\r[") and "100/300" in after  # bar redrawn below


def test_close_prints_summary(tmp_path) -> None:
    (tmp_path / "plots").mkdir()
    stream, clock = FakeTty(), FakeClock()
    progress = Progress(300, mode="bar", stream=stream, clock=clock)
    clock.now += 312.0
    progress.update(300, {"train/loss": 3.1})
    progress.close(
        {"train/loss": 3.1234, "val/loss": 3.21, "perf/tokens_per_s": 12_300.0, "steps_skipped": 2, "steps": 300,
         "time_s": 312.0, "perf/memory_peak_gib": 0.8, "perf/memory_peak_gib_per_rank": [0.7905],
         "perf/memory_before_model_gib_per_rank": [0.3338], "perf/memory_predicted_gib": 0.801,
         "perf/memory_resident_peak_gib": 1.234},
        {"metrics": tmp_path / "metrics.jsonl", "plots": tmp_path / "plots", "elsewhere": Path("/ckpt/run")}, tmp_path)
    out = stream.getvalue()
    bar, summary = out.split("\n", 1)
    assert "300/300" in bar
    assert summary == (
        "done: 300 steps in 5m12s\n"
        "  train loss     3.1234 (mean of the last log interval)\n"
        "  val loss       3.2100\n"
        "  throughput     12.3k tokens/s (mean of this session)\n"
        "  peak memory    0.79 GiB (0.33 GiB of it held before the model; memory model 0.80 GiB)\n"
        "  resident peak  1.23 GiB (the process's memory, tensors or not: the largest rank's)\n"
        "  steps_skipped  2\n"
        f"files in {tmp_path}:\n"
        "  metrics        metrics.jsonl\n"
        "  plots          plots/\n"
        "  elsewhere      /ckpt/run\n"
    )
    progress.close({"train/loss": 1.0})
    assert stream.getvalue() == out  # idempotent


def test_close_counts_the_steps_of_a_resumed_session_and_summarises_lists() -> None:
    """A session resumed after step 10 of 16 trained 6 steps, not 16; per-rank lists are ranges, never dumped."""
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(16, mode="lines", stream=stream, clock=clock, start_step=10)
    clock.now += 8.0
    progress.update(16, {})
    progress.close({"perf/memory_peak_gib_per_rank": [0.3579, 0.3693], "router/load": [0.25, 0.75],
                    "perf/memory_before_model_gib_per_rank": [0.3208, 0.3211]})
    lines = stream.getvalue().splitlines()
    assert lines[-3:] == ["done: 6 steps (11-16 of 16) in 8s",
                          "  peak memory    0.36-0.37 GiB per rank over 2 ranks (0.32 GiB of it held before the model)",
                          "  router/load    2 values, 0.25 to 0.75"]


def test_close_in_line_mode_without_summary() -> None:
    stream, clock = io.StringIO(), FakeClock()
    progress = Progress(20, mode="lines", stream=stream, clock=clock)
    clock.now += 45.0
    progress.update(20, {})
    progress.close()
    assert stream.getvalue().splitlines()[-1] == "done: 20 steps in 45s"


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="logging.progress='fancy'.*auto, bar, lines"):
        Progress(10, mode="fancy")
