"""``wacc.gate.compare`` and the gate's shards: the verdict rules, exactly, without a run.

(Real ``wacc gate`` runs through subprocesses are ``test_gate.py``.)
"""

from __future__ import annotations

import math

import pytest

from wacc.errors import UsageError
from wacc.gate.compare import ULPS_HEADROOM, compare, headroom
from wacc.gate.measure import GateFinding, Metrics, Shard, merge_metrics


def test_headroom_is_exact_for_ulps_and_one_rounding_for_ratios() -> None:
    """ulps allow nothing above the baseline; a ratio allows exactly one float64 step up."""
    assert headroom("max_ulps", 3.0) == 3.0 + ULPS_HEADROOM == 3.0
    assert headroom("max_ratio", 0.5) == 0.5 + 2.0**-53
    assert headroom("max_ratio", float("inf")) == float("inf")


def test_compare_separates_failures_regressions_and_improvements() -> None:
    """A failing key is a failure, a worse corpus metric a regression, a better one an
    improvement; a check key's metrics and counts are shown, never compared."""
    keys = ("a/w/corpus", "b/w/corpus", "c/w/corpus", "d/w/corpus", "e/w/check")
    base = {k: Metrics(scenarios=10, max_ulps=0.0, max_ratio=0.5) for k in keys}
    run = {
        "a/w/corpus": Metrics(scenarios=10, max_ulps=0.0, max_ratio=0.5),
        "b/w/corpus": Metrics(
            scenarios=10, failing=1, max_ratio=7.0, findings=[GateFinding("#", "step 1: boom")]
        ),
        "c/w/corpus": Metrics(scenarios=10, max_ulps=0.0, max_ratio=0.5 + 2.0**-40),
        "d/w/corpus": Metrics(scenarios=10, max_ulps=0.0, max_ratio=0.25),
        "e/w/check": Metrics(scenarios=37, max_ulps=5.0, max_ratio=0.9),
    }
    result = compare(run, base)
    assert [row[3] for row in result.rows] == ["ok", "FAIL", "REGRESSION", "improved", "ok"]
    assert len(result.failures) == 1 and "boom" in result.failures[0]
    assert len(result.regressions) == 2 and not result.passed  # b's ratio, c's ratio


def test_shards_partition_the_units_and_merging_is_order_free() -> None:
    """Shards K/N take disjoint slices covering all units; merging sums counts, keeps maxima."""
    shards = [Shard(k, 3) for k in (1, 2, 3)]
    assert all(sum(s.takes(i) for s in shards) == 1 for i in range(50))
    boom = GateFinding("#", "boom", "gate-00001-k.json")
    parts = [
        {"k": Metrics(scenarios=2, max_ratio=0.1, milliseconds=7)},
        {"k": Metrics(scenarios=3, failing=1, max_ulps=4.0, findings=[boom], milliseconds=5)},
    ]
    merged = merge_metrics(parts)["k"]
    assert (merged.scenarios, merged.failing, merged.max_ulps, merged.max_ratio) == (5, 1, 4.0, 0.1)
    assert (merged.findings, merged.milliseconds) == ([boom], 12)
    assert merge_metrics(parts[::-1])["k"] == merged
    with pytest.raises(ValueError, match="'3/2'"):
        Shard.parse("3/2")


def test_a_baseline_with_keys_the_run_lacks_or_adds_is_foreign_exit_2_naming_them() -> None:
    """Keys only in the baseline, or only in the run, each alone make the baseline foreign; the
    message names the first three of each and how to update it."""
    one = {"a/w/corpus": Metrics(scenarios=1)}
    two = {"a/w/corpus": Metrics(scenarios=1), "b/w/corpus": Metrics(scenarios=1)}
    with pytest.raises(UsageError) as missing:
        compare(one, two)
    assert str(missing.value) == (
        "entries: do not fit this run: keys only in the baseline ['b/w/corpus'], only in the "
        "run [] (update it with `wacc gate --update-baseline`)"
    )
    many = {f"{k}/w/corpus": Metrics(scenarios=1) for k in "cdefg"}
    with pytest.raises(UsageError) as extra:
        compare({**one, **many}, one)
    shown_three = "['c/w/corpus', 'd/w/corpus', 'e/w/corpus']"
    assert f"only in the baseline [], only in the run {shown_three}" in str(extra.value)
    with pytest.raises(UsageError) as missing_many:
        compare(one, {**one, **many})
    assert f"only in the baseline {shown_three}, only in the run []" in str(missing_many.value)


