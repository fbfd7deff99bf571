"""The check engine behind ``wacc check`` and the pytest plugin.

For each work dtype it runs every strategy family of :data:`FAMILIES` (generated scenarios,
:func:`wacc_ref.strategies.scenarios`) and the stateful machine of :mod:`wacc.judge.machine` against
an implementation, applying the chosen oracles to every scenario (:func:`wacc.judge.verdict.judge`).
The first failing scenario ends the search; :mod:`wacc.judge.shrink` shrinks it, and the engine
writes the shrunk one as ``wacc_ref`` scenario JSON, replayable with ``wacc replay``.
``hypothesis.target`` steers the search towards large error/bound ratios and ulps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import HypothesisException

from wacc.choices import FAMILY_NAMES, MACHINE, WORK_DTYPES
from wacc.judge.contract import needed_by
from wacc.judge.implementation import Implementation
from wacc.judge.machine import run_machine
from wacc.judge.profiles import profile_settings
from wacc.judge.shrink import shrink_scenario
from wacc.judge.targets import observe_metrics
from wacc.judge.verdict import ORACLES, ScenarioVerdict, judge
from wacc_ref import formats
from wacc_ref.scenario import Scenario, to_json
from wacc_ref.strategies import scenarios

__all__ = [
    "CORPUS_FAMILIES",
    "FAMILIES",
    "FAMILY_FEATURES",
    "CheckConfig",
    "CheckReport",
    "DtypeSummary",
    "Finding",
    "run_check",
    "write_finding",
    "run_family",
]

# family -> keyword arguments of wacc_ref.strategies.scenarios (besides dtype and fused)
FAMILIES: Mapping[str, Mapping[str, Any]] = {
    # unequal microbatches, zero-weight batches, overflow-prone loss scales, cancellation
    "windows": {"invalid_weights": False, "max_interruptions": 0},
    # the same with invalid weights (negative, NaN, inf): InvalidWeightError at the same step
    "invalid_weights": {"invalid_weights": True, "max_interruptions": 0},
    # checkpoints (sync and async), restores into fresh instances, corrupted restores
    "interruptions": {"invalid_weights": False},
    # NaN and ±inf gradients
    "non_finite": {"allow_nan": True, "allow_infinity": True, "max_interruptions": 1},
    # dynamic loss scaling (semantics §13): windows at the scaler's scales, overflows, skipped
    # windows, scales set mid-window or invalid, checkpoints anywhere
    "dynamic_scaling": {"dynamic": True},
    # malformed gradients (semantics §5, §11, wacc_ref.faults): a wrong shape, dtype, device,
    # layout or type, or an unknown name, refused with ParameterMismatchError at any weight with
    # nothing changed; non-contiguous, channels-last and missing gradients, accepted as the
    # dense ones.
    "structural": {"structural": True, "invalid_weights": False, "max_interruptions": 1},
}
# The families of the frozen report corpus (and so of the gate's corpus keys). dynamic_scaling
# and structural came later: their cells were appended to the frozen file, the older ones kept as
# they were drawn. structural is here so that the report judges what check and gate judge (one
# verdict for one implementation: a planted bug that accepts a malformed gradient fails all three).
CORPUS_FAMILIES: tuple[str, ...] = (
    "windows",
    "invalid_weights",
    "interruptions",
    "non_finite",
    "dynamic_scaling",
    "structural",
)
# family -> the features without which its scenarios cannot run: the family is then skipped (the
# features are reported as not judged). Declared by the contract (wacc.judge.contract).
FAMILY_FEATURES: Mapping[str, tuple[str, ...]] = {
    family: needed for family in FAMILY_NAMES if (needed := needed_by(family=family))
}
if (*FAMILIES, MACHINE) != FAMILY_NAMES or formats.WORK_DTYPES != WORK_DTYPES:
    # wacc.choices names them for a fast command line; a drift would offer the wrong choices.
    raise ImportError(
        f"wacc.choices is out of step: families {FAMILY_NAMES} vs {(*FAMILIES, MACHINE)}, work "
        f"dtypes {WORK_DTYPES} vs {formats.WORK_DTYPES}"
    )


@dataclass(frozen=True)
class CheckConfig:
    """What ``wacc check`` runs (keyword-only options, all with defaults)."""

    dtypes: tuple[str, ...] = formats.WORK_DTYPES
    device: str = "cpu"
    profile: str = "ci"
    seed: int | None = None
    oracles: tuple[str, ...] = ORACLES
    families: tuple[str, ...] = (*FAMILIES, MACHINE)
    examples: int | None = None  # per dtype and family; None: the profile's max_examples
    shrink_seconds: float = 30.0  # per failure: the time wacc.judge.shrink may take
    exit_first: bool = False  # stop at the first family (of any dtype) that finds a divergence
    example_database: bool = True  # False: none, whatever the profile (the CLI unless asked)


@dataclass(frozen=True)
class Finding:
    """A divergence: the shrunk scenario's verdict, and where its JSON was written."""

    dtype: str
    family: str
    verdict: ScenarioVerdict
    path: Path | None = None


