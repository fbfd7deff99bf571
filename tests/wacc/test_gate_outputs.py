"""``wacc.gate.groups`` and ``wacc.gate.outputs``: failures grouped by signature, the printed
blocks, the pull-request summary's length and the JUnit times, without a run.

(Real ``wacc gate`` runs through subprocesses are ``test_gate.py``.)
"""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.wacc.ascii_locale import ascii_locale
from tests.wacc.rendered import markdown_table, section, shows_metric, text_table
from wacc.gate.compare import Comparison, compare
from wacc.gate.groups import UNREPRODUCED, group_findings
from wacc.gate.measure import GateFinding, Metrics
from wacc.gate.outputs import (
    SUMMARY_MAX_LINES,
    failure_lines,
    replay_command,
    table,
    write_junit,
    write_summary,
)

DIVISION = "[emulation] step # (finish_mean) grads[#][flat #]: expected #, got #"
RAISED = "[error] step # (accumulate) error expected None, got unexpected RuntimeError"


def finding(signature: str, number: int, replay: bool = True) -> GateFinding:
    return GateFinding(
        signature=signature,
        message=f"{signature.replace('#', str(number))} (finding {number})",
        replay=f"out/gate-{number:05d}.json" if replay else None,
    )


def test_findings_with_one_signature_are_one_group_counted_per_key_largest_first() -> None:
    """Three findings of one signature in two keys and one of another are two groups: the
    larger first, each counting its scenarios per key and keeping its first finding and every
    replay file."""
    run = {
        "bfloat16/windows/corpus": Metrics(
            scenarios=9, failing=2, findings=[finding(DIVISION, 1), finding(DIVISION, 2)]
        ),
        "float32/windows/check": Metrics(
            scenarios=5, failing=2, findings=[finding(RAISED, 3), finding(DIVISION, 4)]
        ),
        "float64/sums/corpus": Metrics(scenarios=4),
    }
    groups = group_findings(run)
    assert [g.signature for g in groups] == [DIVISION, RAISED]
    division = groups[0]
    assert division.count == 3
    assert division.keys == {"bfloat16/windows/corpus": 2, "float32/windows/check": 1}
    assert division.first_key == "bfloat16/windows/corpus" and division.first.replay is not None
    assert division.first.message.endswith("(finding 1)")
    assert division.replays == ["out/gate-00001.json", "out/gate-00002.json", "out/gate-00004.json"]
    assert groups[1].count == 1 and groups[1].keys == {"float32/windows/check": 1}


def test_a_failure_without_its_finding_is_still_a_group() -> None:
    """A key that counts more failing scenarios than it has findings (a check family's failure
    that passed when judged again) still shows as a failure group, never silently."""
    groups = group_findings({"float16/windows/check": Metrics(scenarios=3, failing=1)})
    assert len(groups) == 1 and groups[0].first is UNREPRODUCED and groups[0].count == 1


def test_each_group_prints_one_block_with_one_replay_command() -> None:
    """A group prints its count, its keys, its first finding and one replay command naming the
    implementation and how many files were written; without a file it says how to get them."""
    run = {
        "float32/windows/corpus": Metrics(
            scenarios=9, failing=2, findings=[finding(DIVISION, 1), finding(DIVISION, 2)]
        ),
        "float64/windows/corpus": Metrics(
            scenarios=9, failing=1, findings=[finding(RAISED, 3, replay=False)]
        ),
    }
    lines = failure_lines(group_findings(run), implementation="my acc.py:make")
    assert lines[0] == f"FAILURE 2 scenario(s) in 1 key(s): {DIVISION}"
    assert lines[1] == "  keys: float32/windows/corpus (2)"
    assert lines[2].startswith("  first, float32/windows/corpus: [emulation] step 1")
    assert lines[3] == (
        "  replay: wacc replay out/gate-00001.json --impl 'my acc.py:make' (2 replay files)"
    )
    assert lines[4].startswith("FAILURE 1 scenario(s) in 1 key(s): [error]")
    assert lines[7] == "  replay: no file written (wacc gate --out DIR writes them)"
    assert len(lines) == 8


