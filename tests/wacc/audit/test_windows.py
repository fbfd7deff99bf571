"""The audit's windows: counts as the causal loss counts them, fixed shapes, reproducible."""

from __future__ import annotations

import pytest
import torch

from wacc.audit.windows import IGNORE_INDEX, WINDOW_NAMES, build_window, target_count


@pytest.mark.parametrize("name", WINDOW_NAMES)
def test_counts_are_the_shifted_labels(name: str) -> None:
    """Each microbatch's target count is the number of shifted labels that are not -100."""
    window = build_window(name)
    for microbatch, n in zip(window.microbatches, window.targets, strict=True):
        assert int((microbatch["labels"][1:] != IGNORE_INDEX).sum()) == n
        assert target_count(microbatch["labels"]) == n


@pytest.mark.parametrize("name", WINDOW_NAMES)
def test_fixed_shapes_padded_with_ignored_labels(name: str) -> None:
    """Every microbatch of a window has one length; padding carries label -100 and token 0."""
    window = build_window(name)
    widths = {mb["input_ids"].numel() for mb in window.microbatches}
    assert len(widths) == 1
    for microbatch, n in zip(window.microbatches, window.targets, strict=True):
        used = n + 1 if n else 0
        assert bool((microbatch["labels"][used:] == IGNORE_INDEX).all())
        if n:
            assert bool((microbatch["input_ids"][used:] == 0).all())


def test_the_issue_windows() -> None:
    """unequal is 1/7/200/3, equal 4x64, zero has a zero-target microbatch, longtail varies."""
    assert build_window("unequal").targets == (1, 7, 200, 3)
    assert build_window("equal").targets == (64, 64, 64, 64)
    assert 0 in build_window("zero").targets
    tail = build_window("longtail").targets
    assert len(set(tail)) > 1 and max(tail) >= 4 * min(tail)


@pytest.mark.parametrize("name", WINDOW_NAMES)
def test_reproducible(name: str) -> None:
    """Building a window twice gives the same tensors."""
    a, b = build_window(name), build_window(name)
    for x, y in zip(a.microbatches, b.microbatches, strict=True):
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
