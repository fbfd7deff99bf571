"""The report's corpus (wacc.report.corpus): the frozen seed-0 corpus and its sizes."""

from __future__ import annotations

from collections import Counter

from wacc.engine import FAMILIES
from wacc.report.corpus import CORPUS_SIZES, FROZEN_CORPUS, build_corpus
from wacc_ref import formats


def test_the_frozen_default_corpus_fills_every_cell() -> None:
    """The shipped corpus holds CORPUS_SIZES['default'] scenarios per family x dtype x dtype."""
    assert FROZEN_CORPUS.is_file()
    corpus = build_corpus()
    cells = Counter((e.family, e.scenario.work_dtype, e.scenario.grad_dtype) for e in corpus)
    expected = {(f, w, g) for f in FAMILIES for w in formats.WORK_DTYPES for g in formats.FORMATS}
    assert set(cells) == expected and set(cells.values()) == {CORPUS_SIZES["default"]}
    assert len({e.scenario_id for e in corpus}) == len(corpus)


def test_quick_is_the_first_scenario_of_every_default_cell() -> None:
    """``quick`` takes one scenario per cell, the first of the frozen default corpus."""
    quick, default = build_corpus(size="quick"), build_corpus()
    firsts = {}
    for entry in default:
        firsts.setdefault(
            (entry.family, entry.scenario.work_dtype, entry.scenario.grad_dtype), entry
        )
    assert [e.scenario_id for e in quick] == [e.scenario_id for e in firsts.values()]


def test_reading_the_frozen_corpus_twice_gives_the_same_scenarios() -> None:
    """The corpus does not depend on anything drawn at run time."""
    assert [e.scenario_id for e in build_corpus()] == [e.scenario_id for e in build_corpus()]
