"""``wacc.gate.groups`` and ``wacc.gate.outputs``: failures grouped by signature, the printed
blocks, the pull-request summary's length and the JUnit times, without a run.

(Real ``wacc gate`` runs through subprocesses are ``test_gate.py``.)
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from wacc.gate.compare import compare
from wacc.gate.groups import UNREPRODUCED, group_findings
from wacc.gate.measure import GateFinding, Metrics
from wacc.gate.outputs import SUMMARY_MAX_LINES, failure_lines, write_junit, write_summary

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
