"""The report's corpus: deterministic scenarios per strategy family, work dtype and gradient dtype.

The scenarios are drawn by Hypothesis from :func:`wacc_ref.strategies.scenarios` with a fixed seed
(``@seed(corpus_seed)``, generation only, no database). Hypothesis' generation is not a pure
function of the seed, though: it also draws constants it collects from the source files of the
modules loaded at the time (its "local constants", with a time limit on collecting them), so the
same seed gives other scenarios after any code change, in another environment, or with other
modules imported. The seed-0 corpus of sizes ``quick`` and ``default`` is therefore frozen: drawn
once and shipped with the package (:data:`FROZEN_CORPUS`, extended only by
``python -m wacc.report.corpus``, which appends the cells of a family new to
:data:`~wacc.judge.engine.CORPUS_FAMILIES` and leaves the others as they are), so the report and the
gate judge the very same scenarios everywhere. ``full`` (nightly) and other seeds are drawn
afresh. Sizes: ``quick`` (every cell present, a sub-minute run; the first scenario of each cell
of ``default``), ``default`` and ``full``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

from wacc.judge.engine import CORPUS_FAMILIES, FAMILIES
from wacc.judge.implementation import Implementation
from wacc_ref import formats
from wacc_ref.scenario import Scenario, from_json, to_json, without_interruptions
from wacc_ref.strategies import scenarios

__all__ = [
    "CORPUS_SIZES",
    "FROZEN_CORPUS",
    "FUSED_SUFFIX",
    "NO_RECORDS_SUFFIX",
    "CorpusEntry",
    "build_corpus",
    "freeze_corpus",
    "judged_scenario",
    "scenario_of_replay",
]

FUSED_SUFFIX = "-fused"  # the fused=True twin of a corpus scenario
NO_RECORDS_SUFFIX = "-no-records"  # the twin without checkpoints and restores

FROZEN_CORPUS = Path(__file__).with_name("data") / "corpus-seed0-default.jsonl.gz"

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


def draw_corpus(*, size: str, corpus_seed: int) -> list[CorpusEntry]:
    """Every family x work dtype x gradient dtype, ``CORPUS_SIZES[size]`` each, drawn now."""
    count = CORPUS_SIZES[size]
    entries: list[CorpusEntry] = []
    for family in CORPUS_FAMILIES:
        for work in formats.WORK_DTYPES:
            for grad in formats.FORMATS:
                for scenario in _cell(family, work, grad, count, corpus_seed):
                    entries.append(CorpusEntry(family=family, scenario=scenario))
    return entries


def _read_frozen(path: Path = FROZEN_CORPUS) -> list[CorpusEntry]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [
            CorpusEntry(family=item["family"], scenario=from_json(json.dumps(item["scenario"])))
            for item in map(json.loads, handle)
        ]


def build_corpus(*, size: str = "default", corpus_seed: int = 0) -> list[CorpusEntry]:
    """The corpus of ``size`` and ``corpus_seed``: the frozen one for seed 0 (quick, default)."""
    if size not in CORPUS_SIZES:
        raise ValueError(f"unknown corpus size {size!r}; sizes are {', '.join(CORPUS_SIZES)}")
    if corpus_seed != 0 or size == "full":
        return draw_corpus(size=size, corpus_seed=corpus_seed)
    frozen = _read_frozen()
    if size == "default":
        return frozen
    seen: set[tuple[str, str, str]] = set()
    quick = []
    for entry in frozen:  # the first scenario of each cell
        cell = (entry.family, entry.scenario.work_dtype, entry.scenario.grad_dtype)
        if cell not in seen:
            seen.add(cell)
            quick.append(entry)
    return quick


def freeze_corpus(path: Path = FROZEN_CORPUS, *, redraw: bool = False) -> Path:
    """Write the seed-0 default corpus to ``path`` (gzipped JSON lines). The cells already in
    the file are kept as they are, and only the families it lacks are drawn and appended (a
    redraw would change every old scenario: see the module docstring); ``redraw`` draws all."""
    kept = [] if redraw or not path.exists() else _read_frozen(path)
    present = {entry.family for entry in kept}
    count = CORPUS_SIZES["default"]
    entries = list(kept)
    for family in CORPUS_FAMILIES:
        if family in present:
            continue
        for work in formats.WORK_DTYPES:
            for grad in formats.FORMATS:
                for scenario in _cell(family, work, grad, count, 0):
                    entries.append(CorpusEntry(family=family, scenario=scenario))
    lines = [
        json.dumps(
            {"family": e.family, "scenario": json.loads(to_json(e.scenario))}, sort_keys=True
        )
        for e in entries
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.GzipFile(path, "wb", mtime=0) as handle:  # mtime 0: the same bytes every time
        handle.write(("\n".join(lines) + "\n").encode("utf-8"))
    return path


if __name__ == "__main__":
    print(f"wrote {freeze_corpus()}")


def judged_scenario(
    entry: CorpusEntry, implementation: Implementation
) -> tuple[Scenario, str] | None:
    """The scenario ``implementation`` is judged on, and the suffix of its replay file's name;
    None when it is not judged (its family, or one of its steps, needs a feature the
    implementation lacks: ``wacc check`` does not run that family either).

    An implementation that declares ``fused`` runs the ``fused=True`` twin; one without records
    (feature ``records``) runs the twin without checkpoints and restores, as ``wacc check``
    generates none for it: the missing feature is reported once as unsupported, not as a
    semantics failure in every scenario that checkpoints.
    """
    if not implementation.coverage().judges_family(entry.family):
        return None
    scenario = dataclasses.replace(entry.scenario, fused=implementation.fused)
    suffix = FUSED_SUFFIX if implementation.fused else ""
    judged = implementation.judgeable(scenario)
    if judged is None:
        return None
    if judged != scenario:
        suffix += NO_RECORDS_SUFFIX
    return judged, suffix


def scenario_of_replay(entry: CorpusEntry, suffix: str) -> Scenario:
    """The scenario a replay file of ``entry`` with ``suffix`` holds (see
    :func:`judged_scenario`)."""
    scenario = entry.scenario
    if suffix.startswith(FUSED_SUFFIX):
        scenario = dataclasses.replace(scenario, fused=True)
    if suffix.endswith(NO_RECORDS_SUFFIX):
        scenario = without_interruptions(scenario)
    return scenario
