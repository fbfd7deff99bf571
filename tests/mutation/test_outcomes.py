"""mutation.outcomes: mutmut's names and diffs read the way the report prints them."""

from __future__ import annotations

from mutation.outcomes import Outcome, change_of, function_of


def test_a_method_mutant_names_its_class_and_method() -> None:
    """mutmut mangles ``C.f`` as ``xǁCǁf``; the report shows ``C.f``."""
    assert function_of("wacc_torch.zero_copy.xǁZeroCopyWindowǁ_block__mutmut_12") == (
        "ZeroCopyWindow._block"
    )


def test_a_function_mutant_names_its_function() -> None:
    """``x_f__mutmut_3`` is function ``f`` (a leading underscore of ``f`` is kept)."""
    assert function_of("wacc_ref.bounds.x__round_up__mutmut_3") == "_round_up"
    assert function_of("wacc.judge.verdict.x_judge__mutmut_140") == "judge"


def test_the_change_is_the_removed_and_added_lines_whitespace_collapsed() -> None:
    """Only ``-``/``+`` lines count (not the file headers); indentation does not."""
    diff = "\n".join(
        [
            "--- wacc_ref/bounds.py",
            "+++ wacc_ref/bounds.py",
            "@@ -1,3 +1,3 @@",
            " def f(x):",
            "-    return x  +  1",
            "+    return x - 1",
        ]
    )
    assert change_of(diff) == "return x + 1 => return x - 1"


def test_a_multi_line_change_keeps_every_line_in_order() -> None:
    """Two removed and two added lines are joined with `` / `` on each side."""
    diff = "-a = 1\n-b = 2\n+a = 2\n+b = 3"
    assert change_of(diff) == "a = 1 / b = 2 => a = 2 / b = 3"


def test_timeouts_and_type_check_catches_are_detected_no_tests_is_not() -> None:
    """The score counts a timeout as a kill; a mutant no selected test covers is undetected."""

    def status(s: str) -> bool:
        return Outcome("m", "p.py", "f", s, "a => b").detected

    assert status("killed") and status("timeout") and status("caught by type check")
    assert not status("survived") and not status("no tests") and not status("suspicious")


def test_mutmuts_skipped_reads_as_carried_and_survived() -> None:
    """Exit 34 (mutmut's "skipped") only comes from a carried mutant here: it reads "carried"
    and counts as a survivor, neither detected nor not run."""
    from mutation.outcomes import _status

    assert _status("skipped") == "carried" and _status("survived") == "survived"
    carried = Outcome("m", "p.py", "f", _status("skipped"), "a => b")
    assert carried.survived and not carried.detected
