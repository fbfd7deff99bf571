"""mutation.report: scores, stale verdicts, targets and the docs' score table."""

from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from mutation.outcomes import Outcome
from mutation.report import (
    HEADLINE_BEGIN,
    HEADLINE_END,
    headline,
    judge,
    markdown,
    percent,
    replace_headline,
    write_csv,
)
from mutation.scope import GROUPS, ROOT, group_of
from mutation.triage import Verdict


def _outcome(name: str, path: str, status: str, change: str = "a => b") -> Outcome:
    return Outcome(name, path, "f", status, change)


def _all_groups_killed() -> list[Outcome]:
    """One killed mutant in every group's first file (every group has a score)."""
    files = {
        "wacc_torch": "wacc_torch/_window.py",
        **{group.name: group.name for group in GROUPS if group.name != "wacc_torch"},
    }
    return [_outcome(f"{name}.x_k__mutmut_1", files[name], "killed") for name in files]


def test_percent_rounds_down_to_a_tenth() -> None:
    """A score is never stated higher than measured: 2/3 is 66.6 %, 19/20 is 95.0 %."""
    assert percent(Fraction(2, 3)) == "66.6 %"
    assert percent(Fraction(19, 20)) == "95.0 %"
    assert percent(Fraction(1)) == "100.0 %"
    assert percent(None) == "n/a"


def test_every_mutated_module_belongs_to_exactly_the_group_the_issue_names() -> None:
    """wacc_torch is one group; each reference and judge module is its own."""
    assert group_of("wacc_torch/zero_copy.py").name == "wacc_torch"
    assert group_of("wacc_ref/bounds.py").name == "wacc_ref/bounds.py"
    assert group_of("wacc/gate/compare.py").target == Fraction(9, 10)
    assert group_of("wacc_torch/_window.py").target == Fraction(95, 100)


def test_equivalent_survivors_leave_the_denominator_accepted_ones_do_not() -> None:
    """Score = detected / (generated - equivalent); an accepted survivor still counts."""
    path = "wacc_ref/bounds.py"
    outcomes = _all_groups_killed() + [
        _outcome("b.x_f__mutmut_1", path, "killed"),
        _outcome("b.x_f__mutmut_2", path, "timeout"),
        _outcome("b.x_f__mutmut_3", path, "survived"),
        _outcome("b.x_f__mutmut_4", path, "no tests"),
    ]
    verdicts = {
        "b.x_f__mutmut_3": Verdict("b.x_f__mutmut_3", "a => b", "equivalent", "same value"),
        "b.x_f__mutmut_4": Verdict("b.x_f__mutmut_4", "a => b", "accepted", "cli only"),
    }
    findings = judge(outcomes, verdicts)
    tally = findings.modules[path]
    assert (tally.generated, tally.killed, tally.timeout) == (5, 2, 1)
    assert (tally.survived, tally.no_tests, tally.equivalent, tally.accepted) == (1, 1, 1, 1)
    assert tally.score == Fraction(3, 4)  # (2 killed + 1 timeout) / (5 - 1 equivalent)
    assert findings.gaps == []
    assert any("wacc_ref/bounds.py: score 75.0 %" in p for p in findings.problems)


def test_an_untriaged_survivor_is_a_gap_and_a_problem() -> None:
    """A survivor with no verdict fails the report, named with its change."""
    outcomes = _all_groups_killed() + [
        _outcome("w.x_f__mutmut_9", "wacc/judge/shrink.py", "survived", "x < 1 => x <= 1")
    ]
    findings = judge(outcomes, {})
    assert [o.name for o in findings.gaps] == ["w.x_f__mutmut_9"]
    assert any(
        "untriaged survivor w.x_f__mutmut_9" in p and "x <= 1" in p for p in findings.problems
    )


