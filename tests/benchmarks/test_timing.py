"""The timing helpers: median, ratio, and the interleaved round-robin schedule."""

from __future__ import annotations

import pytest

from benchmarks.timing import Timed, interleaved_medians, interleaved_samples, median, ratio


def test_median_of_odd_and_even_counts() -> None:
    """The median is the middle sample, or the mean of the two middle ones."""
    assert median([5.0, 1.0, 3.0]) == 3.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    with pytest.raises(ValueError, match="no samples"):
        median([])


def test_ratio_divides_by_a_positive_floor_only() -> None:
    """A ratio is value / floor; a floor of zero (or less) is refused, not turned into inf."""
    assert ratio(3.0, 2.0) == 1.5
    with pytest.raises(ValueError, match="0.0"):
        ratio(1.0, 0.0)


def test_modes_run_interleaved_rotated_with_setup_before_each_call() -> None:
    """Every round runs each mode once, rotating the order; setup precedes each call; warm-up
    rounds are run but not kept."""
    events: list[str] = []
    modes = {
        name: Timed(
            lambda name=name: events.append(name),  # type: ignore[misc]
            setup=lambda name=name: events.append(name + "-setup"),  # type: ignore[misc]
        )
        for name in "abc"
    }
    samples = interleaved_samples(modes, device="cpu", repeats=2, warmup=1)
    calls = [event for event in events if not event.endswith("-setup")]
    assert calls == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(events[2 * i] == events[2 * i + 1] + "-setup" for i in range(9))
    assert {name: len(values) for name, values in samples.items()} == {"a": 2, "b": 2, "c": 2}
    assert all(value >= 0.0 for values in samples.values() for value in values)


def test_medians_come_from_the_samples() -> None:
    """``interleaved_medians`` reports one non-negative median per mode, keyed by name."""
    medians = interleaved_medians({"x": Timed(lambda: None)}, device="cpu", repeats=3)
    assert list(medians) == ["x"] and medians["x"] >= 0.0
    with pytest.raises(ValueError, match="repeats"):
        interleaved_samples({"x": Timed(lambda: None)}, device="cpu", repeats=0)
