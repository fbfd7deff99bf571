"""The gate's verdict: hard failures, regressions beyond the headroom, improvements.

What is gated: the frozen corpus (``<dtype>/<family>/corpus`` keys) is the same scenarios on every
machine, so its metrics are compared with the baseline. The ``ci``-profile check
(``<dtype>/<family>/check`` keys) is derandomized, but Hypothesis also draws constants it
collects from the loaded source files, so its examples change with any code change: it
contributes hard failures only (its metrics are shown, never compared, and its counts may differ).

Headroom (the one place it is derived): a corpus metric is a deterministic function of results
that the semantics fix bit for bit (the reproducible order is identical on every CPU), computed
once more from those bits: ``max_ulps`` is an exact count of spacings (``|a - e| / ulp`` of
floats that differ by a multiple of a power of two: exact), so its headroom is 0; ``max_ratio``
is an exact rational rounded *up* once to a float64 (:func:`wacc_ref.bounds.error_ratio`), so a
recomputation can differ by at most that one rounding: its headroom is one float64 ulp. A metric
beyond ``baseline + headroom`` is a regression; below the baseline, an improvement. A fused mode
is not fixed bit for bit across CPUs (§6 allows three results per element), so a baseline
recorded on one CPU may not transfer; record one per runner type to gate a fused implementation.

Hard failures: any oracle violation (a failing scenario in any key). A feature the baseline was
made with and the implementation lacks now (:mod:`wacc.judge.contract`) is a regression (``lost``),
extension or core: what the implementation promised is gone, and its keys are no longer judged.

Keys only in the baseline that the run did not judge (``not_judged``: their family needs a
feature the implementation lacks) are rows ``not judged``, and so is every feature the run did
not judge (``features_not_judged``: a row ``feature: <name>`` whatever the baseline holds, so
that a baseline recorded without the feature still shows it); keys only in the run that the
baseline could not have judged (``new``: it was made without a feature their family needs) are
judged for hard failures, their metrics compared with nothing until the baseline is recorded
anew. Any other key only in the baseline or only in the run, or a corpus key with another
scenario count, means the baseline is foreign to this run (another corpus or version): exit 2.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from wacc.errors import UsageError
from wacc.gate.measure import Metrics
from wacc_ref.strict_json import item, shown

__all__ = ["RATIO_HEADROOM_ULPS", "ULPS_HEADROOM", "Comparison", "compare", "headroom"]

ULPS_HEADROOM = 0.0  # spacings: an exact count
RATIO_HEADROOM_ULPS = 1  # float64 ulps: the one rounding up of an exact rational


def headroom(metric: str, baseline: float) -> float:
    """The largest value of ``metric`` that is not a regression against ``baseline``."""
    if metric == "max_ulps":
        return baseline + ULPS_HEADROOM
    limit = baseline
    for _ in range(RATIO_HEADROOM_ULPS):
        limit = math.nextafter(limit, math.inf)
    return limit


@dataclass
class Comparison:
    """The outcome per key and overall."""

    failures: list[str] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    improvements: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # features the baseline had, gone now
    unsupported: list[str] = field(default_factory=list)  # missing core features: nothing ran
    # the row key of each feature not judged -> its line, ``not judged: <feature> (why)...``
    features_not_judged: dict[str, str] = field(default_factory=dict)
    rows: list[tuple[str, Metrics, Metrics, str]] = field(
        default_factory=list
    )  # key, now, base, status

    @property
    def passed(self) -> bool:
        """No hard failure, no regression, no lost and no unsupported feature."""
        return not (self.failures or self.regressions or self.lost or self.unsupported)


def compare(
    run: Mapping[str, Metrics],
    baseline: Mapping[str, Metrics],
    *,
    not_judged: Collection[str] = (),
    new: Collection[str] = (),
    lost: Sequence[str] = (),
    features_not_judged: Sequence[tuple[str, str]] = (),
) -> Comparison:
    """Judge ``run`` against ``baseline`` (see the module docstring): ``not_judged`` the keys
    the run could not judge, ``new`` those the baseline could not have, ``lost`` one line per
    feature lost since the baseline, ``features_not_judged`` each feature the run did not judge
    with its ``not judged: ...`` line (a row ``feature: <name>`` each)."""
    # The UsageErrors name the baseline's field; the command puts the file's name in front.
    missing = sorted(baseline.keys() - run.keys() - set(not_judged))
    extra = sorted(run.keys() - baseline.keys() - set(new))
    if missing or extra:
        raise UsageError(
            f"entries: do not fit this run: keys only in the baseline {shown(missing[:3])}, only "
            f"in the run {shown(extra[:3])} (update it with `wacc gate --update-baseline`)"
        )
    result = Comparison(lost=list(lost))
    for name, line in features_not_judged:
        result.features_not_judged[f"feature: {name}"] = line
        result.rows.append((f"feature: {name}", Metrics(), Metrics(), "not judged"))
    for key in sorted(run.keys() | baseline.keys()):
        if key not in run:  # not judged: shown, never compared
            result.rows.append((key, Metrics(), baseline[key], "not judged"))
            continue
        now, base = run[key], baseline.get(key, Metrics())
        gated = key.endswith("/corpus") and key in baseline
        if gated and now.scenarios != base.scenarios:
            raise UsageError(
                f"{item('entries', key)}.scenarios: does not fit this run: {now.scenarios} "
                f"scenarios judged, {shown(base.scenarios)} in the baseline (another corpus or "
                "version)"
            )
        status = "ok"
        if now.failing:
            status = "FAIL"
            result.failures.append(
                f"{key}: {now.failing} failing scenario(s): "
                + " | ".join(finding.message for finding in now.findings[:3])
            )
        for metric in ("max_ulps", "max_ratio") if gated else ():
            value, reference = getattr(now, metric), getattr(base, metric)
            if value > headroom(metric, reference):
                result.regressions.append(f"{key}: {metric} {value!r} > baseline {reference!r}")
                status = "FAIL" if status == "FAIL" else "REGRESSION"
            elif value < reference:
                result.improvements.append(f"{key}: {metric} {value!r} < baseline {reference!r}")
                status = "improved" if status == "ok" else status
        if key not in baseline and status == "ok":
            status = "new"  # judged, its metrics compared with nothing yet
        result.rows.append((key, now, base, status))
    return result
