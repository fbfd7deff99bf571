"""The audit's models (``wacc.audit.models``): every build of a model kind has the same weights,
whichever thread builds it first."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from wacc.audit import models
from wacc.audit.models import MODEL_KINDS, ModelSpec


def _slow_factory() -> nn.Module:
    """An init that draws from torch's global generator in several steps, yielding the GIL in
    between (as a real model's many ``nn.init`` calls can)."""
    layers = []
    for _ in range(6):
        layers.append(nn.Linear(4, 4))
        time.sleep(0.005)
    return nn.Sequential(*layers)


@pytest.fixture
def racing_kinds(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    names = ["race-a", "race-b"]
    for name in names:
        monkeypatch.setitem(MODEL_KINDS, name, ModelSpec(name, _slow_factory))
    yield names
    for name in names:
        models._BASES.pop(name, None)


def test_two_threads_building_at_once_get_the_seeded_weights(racing_kinds: list[str]) -> None:
    """Two model kinds built at the same time by two threads (the audit across ranks computes
    each loop's truth in a thread of its own) each get the weights a build alone gets: the seeded
    global generator is not shared between two builds."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(models.MODEL_SEED)
        alone = _slow_factory().state_dict()
    start = threading.Barrier(len(racing_kinds))
    built: dict[str, nn.Module] = {}

    def build(name: str) -> None:
        start.wait()
        built[name] = MODEL_KINDS[name].build(torch.float32)

    threads = [threading.Thread(target=build, args=(name,)) for name in racing_kinds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name in racing_kinds:
        state = built[name].state_dict()
        for key, value in alone.items():
            assert torch.equal(state[key], value), (name, key)


def test_a_factory_that_builds_another_kind_inside_does_not_wait_for_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A factory that builds another model kind inside its own build (a LoRA model builds its
    base) gets it: the build lock is reentrant (a plain lock once hung every LoRA row)."""
    monkeypatch.setitem(MODEL_KINDS, "race-base", ModelSpec("race-base", _slow_factory))

    def wrapped() -> nn.Module:
        return nn.Sequential(models._base("race-base"), nn.Linear(4, 4))

    monkeypatch.setitem(MODEL_KINDS, "race-wrapped", ModelSpec("race-wrapped", wrapped))
    done: list[nn.Module] = []
    thread = threading.Thread(
        target=lambda: done.append(MODEL_KINDS["race-wrapped"].build(torch.float32)), daemon=True
    )
    try:
        thread.start()
        thread.join(timeout=30)
        assert done, "the nested build never returned"
    finally:
        models._BASES.pop("race-base", None)
        models._BASES.pop("race-wrapped", None)