def test_a_verdict_written_for_another_change_is_stale_and_not_applied() -> None:
    """mutmut renumbers mutants when a function changes: the verdict must match the change."""
    outcomes = _all_groups_killed() + [
        _outcome("w.x_f__mutmut_9", "wacc/judge/shrink.py", "survived", "x < 1 => x <= 1")
    ]
    verdicts = {"w.x_f__mutmut_9": Verdict("w.x_f__mutmut_9", "y = 2 => y = 3", "equivalent", "r")}
    findings = judge(outcomes, verdicts)
    assert [o.name for o in findings.gaps] == ["w.x_f__mutmut_9"]
    assert findings.modules["wacc/judge/shrink.py"].equivalent == 0
    assert any("written for `y = 2 => y = 3`" in p for p in findings.stale)


def test_verdicts_on_killed_or_vanished_mutants_are_stale() -> None:
    """A triage row must describe a current survivor; others are reported for removal."""
    verdicts = {
        "wacc_torch.x_k__mutmut_1": Verdict("wacc_torch.x_k__mutmut_1", "a => b", "accepted", "r"),
        "gone.x_f__mutmut_1": Verdict("gone.x_f__mutmut_1", "a => b", "equivalent", "r"),
    }
    findings = judge(_all_groups_killed(), verdicts)
    assert any("now killed" in p for p in findings.stale)
    assert any("no such mutant" in p for p in findings.stale)


def test_a_group_below_its_target_fails_and_one_at_it_passes() -> None:
    """95 % of wacc_torch's counted mutants killed meets the target; 94.9 % does not."""
    base = [o for o in _all_groups_killed() if not o.path.startswith("wacc_torch")]

    def torch_outcomes(killed: int, total: int) -> list[Outcome]:
        return [
            _outcome(
                f"t.x_f__mutmut_{i}", "wacc_torch/fsdp.py", "killed" if i < killed else "survived"
            )
            for i in range(total)
        ]

    accepted = lambda outcomes: {  # noqa: E731
        o.name: Verdict(o.name, o.change, "accepted", "r") for o in outcomes if not o.detected
    }
    at_target = torch_outcomes(95, 100)
    assert judge(base + at_target, accepted(at_target)).problems == []
    below = torch_outcomes(949, 1000)
    assert any(
        "wacc_torch: score 94.9 %" in p for p in judge(base + below, accepted(below)).problems
    )


def test_the_markdown_lists_every_survivor_and_the_readme_table_is_replaced(tmp_path: Path) -> None:
    """The report names each survivor with its verdict; the docs' table is swapped in place."""
    outcomes = _all_groups_killed() + [
        _outcome("w.x_f__mutmut_9", "wacc/judge/shrink.py", "survived", "a | b => a"),
    ]
    findings = judge(outcomes, {})
    text = markdown(findings, {"date": "today"})
    assert "| w.x_f__mutmut_9 | survived | `a \\| b => a` | **gap** |" in text
    assert "- date: today" in text
    readme = f"intro\n{HEADLINE_BEGIN}\nold\n{HEADLINE_END}\nrest\n"
    replaced = replace_headline(readme, headline(findings))
    assert "old" not in replaced and replaced.endswith(f"{HEADLINE_END}\nrest\n")
    assert (
        "| wacc/judge/shrink.py | 2 | 1 | 0 | 1 | 0 | 0 | 0 | 0 | 50.0 % | >= 90.0 % | no |"
        in replaced
    )
    write_csv(tmp_path / "results.csv", findings)
    lines = (tmp_path / "results.csv").read_text(encoding="utf-8").splitlines()
    assert lines[0] == "mutant,module,function,status,verdict,change"
    assert lines[-1] == "w.x_f__mutmut_9,wacc/judge/shrink.py,f,survived,gap,a | b => a"


def test_the_command_answers_a_missing_run_with_one_line_and_exit_2(tmp_path: Path) -> None:
    """``python -m mutation report`` before any ``mutmut run``: exit 2, one line, no traceback."""
    pytest.importorskip("mutmut")  # the command reads mutmut's state: the `mutation` extra
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "mutation",
            "report",
            "--root",
            str(tmp_path),
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 2, completed
    assert completed.stdout == ""
    assert completed.stderr.count("\n") == 1 and "run `mutmut run` first" in completed.stderr
    assert not (tmp_path / "README.md").exists()


