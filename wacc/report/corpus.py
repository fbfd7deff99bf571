"""The report's corpus: deterministic scenarios per strategy family, work dtype and gradient dtype.

The scenarios are drawn by Hypothesis from :func:`wacc_ref.strategies.scenarios` with a fixed seed
(``@seed(corpus_seed)``, generation only, no database), so the same seed and size give the same
corpus on every machine with the same Hypothesis version. Sizes: ``quick`` (every cell present,
for a sub-minute run), ``default`` and ``full`` (nightly).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, given, seed, settings

from wacc.engine import FAMILIES
from wacc_ref import formats
from wacc_ref.scenario import Scenario, to_json
from wacc_ref.strategies import scenarios

__all__ = ["CORPUS_SIZES", "CorpusEntry", "build_corpus"]

# size -> scenarios per (family, work dtype, gradient dtype) cell
CORPUS_SIZES: Mapping[str, int] = {"quick": 1, "default": 6, "full": 60}


@dataclass(frozen=True)
class CorpusEntry:
    """One scenario of the corpus, named by its cell and a content hash."""

    family: str
    scenario: Scenario

    @property
    def scenario_id(self) -> str:
        """A short stable name: work dtype, family and the first hex digits of its JSON hash."""
        digest = hashlib.sha256(to_json(self.scenario).encode()).hexdigest()[:10]
        return f"{self.scenario.work_dtype}-{self.family}-{digest}"


def _cell(family: str, work: str, grad: str, count: int, corpus_seed: int) -> list[Scenario]:
    drawn: list[Scenario] = []
    options = dict(FAMILIES[family])

    # Hypothesis draws its simplest example first (a one-step scenario): skip it.
    @seed(corpus_seed)
    @settings(
        max_examples=count + 1,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(scenarios(work_dtypes=(work,), grad_dtypes=(grad,), fused=False, **options))
    def collect(scenario: Scenario) -> None:
        drawn.append(scenario)

    collect()
    return drawn[1 : count + 1]


def build_corpus(*, size: str = "default", corpus_seed: int = 0) -> list[CorpusEntry]:
    """Every family x work dtype x gradient dtype, ``CORPUS_SIZES[size]`` scenarios each."""
    count = CORPUS_SIZES[size]
    entries: list[CorpusEntry] = []
    for family in FAMILIES:
        for work in formats.WORK_DTYPES:
            for grad in formats.FORMATS:
                for scenario in _cell(family, work, grad, count, corpus_seed):
                    entries.append(CorpusEntry(family=family, scenario=scenario))
    return entries
