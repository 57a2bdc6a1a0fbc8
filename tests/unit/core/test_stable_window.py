"""When a stable plan (:mod:`zen_ds.sync.stable`) is dropped: a row count that moved more than a
quarter octave from the count the plan was made at, whichever side of a power of two it lies."""
from __future__ import annotations

import pytest

from zen_ds.schemes import get_scheme
from zen_ds.sync.stable import COUNT_DRIFT_OCTAVES, count_moved, stable_schemes


@pytest.mark.parametrize("planned,count", [(62, 63), (63, 62), (62, 64), (60, 70), (800, 700),
                                           (0, 0), (127, 128)])
def test_small_moves_keep_the_plan(planned: int, count: int) -> None:
    # 62 -> 63 and 127 -> 128 cross a half-octave boundary: fixed classes dropped these plans
    assert not count_moved(count, planned)


@pytest.mark.parametrize("planned,count", [(60, 75), (75, 60), (800, 90), (0, 1), (64, 48)])
def test_moves_beyond_the_window_drop_the_plan(planned: int, count: int) -> None:
    assert count_moved(count, planned)


def test_the_window_is_symmetric_and_half_an_octave_wide() -> None:
    assert COUNT_DRIFT_OCTAVES == 0.25
    for planned in (1, 10, 100, 1000, 10**6):
        for count in range(max(planned // 2, 0), planned * 2):
            assert count_moved(count, planned) == count_moved(planned, count)


def test_sparcml_keeps_stable_plans() -> None:
    """sparcml's first message carries a stable plan's checks (its row counts or range
    counts), one int64 to each peer."""
    assert "sparcml" in stable_schemes()
    assert get_scheme("sparcml").checks_in_counts