def test_a_partial_run_is_scored_on_what_ran_and_says_it_is_partial() -> None:
    """Mutants mutmut has not checked yet are neither gaps nor kills, and the report fails."""
    outcomes = _all_groups_killed() + [
        _outcome("w.x_f__mutmut_8", "wacc/judge/shrink.py", "not checked"),
    ]
    findings = judge(outcomes, {})
    assert findings.gaps == []
    assert findings.modules["wacc/judge/shrink.py"].not_run == 1
    assert findings.modules["wacc/judge/shrink.py"].score == 1
    assert "1 mutants not run: the run stopped part way" in findings.problems


def test_a_group_with_no_mutant_run_says_so_and_one_with_none_at_all_blames_the_scope() -> None:
    """A group whose mutants were all left unrun is reported as such (not as a scope mismatch);
    a group with no mutant generated points at [tool.mutmut]."""
    outcomes = [o for o in _all_groups_killed() if o.path != "wacc/judge/shrink.py"]
    unrun = outcomes + [_outcome("w.x_f__mutmut_1", "wacc/judge/shrink.py", "not checked")]
    problems = judge(unrun, {}).problems
    assert "wacc/judge/shrink.py: no mutant of its 1 was run" in problems
    assert not any("shrink.py: no mutants" in p for p in problems)
    assert "wacc/judge/shrink.py: no mutants (is [tool.mutmut] in step with scope?)" in (
        judge(outcomes, {}).problems
    )


def test_a_readme_that_cannot_be_read_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """``--readme`` naming a missing file: exit 2 and one line naming it, nothing written."""
    missing = tmp_path / "no-readme.md"
    completed = subprocess.run(
        [sys.executable, "-m", "mutation", "report", "--root", str(tmp_path),
         "--out", str(tmp_path / "out"), "--readme", str(missing)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert completed.returncode == 2, completed
    assert completed.stderr.count("\n") == 1 and f"--readme {str(missing)!r}" in completed.stderr
    assert "Traceback" not in completed.stderr and not (tmp_path / "out").exists()


def test_a_carried_survivor_counts_as_its_verdict_and_needs_one() -> None:
    """A carried mutant (not run again: its function is unchanged since triage) is a survivor:
    its equivalent verdict leaves the denominator as if it had been run, and without a verdict
    (the triage row removed) it is an untriaged gap, never a silent pass."""
    path = "wacc_ref/bounds.py"
    outcomes = _all_groups_killed() + [
        _outcome("b.x_f__mutmut_1", path, "killed"),
        _outcome("b.x_f__mutmut_2", path, "carried"),
    ]
    verdict = Verdict("b.x_f__mutmut_2", "a => b", "equivalent", "same value", "0123456789ab")
    findings = judge(outcomes, {"b.x_f__mutmut_2": verdict})
    tally = findings.modules[path]
    assert (tally.survived, tally.equivalent, tally.score) == (1, 1, Fraction(1, 1))
    assert findings.problems == []
    findings = judge(outcomes, {})
    assert [o.name for o in findings.gaps] == ["b.x_f__mutmut_2"]
    assert any("untriaged survivor b.x_f__mutmut_2 (carried)" in p for p in findings.problems)


def test_the_report_updates_the_table_of_the_documentation_page_that_shows_it() -> None:
    """``python -m mutation report`` writes its score table, by default, into the page of the
    documentation site that holds the markers (docs/mutation.md, in mkdocs.yml's nav)."""
    from mutation.__main__ import _parser
    from tests.docs_support import nav_pages

    page = Path(_parser().parse_args(["report"]).readme)
    assert page.parent == ROOT / "docs" and page.name in nav_pages()
    text = page.read_text(encoding="utf-8")
    assert text.index(HEADLINE_BEGIN) < text.index(HEADLINE_END)