def test_a_corpus_key_with_another_scenario_count_is_foreign_naming_the_field() -> None:
    """The corpus keys' counts must agree (a check key's may differ): exit 2, the field named."""
    with pytest.raises(UsageError) as info:
        compare({"a/w/corpus": Metrics(scenarios=3)}, {"a/w/corpus": Metrics(scenarios=4)})
    assert str(info.value) == (
        "entries['a/w/corpus'].scenarios: does not fit this run: 3 scenarios judged, 4 in the "
        "baseline (another corpus or version)"
    )
    assert compare({"a/w/check": Metrics(scenarios=3)}, {"a/w/check": Metrics(scenarios=4)}).passed


def test_each_finding_regression_and_improvement_is_stated_exactly() -> None:
    """A failure lists the first three findings' messages joined by ' | '; a regression and an
    improvement name the key, the metric, the value and the baseline."""
    base = {
        "a/w/corpus": Metrics(scenarios=2, max_ulps=1.0, max_ratio=0.5),
        "b/w/corpus": Metrics(scenarios=2, max_ulps=1.0, max_ratio=0.5),
    }
    run = {
        "a/w/corpus": Metrics(scenarios=2, failing=2, max_ulps=1.0, max_ratio=0.5,
                              findings=[GateFinding("s", m) for m in "xyzw"]),
        "b/w/corpus": Metrics(scenarios=2, max_ulps=2.0, max_ratio=0.25),
    }  # fmt: skip
    result = compare(run, base)
    assert result.failures == ["a/w/corpus: 2 failing scenario(s): x | y | z"]
    assert result.regressions == ["b/w/corpus: max_ulps 2.0 > baseline 1.0"]
    assert result.improvements == ["b/w/corpus: max_ratio 0.25 < baseline 0.5"]
    # a regression and an improvement in one key: the key regressed
    assert [row[3] for row in result.rows] == ["FAIL", "REGRESSION"]


def test_an_improvement_never_hides_a_failure_or_a_regression() -> None:
    """Status precedence: FAIL over REGRESSION over improved over ok, whatever the metric order."""
    base = {"a/w/corpus": Metrics(scenarios=1, max_ulps=4.0, max_ratio=0.5)}
    failing = {"a/w/corpus": Metrics(scenarios=1, failing=1, max_ulps=1.0, max_ratio=0.25)}
    assert compare(failing, base).rows[0][3] == "FAIL"
    worse_ratio = {"a/w/corpus": Metrics(scenarios=1, max_ulps=1.0, max_ratio=0.75)}
    assert compare(worse_ratio, base).rows[0][3] == "REGRESSION"
    failing_and_worse = {"a/w/corpus": Metrics(scenarios=1, failing=1, max_ulps=5.0)}
    assert compare(failing_and_worse, base).rows[0][3] == "FAIL"


def test_max_ulps_has_no_headroom_in_a_comparison() -> None:
    """Any max_ulps above the baseline, by however little, is a regression (ulps: exact)."""
    base = {"a/w/corpus": Metrics(scenarios=1, max_ulps=3.0)}
    above = {"a/w/corpus": Metrics(scenarios=1, max_ulps=math.nextafter(3.0, 4.0))}
    assert len(compare(above, base).regressions) == 1
    ratio_base = {"a/w/corpus": Metrics(scenarios=1, max_ratio=0.5)}
    one_ulp = {"a/w/corpus": Metrics(scenarios=1, max_ratio=math.nextafter(0.5, 1.0))}
    assert compare(one_ulp, ratio_base).passed  # a ratio has its one rounding of headroom


@pytest.mark.parametrize(
    "text",
    ["3/2", "x" * 500, "\u0661/\u0662", "+1/2", "1/" + "9" * 80],
    ids=["k-above-n", "long-text", "arabic-indic-digits", "plus-sign", "long-count"],
)
def test_a_shard_is_shown_like_every_other_field(text: str) -> None:
    """The shard parser, kept free of the reference for a fast command line, shows a bad value
    exactly as wacc_ref.strict_json does for every other field."""
    from wacc.gate import shards
    from wacc_ref.strict_json import SHOWN_CHARS, shown

    assert shards._SHOWN_CHARS == SHOWN_CHARS
    assert shards.shown(text) == shown(text)
    with pytest.raises(ValueError) as raised:
        Shard.parse(text)
    assert shown(text) in str(raised.value)