@dataclass
class DtypeSummary:
    """Per work dtype: scenarios judged and the worst metrics seen."""

    scenarios: int = 0
    failed: int = 0
    max_ulps: float = 0.0
    max_rel_error: float = 0.0
    max_ratio: float = 0.0

    def add(self, verdict: ScenarioVerdict) -> None:
        """Count ``verdict`` and keep the worst of its metrics."""
        self.scenarios += 1
        self.failed += verdict.failed
        self.max_ulps = max(self.max_ulps, verdict.maximum("max_ulps"))
        self.max_rel_error = max(self.max_rel_error, verdict.maximum("max_rel_error"))
        self.max_ratio = max(self.max_ratio, verdict.maximum("max_ratio"))


@dataclass
class CheckReport:
    """The outcome of a whole check."""

    implementation: str
    oracles: tuple[str, ...]
    findings: list[Finding] = field(default_factory=list)
    summaries: dict[str, DtypeSummary] = field(default_factory=dict)
    unsupported: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        """No divergence (unsupported features are the caller's to judge)."""
        return not self.findings


def _settings(config: CheckConfig, examples: int) -> settings:
    base = profile_settings(config.profile)
    derandomize = base.derandomize and config.seed is None
    return settings(
        base,
        max_examples=examples,
        derandomize=derandomize,
        # Hypothesis finds; wacc.judge.shrink shrinks (a strategy draw per candidate is too slow).
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
        report_multiple_bugs=False,
        suppress_health_check=[*base.suppress_health_check, HealthCheck.filter_too_much],
        database=base.database if config.example_database else None,
    )


class _FirstFailure(BaseException):
    """Raised out of Hypothesis at the first failing verdict. The engine shrinks with
    :mod:`wacc.judge.shrink`, so nothing is left for Hypothesis to do: as an ``AssertionError`` it
    would go on to its target phase, up to ten times ``max_examples`` calls more (measured:
    100 s after a failure found in 7 s)."""


