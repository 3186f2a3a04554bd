"""Young's and Daly's checkpoint intervals against hand-computed values and Daly's published examples."""

import math

import pytest

from training.checkpoint_interval import AutoInterval, daly_interval, expected_lost_work, young_interval

MINUTE, HOUR = 60.0, 3600.0


def test_young_is_the_square_root_of_twice_save_time_times_mtbf():
    assert young_interval(5 * MINUTE, 24 * HOUR) == pytest.approx(120 * MINUTE)  # sqrt(2 * 5 * 1440) = 120
    assert young_interval(2.0, 100.0) == pytest.approx(20.0)
    assert young_interval(0.0, 100.0) == 0.0


@pytest.mark.parametrize("mtbf, published_minutes", [(24 * HOUR, 117), (6 * HOUR, 57), (15 * MINUTE, 9.1)])
def test_daly_reproduces_his_published_examples(mtbf, published_minutes):
    """Daly (2006), figure captions: save time 5 min; the optimum rounded as printed."""
    assert daly_interval(5 * MINUTE, mtbf) / MINUTE == pytest.approx(published_minutes, abs=0.5)


def test_daly_by_hand():
    # delta = 2, M = 100: ratio = 0.01, sqrt(400) * (1 + 0.1 / 3 + 0.01 / 9) - 2
    assert daly_interval(2.0, 100.0) == pytest.approx(20 * (1 + 0.1 / 3 + 0.01 / 9) - 2)
    assert daly_interval(200.0, 100.0) == 100.0  # a save as long as 2M: checkpoint every M
    assert daly_interval(500.0, 100.0) == 100.0
    assert expected_lost_work(20.0, 2.0) == 11.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="MTBF"):
        daly_interval(1.0, 0.0)
    with pytest.raises(ValueError, match="save time"):
        young_interval(-1.0, 10.0)


def test_auto_interval_is_re_estimated_from_measured_saves():
    auto = AutoInterval(mtbf_s=100.0)
    assert auto.interval_s == 0.0 and "waiting" in auto.describe()  # nothing measured: save at once
    auto.observe(2.0)
    assert auto.interval_s == pytest.approx(daly_interval(2.0, 100.0))
    auto.observe(4.0)  # moving average, half weight on the new save
    assert auto.save_s == 3.0
    assert auto.interval_s == pytest.approx(daly_interval(3.0, 100.0))
    line = auto.describe()
    assert "Daly" in line and f"Young {math.sqrt(600):.1f} s" in line and "expected work lost" in line
