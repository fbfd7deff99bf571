"""The gate's measurements: work units, shards, and metrics per (dtype, family, source) key.

Two sources, both deterministic: ``corpus`` (the report's seeded corpus, one unit per scenario)
and ``check`` (``wacc check``'s families and stateful machine under the ``ci`` profile, one unit
per work dtype x family). Unit ``i`` of the ordered list belongs to shard ``i mod N`` (shard
``K/N`` takes ``i mod N == K - 1``), so shards are disjoint, cover everything, and merging their
metrics (sums of counts, maxima of metrics: associative) equals the unsharded run exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from wacc.gate.metrics import (
    GATE_CORPUS,
    GATE_CORPUS_SEED,
    GATE_CORPUS_SIZE,
    GateFinding,
    Metrics,
)
from wacc.gate.shards import Shard
from wacc.judge.engine import CheckConfig, family_names, run_family
from wacc.judge.implementation import Implementation
from wacc.judge.signature import signature
from wacc.judge.verdict import ORACLES, ScenarioVerdict, judge
from wacc.report.corpus import CorpusEntry, build_corpus, judged_scenario
from wacc_ref import formats
from wacc_ref.scenario import to_json

__all__ = [
    "GATE_CORPUS",
    "GATE_CORPUS_SEED",
    "GATE_CORPUS_SIZE",
    "NOT_RECURRED",
    "GateFinding",
    "Metrics",
    "Shard",
    "Unit",
    "finding_message",
    "measure",
    "merge_metrics",
    "replay_name",
    "units",
]

WHOLE_RUN = Shard()  # 1/1


@dataclass(frozen=True)
class Unit:
    """One unit of gate work: a corpus scenario, or one check family on one dtype."""

    key: str  # "<dtype>/<family>/<source>"
    entry: CorpusEntry | None = None
    dtype: str = ""
    family: str = ""


def units(corpus: Iterable[CorpusEntry]) -> list[Unit]:
    """Every unit, in the fixed order shards are cut from: the checks first, then the corpus."""
    out = [
        Unit(key=f"{dtype}/{family}/check", dtype=dtype, family=family)
        for dtype in formats.WORK_DTYPES
        for family in family_names()
    ]
    out += [
        Unit(key=f"{entry.scenario.work_dtype}/{entry.family}/corpus", entry=entry)
        for entry in corpus
    ]
    return out


def replay_name(position: int, unit: Unit) -> str:
    """The replay file of unit ``position``'s failure: unique across shards (positions are)."""
    return f"gate-{position:05d}-{unit.key.replace('/', '-')}.json"


def measure(
    implementation: Implementation,
    *,
    shard: Shard = WHOLE_RUN,
    corpus: list[CorpusEntry] | None = None,
    out: Path | None = None,
    progress: Callable[[str], None] = lambda key: None,
) -> dict[str, Metrics]:
    """Run this shard's units; metrics per key (keys of other shards absent).

    Every failing scenario becomes a :class:`GateFinding`; with ``out`` its scenario is also
    written there as a replay file (the shrunk one for a check family). A unit the
    implementation is not judged on (its family needs a missing feature: :mod:`wacc.judge.contract`)
    is not run, and its key is absent from the result.
    """
    if corpus is None:
        corpus = build_corpus(size=GATE_CORPUS_SIZE, corpus_seed=GATE_CORPUS_SEED)
    results: dict[str, Metrics] = {}
    # No shrinking: the gate reports that a key fails; `wacc check` shrinks and explains.
    config = CheckConfig(profile="ci", shrink_seconds=0.0)
    coverage = implementation.coverage()
    for position, unit in enumerate(units(corpus)):
        if not shard.takes(position):
            continue
        # A unit the implementation is not judged on is not run: its key stays absent.
        taken = None if unit.entry is None else judged_scenario(unit.entry, implementation)
        if taken is None and (unit.entry is not None or not coverage.judges_family(unit.family)):
            continue
        progress(unit.key)
        metrics = results.setdefault(unit.key, Metrics())
        started = time.perf_counter()
        recurred = True
        if taken is not None:
            judged = judge(implementation, taken[0], oracles=ORACLES)
            metrics.add(judged)
            verdict: ScenarioVerdict | None = judged
        else:  # the family's first failure, shrunk (None: none)
            seen: list[ScenarioVerdict] = []  # the failing scenarios as first judged

            def observe(
                judged: ScenarioVerdict, seen: list[ScenarioVerdict] = seen,
                metrics: Metrics = metrics,
            ) -> None:  # fmt: skip
                # A family stops at its first failure: one failing scenario, however often it
                # is judged again before the run ends (then no finding would explain the rest).
                metrics.add(judged, counted=not (judged.failed and seen))
                if judged.failed:
                    seen.append(judged)

            verdict = run_family(
                implementation, unit.dtype, unit.family, config, on_verdict=observe
            )
            if verdict is not None:
                metrics.add(verdict, counted=False)
            if seen and (verdict is None or not verdict.failed):
                # Failed, then passed when judged again: the scenario that failed is the
                # finding, replayable, and says so.
                verdict = seen[0]
                recurred = False
        if verdict is not None and verdict.failed:
            replay = None
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                path = out / replay_name(position, unit)
                path.write_text(to_json(verdict.scenario, indent=1) + "\n", encoding="utf-8")
                replay = str(path)
            message = finding_message(verdict)
            if not recurred:
                message = f"{NOT_RECURRED}: {message}"
            metrics.findings.append(
                GateFinding(
                    signature=signature(verdict),
                    message=message,
                    replay=replay,
                    steps=len(verdict.scenario.steps),
                )
            )
        metrics.milliseconds += round((time.perf_counter() - started) * 1000)
    return results


NOT_RECURRED = (
    "failed, and passed when this scenario was judged again (is the implementation "
    "deterministic? `wacc replay` judges it once more)"
)
_RAISED_CHARS = 160  # an exception's text in a finding's message: its first 160 characters


def finding_message(verdict: ScenarioVerdict) -> str:
    """A failing scenario in one line: its first failure line, the text of the exception the
    implementation raised at the first failing step that raised one (shortened), and its
    second failure line."""
    lines = verdict.describe(limit=2)
    failing = [step.index for step in verdict.steps if step.failed]
    raised = next((verdict.messages[i] for i in failing if i in verdict.messages), None)
    if raised is not None:
        text = " ".join(raised.split())  # one line, whatever the exception's text holds
        if len(text) > _RAISED_CHARS:
            text = text[: _RAISED_CHARS - 3] + "..."
        index = next(i for i in failing if i in verdict.messages)
        lines.insert(min(1, len(lines)), f"step {index} raised {text}")
    return "; ".join(lines)


def merge_metrics(parts: Iterable[Mapping[str, Metrics]]) -> dict[str, Metrics]:
    """The union of shard results (a key in several shards is merged)."""
    merged: dict[str, Metrics] = {}
    for part in parts:
        for key, metrics in part.items():
            merged[key] = merged[key].merged(metrics) if key in merged else metrics
    return dict(sorted(merged.items()))