def run_family(
    implementation: Implementation,
    dtype: str,
    family: str,
    config: CheckConfig,
    *,
    on_verdict: Callable[[ScenarioVerdict], None] = lambda verdict: None,
) -> ScenarioVerdict | None:
    """Run one family on one dtype; return the shrunk failing verdict, or None."""
    examples = config.examples or profile_settings(config.profile).max_examples
    failures: list[ScenarioVerdict] = []
    device = torch.device(config.device)

    def check_verdict(verdict: ScenarioVerdict, *, observe: bool = True) -> None:
        on_verdict(verdict)
        if observe:
            observe_metrics(verdict)
        if verdict.failed:
            failures.append(verdict)
            raise _FirstFailure("\n".join(verdict.describe()))

    if family == MACHINE:
        try:
            run_machine(
                implementation,
                dtype,
                device=device,
                oracles=config.oracles,
                settings=_settings(config, max(1, examples // 4)),
                seed=config.seed,
                on_verdict=lambda verdict: check_verdict(verdict, observe=False),
            )
        except (_FirstFailure, AssertionError, HypothesisException):
            if not failures:
                raise
        return _shrunk(implementation, failures, config, device)

    if not implementation.coverage().judges_family(family):
        return None  # nothing of it can run; the missing features are reported not judged
    options = dict(FAMILIES[family])
    if not implementation.supports("records"):
        options["max_interruptions"] = 0

    @given(scenarios(work_dtypes=(dtype,), fused=implementation.fused, **options))
    def property_test(scenario: Scenario) -> None:
        check_verdict(judge(implementation, scenario, device=device, oracles=config.oracles))

    test = _settings(config, examples)(property_test)
    if config.seed is not None:
        test = seed(config.seed)(test)
    try:
        test()
    except (_FirstFailure, AssertionError, HypothesisException):
        if not failures:
            raise
    return _shrunk(implementation, failures, config, device)


def _shrunk(
    implementation: Implementation,
    failures: list[ScenarioVerdict],
    config: CheckConfig,
    device: torch.device,
) -> ScenarioVerdict | None:
    """The first failure, shrunk by :func:`wacc.judge.shrink.shrink_scenario`, judged again."""
    if not failures:
        return None
    first = failures[0]
    oracles = set(first.failed_oracles)

    def still_fails(candidate: Scenario) -> bool:
        verdict = judge(implementation, candidate, device=device, oracles=config.oracles)
        return bool(oracles & set(verdict.failed_oracles))

    smallest = shrink_scenario(first.scenario, still_fails, seconds=config.shrink_seconds)
    return judge(implementation, smallest, device=device, oracles=config.oracles)


def write_finding(finding: Finding, out: Path, number: int | None = None) -> Path:
    """Write the finding's scenario JSON under ``out`` (created) and return its path:
    ``divergence-NN-<dtype>-<family>.json``, NN from ``number`` (else the count of those in
    ``out``, plus one), moved up past every NN a file in ``out`` already has. A file is never
    overwritten (an earlier run's, or one the user put there): created exclusively."""
    out.mkdir(parents=True, exist_ok=True)
    if number is None:
        number = len(list(out.glob("divergence-*.json"))) + 1
    text = to_json(finding.verdict.scenario, indent=1) + "\n"
    while True:
        if any(out.glob(f"divergence-{number:02d}-*.json")):
            number += 1
            continue
        path = out / f"divergence-{number:02d}-{finding.dtype}-{finding.family}.json"
        try:
            with path.open("x", encoding="utf-8") as handle:
                handle.write(text)
        except FileExistsError:  # made between the look and the write: the next number
            number += 1
            continue
        return path


def run_check(
    implementation: Implementation,
    config: CheckConfig,
    *,
    out: Path | None = None,
    progress: Callable[[str, str], None] = lambda dtype, family: None,
    on_verdict: Callable[[ScenarioVerdict], None] = lambda verdict: None,
) -> CheckReport:
    """Every family on every dtype of ``config``; failing scenarios are written under ``out``."""
    started = time.perf_counter()
    report = CheckReport(implementation=implementation.spec, oracles=config.oracles)
    for dtype in config.dtypes:
        summary = report.summaries.setdefault(dtype, DtypeSummary())
        for family in config.families:
            progress(dtype, family)

            def seen(verdict: ScenarioVerdict, summary: DtypeSummary = summary) -> None:
                summary.add(verdict)
                on_verdict(verdict)

            shrunk = run_family(implementation, dtype, family, config, on_verdict=seen)
            if shrunk is not None:
                finding = Finding(dtype=dtype, family=family, verdict=shrunk)
                if out is not None:
                    finding = Finding(
                        dtype=dtype,
                        family=family,
                        verdict=shrunk,
                        path=write_finding(finding, out, len(report.findings) + 1),
                    )
                report.findings.append(finding)
                if config.exit_first:
                    report.seconds = time.perf_counter() - started
                    return report
    report.seconds = time.perf_counter() - started
    return report


def family_names() -> Sequence[str]:
    """Every family ``--family`` accepts."""
    return (*FAMILIES, MACHINE)
