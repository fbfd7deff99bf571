"""mutation.triage: the hand-written verdicts, read strictly (a bad row names its line)."""

from __future__ import annotations

from pathlib import Path

import pytest

from mutation.triage import TriageError, Verdict, read_triage, write_triage

HEADER = "mutant,change,verdict,reason,function_hash\n"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "triage.csv"
    path.write_text(text, encoding="utf-8")
    return path


def test_a_missing_file_is_no_verdicts(tmp_path: Path) -> None:
    """Before the first triage there is nothing to read, and that is not an error."""
    assert read_triage(tmp_path / "absent.csv") == {}


def test_rows_round_trip_through_write_and_read(tmp_path: Path) -> None:
    """What write_triage writes (sorted, quoted where needed) read_triage reads back."""
    verdicts = [
        Verdict("b.x_f__mutmut_2", "a, b => a", "accepted", "message, not code", "0a1b2c3d4e5f"),
        Verdict("a.x_g__mutmut_1", 'x = "1" => x = "XX1XX"', "equivalent", "never read"),
    ]
    path = tmp_path / "triage.csv"
    write_triage(path, verdicts)
    assert list(read_triage(path).values()) == sorted(verdicts, key=lambda v: v.mutant)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mutant,verdict\n", "the header must be"),
        ("mutant,change,verdict,reason\n", "the header must be"),
        (HEADER + "m,a => b,fine,because,\n", "verdict 'fine' is not one of"),
        (HEADER + "m,a => b,equivalent,,\n", "m has no reason"),
        (HEADER + "m,a => b,equivalent,r,\nm,a => b,accepted,r,\n", "m is triaged twice"),
        (HEADER + "m,a => b,equivalent,r\n", "expected 5 fields"),
        (HEADER + "m,a => b,equivalent,r,,extra\n", "expected 5 fields"),
        (HEADER + "m,a => b,equivalent,r,0A1B2C3D4E5F\n", "function_hash '0A1B2C3D4E5F' is not"),
        (HEADER + "m,a => b,equivalent,r,0a1b2c\n", "function_hash '0a1b2c' is not"),
    ],
)
def test_a_bad_row_is_refused_naming_its_line(tmp_path: Path, text: str, message: str) -> None:
    """Every malformed row raises TriageError with the file, the line and what is wrong."""
    path = _write(tmp_path, text)
    with pytest.raises(TriageError, match=message) as info:
        read_triage(path)
    assert str(path) in str(info.value)