def test_the_summary_fits_a_pull_request_comment_however_much_fails(tmp_path: Path) -> None:
    """Every key failing with its own signature, every corpus metric regressed or improved: the
    summary stays within SUMMARY_MAX_LINES, says how many more there are, and points to the
    artifacts; a passing run's summary is a few lines."""
    keys = [
        f"d{d}/f{f}/{source}" for d in range(4) for f in range(6) for source in ("corpus", "check")
    ]
    base = {key: Metrics(scenarios=10, max_ulps=1.0, max_ratio=0.5) for key in keys}
    run = {
        key: Metrics(
            scenarios=10,
            failing=1,
            max_ulps=2.0 if (n // 2) % 2 else 0.5,
            max_ratio=0.5,
            findings=[finding(f"[emulation] shape {n} #", n)],
        )  # fmt: skip
        for n, key in enumerate(keys)
    }
    comparison = compare(run, base)
    assert len(comparison.regressions) > 5 and len(comparison.improvements) > 5
    path = write_summary(
        comparison, tmp_path / "gate.md", implementation="x:make", seconds=12.0,
        groups=group_findings(run), artifacts=["48 replay file(s) in out", "JUnit XML gate.xml"],
    )  # fmt: skip
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= SUMMARY_MAX_LINES, text
    assert "### wacc gate FAILED: `x:make` (12 s)" in text
    assert "... and 33 more key(s)" in text and "... and 43 more (see the artifacts)" in text
    assert "Artifacts: 48 replay file(s) in out; JUnit XML gate.xml." in text
    passing = compare(base, base)
    quiet = write_summary(passing, tmp_path / "ok.md", implementation="x:make", seconds=1.0)
    lines = quiet.read_text(encoding="utf-8").splitlines()
    assert lines[0] == "### wacc gate passed: `x:make` (1 s)" and len(lines) == 3
    assert f"{len(keys)} of {len(keys)} keys as in the baseline" in lines[2]


def test_a_message_with_backticks_stays_one_code_span(tmp_path: Path) -> None:
    """A finding's message is shown as inline code even when it holds backticks (a parameter
    named with one), shortened to a few hundred characters."""
    odd = GateFinding("s", "grads['a`b'] " + "x" * 1000, "out/f.json")
    run = {"float32/windows/corpus": Metrics(scenarios=1, failing=1, findings=[odd])}
    text = write_summary(
        compare(run, {"float32/windows/corpus": Metrics(scenarios=1)}), tmp_path / "g.md",
        implementation="i", seconds=0.0, groups=group_findings(run),
    ).read_text(encoding="utf-8")  # fmt: skip
    (line,) = [line for line in text.splitlines() if "grads[" in line]
    assert "`` grads['a'b'] " in line and line.endswith("... ``") and len(line) < 400


def test_junit_cases_carry_their_measured_times(tmp_path: Path) -> None:
    """Each key's test case has the key's own measured time, not an average; a failing key's
    case fails with its failure line."""
    base = {"a/w/corpus": Metrics(scenarios=1), "b/w/check": Metrics(scenarios=1)}
    run = {
        "a/w/corpus": Metrics(scenarios=1, milliseconds=1500),
        "b/w/check": Metrics(
            scenarios=1, failing=1, findings=[finding(DIVISION, 1)], milliseconds=20
        ),  # fmt: skip
    }
    path = write_junit(compare(run, base), tmp_path / "gate.xml", implementation="i")
    cases = {case.get("name"): case for case in ET.parse(path).iter("testcase")}
    assert float(cases["a/w/corpus"].get("time")) == 1.5
    assert float(cases["b/w/check"].get("time")) == 0.02
    assert cases["a/w/corpus"].find("failure") is None
    failure = cases["b/w/check"].find("failure")
    assert failure is not None and "b/w/check: 1 failing scenario(s)" in (failure.text or "")
    assert "replay: wacc replay out/gate-00001.json --impl i" in (failure.text or "")


def test_a_group_shows_its_shortest_replayable_scenario() -> None:
    """Of a group's findings the example shown (and replayed) is the shortest one that has a
    replay file: a 28-step check scenario found first gives way to a 3-step corpus one; a
    finding without a file never replaces one with a file."""
    long = GateFinding(DIVISION, "long", "out/gate-00022.json", steps=28)
    short = GateFinding(DIVISION, "short", "out/gate-00038.json", steps=3)
    bare = GateFinding(DIVISION, "bare", None, steps=1)
    run = {
        "bfloat16/dynamic_scaling/check": Metrics(scenarios=1, failing=1, findings=[long]),
        "float64/windows/corpus": Metrics(scenarios=2, failing=2, findings=[bare, short]),
    }
    (group,) = group_findings(run)
    assert group.first is short and group.first_key == "float64/windows/corpus"
    assert group.count == 3


# Every status a key can have, with metrics of many digits that differ from column to column,
# so that a swapped column or another rounding reads as another value (issue 33).
_RUN = {
    "bfloat16/sums/corpus": Metrics(
        scenarios=12, failing=0, max_ulps=2.0, max_ratio=0.123456789, milliseconds=1234
    ),
    "float16/windows/corpus": Metrics(  # max_ratio above the baseline's: REGRESSION
        scenarios=7, failing=0, max_ulps=0.0, max_ratio=0.99999, milliseconds=5
    ),
    "float32/windows/corpus": Metrics(  # both metrics below the baseline's: improved
        scenarios=9, failing=0, max_ulps=1.5, max_ratio=1.234567e-05, milliseconds=20
    ),
    "float64/windows/check": Metrics(
        scenarios=30,
        failing=2,
        max_ulps=12345.678,
        max_ratio=math.inf,
        milliseconds=987,
        findings=[finding(DIVISION, 1), finding(RAISED, 2), finding(DIVISION, 3, replay=False)],
    ),  # fmt: skip
    "float64/mean/check": Metrics(scenarios=3, max_ulps=0.5, max_ratio=0.25, milliseconds=1),
}
_BASE = {
    "bfloat16/sums/corpus": Metrics(scenarios=12, max_ulps=2.0, max_ratio=0.123456789),
    "float16/windows/corpus": Metrics(scenarios=7, max_ulps=0.0, max_ratio=0.5),
    "float32/windows/corpus": Metrics(scenarios=9, max_ulps=3.75, max_ratio=6.54321e-4),
    "float64/windows/check": Metrics(scenarios=28, max_ulps=7.0, max_ratio=0.0),
    "float16/dynamic_scaling/corpus": Metrics(scenarios=4, max_ulps=1.0, max_ratio=0.75),
}
_NOT_JUDGED = ["found_inf: not judged (an extension the implementation lacks)"]


def _comparison() -> Comparison:
    comparison = compare(
        _RUN, _BASE, not_judged=["float16/dynamic_scaling/corpus"], new=["float64/mean/check"]
    )
    statuses = {row[3] for row in comparison.rows}
    assert statuses == {"ok", "REGRESSION", "improved", "FAIL", "new", "not judged"}
    return comparison


def _assert_row_shows(cells: dict[str, str], row: tuple[str, Metrics, Metrics, str]) -> None:
    """A rendered row of the gate's table against the comparison row it renders, column by
    column name: the key, the run's counts, each metric ``now (baseline)``, the status."""
    key, now, base, status = row
    assert cells["dtype/family/source"] == key
    assert cells["scenarios"] == str(now.scenarios)
    assert cells["failing"] == str(now.failing)
    for column, metric in (("max ulps (baseline)", "max_ulps"),
                           ("max err/bound (baseline)", "max_ratio")):  # fmt: skip
        shown = re.fullmatch(r"(\S+) \((\S+)\)", cells[column])
        assert shown is not None, cells[column]
        assert shows_metric(shown[1], getattr(now, metric)), (column, cells[column], now)
        assert shows_metric(shown[2], getattr(base, metric)), (column, cells[column], base)
    assert cells["status"] == status


def test_the_printed_table_shows_every_key_as_compared() -> None:
    """The gate's terminal table, read back by column name, has one row per compared key in the
    comparison's order, each cell the value the comparison holds (metrics to 4 significant
    digits, the baseline's in parentheses)."""
    comparison = _comparison()
    rows = text_table(table(comparison))
    assert len(rows) == len(comparison.rows)
    for cells, row in zip(rows, comparison.rows, strict=True):
        _assert_row_shows(cells, row)


def test_the_summary_table_shows_every_key_that_is_not_ok(tmp_path: Path) -> None:
    """gate.md's table, read back by column name, has exactly the keys whose status is not
    ``ok``, in order, each cell the value the comparison holds; its headline counts agree."""
    comparison = _comparison()
    text = write_summary(
        comparison, tmp_path / "gate.md", implementation="x:make", seconds=3.0,
        groups=group_findings(_RUN), not_judged=_NOT_JUDGED,
    ).read_text(encoding="utf-8")  # fmt: skip
    rows = markdown_table(text)
    notable = [row for row in comparison.rows if row[3] != "ok"]
    assert len(rows) == len(notable) == 5
    for cells, row in zip(rows, notable, strict=True):
        _assert_row_shows(cells, row)
    ok = len(comparison.rows) - len(notable)
    assert (
        f"3 failing scenario(s) in 2 distinct failure(s), {len(comparison.regressions)} "
        f"regression(s), {len(comparison.improvements)} improvement(s); {ok} of "
        f"{len(comparison.rows)} keys as in the baseline." in text
    )
    assert f"- {_NOT_JUDGED[0]}" in section(text, "**Not judged**")


def test_the_junit_xml_has_one_case_per_key_with_its_outcome(tmp_path: Path) -> None:
    """The JUnit XML, read back, has a case ``features`` and one per compared key: its time the
    key's measured milliseconds, failed (typed by the status) for FAIL and REGRESSION with the
    comparison's lines for that key, skipped with why for a key not judged, passed otherwise."""
    comparison = _comparison()
    path = write_junit(
        comparison, tmp_path / "gate.xml", implementation="x:make", not_judged=_NOT_JUDGED
    )
    cases = list(ET.parse(path).iter("testcase"))
    assert [case.get("name") for case in cases] == ["features"] + [r[0] for r in comparison.rows]
    assert all(case.get("classname") == "wacc.gate" for case in cases)
    assert list(cases[0]) == []
    for case, (key, now, _, status) in zip(cases[1:], comparison.rows, strict=True):
        assert float(case.get("time", "nan")) == now.milliseconds / 1000, key
        results = list(case)
        lines = [
            line
            for line in comparison.failures + comparison.regressions
            if line.startswith(f"{key}:")
        ]
        if status in ("FAIL", "REGRESSION"):
            (failure,) = results
            assert failure.tag == "failure" and failure.get("type") == status
            assert failure.get("message") == lines[0][:200]
            replays = [
                f"replay: {replay_command(f.replay, 'x:make')}"
                for f in now.findings[:3]
                if f.replay is not None
            ]
            assert (failure.text or "").splitlines() == lines + replays
        elif status == "not judged":
            (skipped,) = results
            assert skipped.tag == "skipped" and skipped.get("message") == _NOT_JUDGED[0]
            assert (skipped.text or "") == "\n".join(_NOT_JUDGED)
        else:
            assert results == [] and lines == [], key


def test_a_lost_feature_fails_the_features_case(tmp_path: Path) -> None:
    """A feature lost since the baseline fails the JUnit case ``features`` as a REGRESSION with
    every lost line, and heads gate.md's regressions."""
    lost = ["lost found_inf: the baseline was made with it", "lost loss_scaler: likewise"]
    comparison = compare(_RUN, _BASE, not_judged=["float16/dynamic_scaling/corpus"],
                         new=["float64/mean/check"], lost=lost)  # fmt: skip
    path = write_junit(comparison, tmp_path / "gate.xml", implementation="x:make")
    case = next(c for c in ET.parse(path).iter("testcase") if c.get("name") == "features")
    (failure,) = list(case)
    assert failure.get("type") == "REGRESSION" and failure.get("message") == lost[0]
    assert (failure.text or "").splitlines() == lost
    text = write_summary(
        comparison, tmp_path / "gate.md", implementation="x:make", seconds=0.0
    ).read_text(encoding="utf-8")
    listed = [line for line in section(text, "**Regressions**").splitlines() if line]
    assert listed[:2] == [f"- {line}" for line in lost]


def test_a_feature_not_judged_is_a_row_and_a_skipped_case_of_its_own(tmp_path: Path) -> None:
    """Each feature the run did not judge is a table row ``feature: <name>`` with status ``not
    judged`` and a skipped JUnit case whose text is that feature's own line (not every
    feature's); gate.md counts only the keys as keys."""
    lines = [("set_loss_scale", "not judged: set_loss_scale (the dynamic loss scaling ext.)"),
             ("loss_scaler", "not judged: loss_scaler (likewise)")]  # fmt: skip
    comparison = compare(_RUN, _BASE, not_judged=["float16/dynamic_scaling/corpus"],
                         new=["float64/mean/check"], features_not_judged=lines)  # fmt: skip
    features = [row for row in comparison.rows if row[0].startswith("feature: ")]
    assert [(row[0], row[3]) for row in features] == [
        ("feature: set_loss_scale", "not judged"), ("feature: loss_scaler", "not judged"),
    ]  # fmt: skip
    assert comparison.features_not_judged == {f"feature: {n}": line for n, line in lines}
    path = write_junit(comparison, tmp_path / "gate.xml", implementation="x:make",
                       not_judged=["every feature's line"])  # fmt: skip
    cases = {c.get("name"): list(c) for c in ET.parse(path).iter("testcase")}
    for name, line in lines:
        (skipped,) = cases[f"feature: {name}"]
        assert skipped.tag == "skipped" and skipped.get("message") == line
        assert skipped.text == line
    text = write_summary(
        comparison, tmp_path / "gate.md", implementation="x:make", seconds=0.0
    ).read_text(encoding="utf-8")
    keys = len(comparison.rows) - len(lines)
    assert f"of {keys} keys as in the baseline." in text


def test_a_missing_core_feature_fails_the_features_case_as_unsupported(tmp_path: Path) -> None:
    """A missing core feature that stopped the run fails the JUnit case ``features`` with type
    ``unsupported`` (not REGRESSION) and every line, and is gate.md's ``Not run`` block."""
    unsupported = ["unsupported: checksum: no probe record could be checked (RuntimeError: x)"]
    comparison = compare({}, {})
    comparison.unsupported.extend(unsupported)
    assert not comparison.passed
    path = write_junit(comparison, tmp_path / "gate.xml", implementation="x:make")
    case = next(c for c in ET.parse(path).iter("testcase") if c.get("name") == "features")
    (failure,) = list(case)
    assert failure.get("type") == "unsupported" and failure.get("message") == unsupported[0]
    text = write_summary(
        comparison, tmp_path / "gate.md", implementation="x:make", seconds=0.0
    ).read_text(encoding="utf-8")
    assert text.startswith("### wacc gate FAILED: `x:make`")
    assert section(text, "**Not run**").strip().splitlines() == [f"- {unsupported[0]}"]


def test_the_summary_is_blocks_a_reader_can_scan(tmp_path: Path) -> None:
    """gate.md is its title, the counts, the table, the failures (each with its replay command
    naming the implementation), the regressions, improvements, what was not judged and the
    artifacts: blocks separated by one blank line, each heading where a reader looks for it; it
    is written where asked, folders made, as UTF-8."""
    comparison = _comparison()
    path = write_summary(
        comparison, tmp_path / "new" / "folder" / "gate.md", implementation="x:make",
        seconds=3.0, groups=group_findings(_RUN), not_judged=_NOT_JUDGED,
        artifacts=["2 replay file(s) in out", "JUnit XML gate.xml ✓"],
    )  # fmt: skip
    text = path.read_bytes().decode("utf-8")
    assert text.endswith(".\n") and "\n\n\n" not in text
    blocks = [block.splitlines() for block in text.removesuffix("\n").split("\n\n")]
    assert [block[0] for block in blocks] == [
        "### wacc gate FAILED: `x:make` (3 s)",
        "3 failing scenario(s) in 2 distinct failure(s), 1 regression(s), 2 improvement(s); "
        "1 of 6 keys as in the baseline.",
        "| dtype/family/source | scenarios | failing | max ulps (baseline) | "
        "max err/bound (baseline) | status |",
        "**Failures** (2 distinct, largest first)",
        "- 2 scenario(s) in 1 key(s), first float64/windows/check: `` [emulation] step 1 "
        "(finish_mean) grads[1][flat 1]: expected 1, got 1 (finding 1) ``",
        "**Regressions**",
        "- float16/windows/corpus: max_ratio 0.99999 > baseline 0.5",
        "**Improvements**",
        "- float32/windows/corpus: max_ulps 1.5 < baseline 3.75",
        "**Not judged**",
        f"- {_NOT_JUDGED[0]}",
        "Artifacts: 2 replay file(s) in out; JUnit XML gate.xml ✓.",
    ]
    failures = blocks[4]
    assert failures[1] == "  replay: `wacc replay out/gate-00001.json --impl x:make`"
    assert failures[2].startswith("- 1 scenario(s) in 1 key(s), first float64/windows/check: ")
    assert failures[3] == "  replay: `wacc replay out/gate-00002.json --impl x:make`"
    assert len(failures) == 4


def _many(count: int, prefix: str) -> list[str]:
    return [f"{prefix} {n}" for n in range(count)]


@pytest.mark.parametrize("count", [5, 6, 8])
def test_the_summary_lists_five_items_then_how_many_more(tmp_path: Path, count: int) -> None:
    """At most five failure groups, regressions, improvements or not-judged lines are listed,
    then ``... and N more``: none for exactly five, the exact remainder beyond."""
    run = {
        f"float32/f{n}/check": Metrics(scenarios=1, failing=1, findings=[finding(f"s{n} #", n)])
        for n in range(count)
    }
    comparison = compare(run, {}, new=list(run))
    comparison.regressions = _many(count, "regression")
    comparison.improvements = _many(count, "improvement")
    text = write_summary(
        comparison, tmp_path / "gate.md", implementation="i", seconds=0.0,
        groups=group_findings(run), not_judged=_many(count, "not judged"),
    ).read_text(encoding="utf-8")  # fmt: skip
    more = count - 5
    tail = [f"- ... and {more} more (see the artifacts)"] if more > 0 else []
    for title, prefix in (("**Regressions**", "regression"), ("**Improvements**", "improvement"),
                          ("**Not judged**", "not judged")):  # fmt: skip
        listed = [line for line in section(text, title).splitlines() if line]
        assert listed == [f"- {line}" for line in _many(min(count, 5), prefix)] + tail, title
    groups = [line for line in text.splitlines() if line.startswith("- 1 scenario(s)")]
    assert len(groups) == min(count, 5)
    assert (f"- ... and {more} more (see the artifacts)" in text) is (more > 0)


@pytest.mark.parametrize("count", [15, 16, 18])
def test_the_summary_table_shows_fifteen_keys_then_how_many_more(
    tmp_path: Path, count: int
) -> None:
    """The summary's table has at most fifteen keys that are not ok, then a row saying how
    many more, as wide as the table: none for exactly fifteen."""
    run = {f"float32/f{n:02d}/check": Metrics(scenarios=1) for n in range(count)}
    text = write_summary(
        compare(run, {}, new=list(run)), tmp_path / "gate.md", implementation="i", seconds=0.0
    ).read_text(encoding="utf-8")
    rows = markdown_table(text)
    shown = [row for row in rows if row["status"] == "new"]
    assert len(shown) == min(count, 15)
    rest = [row for row in rows if row["status"] != "new"]
    if count > 15:
        assert rest == [
            {"dtype/family/source": f"... and {count - 15} more key(s)", "scenarios": "",
             "failing": "", "max ulps (baseline)": "", "max err/bound (baseline)": "",
             "status": ""}
        ]  # fmt: skip
    else:
        assert rest == []


@pytest.mark.parametrize(("length", "shown"), [(300, 300), (301, 300)])
def test_a_long_message_is_cut_to_three_hundred_characters(
    tmp_path: Path, length: int, shown: int
) -> None:
    """A finding's message of up to 300 characters is shown whole in the summary; a longer one
    is cut to 297 characters and ``...``."""
    message = "m" * length
    run = {"float32/w/check": Metrics(scenarios=1, failing=1, findings=[GateFinding("s", message)])}
    text = write_summary(
        compare(run, {}, new=list(run)), tmp_path / "gate.md", implementation="i", seconds=0.0,
        groups=group_findings(run),
    ).read_text(encoding="utf-8")  # fmt: skip
    expected = message if length <= 300 else "m" * 297 + "..."
    assert f"`` {expected} ``" in text and len(expected) == shown


def test_a_group_in_many_keys_lists_six_then_how_many_more() -> None:
    """A failure group's keys are listed, comma-separated, up to six with their counts, then
    ``and N more key(s)``; a group with one replay file does not count its files."""
    run = {
        f"float32/f{n}/check": Metrics(scenarios=1, failing=1, findings=[finding(DIVISION, n)])
        for n in range(8)
    }
    lines = failure_lines(group_findings(run), implementation="i")
    shown = ", ".join(f"float32/f{n}/check (1)" for n in range(6))
    assert lines[1] == f"  keys: {shown} and 2 more key(s)"
    six = failure_lines(group_findings(dict(list(run.items())[:6])), implementation="i")
    assert six[1] == f"  keys: {shown}"
    seven = failure_lines(group_findings(dict(list(run.items())[:7])), implementation="i")
    assert seven[1] == f"  keys: {shown} and 1 more key(s)"
    one = failure_lines(group_findings(dict(list(run.items())[:1])), implementation="i")
    assert one[3] == "  replay: wacc replay out/gate-00000.json --impl i"


def test_junit_messages_are_cut_at_two_hundred_characters_and_name_everything(
    tmp_path: Path,
) -> None:
    """The JUnit XML: a suite named after the implementation; the ``features`` case timed 0;
    a failure's and a skip's message the first 200 characters (the skip's: every not-judged
    line joined by ``; ``, ``not judged`` when none is given), their text every line; at most
    three replay commands a key; indented, one element a line, written where asked."""
    long_lost = "lost " + "x" * 300
    run = {
        "float32/w/check": Metrics(
            scenarios=4, failing=4, findings=[finding(DIVISION, n) for n in range(4)]
        ),
    }
    base = {"float32/w/check": Metrics(scenarios=4), "float16/w/corpus": Metrics(scenarios=1)}
    comparison = compare(run, base, not_judged=["float16/w/corpus"], lost=[long_lost, "lost y"])
    comparison.failures = ["float32/w/check: " + "f" * 300]
    reasons = ["why " + "w" * 150, "and why " + "v" * 100]
    path = write_junit(
        comparison, tmp_path / "a" / "b" / "gate.xml", implementation="x:make",
        not_judged=reasons,
    )  # fmt: skip
    root = ET.parse(path).getroot()
    (suite,) = list(root.iter("testsuite"))
    assert suite.get("name") == "wacc gate x:make"
    cases = {case.get("name"): case for case in suite.iter("testcase")}
    assert float(cases["features"].get("time", "nan")) == 0.0
    (lost,) = list(cases["features"])
    assert lost.get("message") == long_lost[:200] and lost.text == f"{long_lost}\nlost y"
    (failure,) = list(cases["float32/w/check"])
    assert failure.get("message") == comparison.failures[0][:200]
    replays = [line for line in (failure.text or "").splitlines() if line.startswith("replay:")]
    assert replays == [f"replay: wacc replay out/gate-{n:05d}.json --impl x:make" for n in range(3)]
    (skipped,) = list(cases["float16/w/corpus"])
    assert skipped.get("message") == "; ".join(reasons)[:200]
    assert skipped.text == "\n".join(reasons)
    starts = [line.lstrip()[:9] for line in path.read_text(encoding="utf-8").splitlines()]
    assert starts.count("<testcase") == len(cases)  # one element a line: a readable file
    bare = write_junit(comparison, tmp_path / "bare.xml", implementation="x:make")
    skip = next(c for c in ET.parse(bare).iter("testcase") if c.get("name") == "float16/w/corpus")
    assert [(s.tag, s.get("message")) for s in skip] == [("skipped", "not judged")]


def test_gate_md_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    """gate.md is written as UTF-8 even where the locale's encoding is ASCII."""
    with ascii_locale():
        path = write_summary(_comparison(), tmp_path / "gate.md", implementation="mïne:make",
                             seconds=1.0)  # fmt: skip
    assert "`mïne:make`" in path.read_text(encoding="utf-8")
