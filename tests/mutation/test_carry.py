"""mutation.carry: which triaged survivors a run carries instead of running, and when a report
confirms a verdict's function hash."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mutation.carry import carried, confirmed_hashes, function_hashes, function_key
from mutation.scope import ROOT
from mutation.triage import Verdict

mutmut_file_mutation = pytest.importorskip("mutmut.mutation.file_mutation")

H1, H2 = "0123456789ab", "ba9876543210"


def _verdict(name: str, function_hash: str = "", change: str = "a => b") -> Verdict:
    return Verdict(name, change, "equivalent", "no input tells them apart", function_hash)


def test_function_key_drops_the_mutant_number_only() -> None:
    """The key of a mutant's function is its name without ``__mutmut_<n>``, class path kept."""
    assert function_key("wacc_ref.bounds.x_f__mutmut_12") == "wacc_ref.bounds.x_f"
    assert function_key("wacc_torch.m.xǁCǁg__mutmut_3") == "wacc_torch.m.xǁCǁg"


def test_only_rows_whose_function_kept_its_hash_are_carried() -> None:
    """A row is carried when its recorded hash equals the function's current one; a row with
    no hash (never confirmed by a run), another hash (the function was edited) or a function
    that no longer exists runs again."""
    verdicts = {
        "m.x_f__mutmut_1": _verdict("m.x_f__mutmut_1", H1),
        "m.x_f__mutmut_2": _verdict("m.x_f__mutmut_2", ""),
        "m.x_g__mutmut_1": _verdict("m.x_g__mutmut_1", H1),
        "m.x_gone__mutmut_1": _verdict("m.x_gone__mutmut_1", H1),
        "m.xǁCǁh__mutmut_4": _verdict("m.xǁCǁh__mutmut_4", H2),
    }
    hashes = {"m.x_f": H1, "m.x_g": H2, "m.xǁCǁh": H2}
    assert carried(verdicts, hashes) == ["m.x_f__mutmut_1", "m.xǁCǁh__mutmut_4"]
    assert carried(verdicts, {}) == []


def test_a_report_records_the_hash_of_survivors_it_ran_with_the_rows_change() -> None:
    """confirmed_hashes sets the run's hash on a row whose mutant this run ran and saw survive
    with the same change; a row about another change, a mutant not run (carried or killed), or
    a function the run has no hash for keeps what it had."""
    verdicts = {
        "m.x_f__mutmut_1": _verdict("m.x_f__mutmut_1"),
        "m.x_f__mutmut_2": _verdict("m.x_f__mutmut_2", H2, change="c => d"),
        "m.x_g__mutmut_1": _verdict("m.x_g__mutmut_1", H2),
        "m.x_k__mutmut_1": _verdict("m.x_k__mutmut_1"),
    }
    survivors_run = {
        "m.x_f__mutmut_1": "a => b",
        "m.x_f__mutmut_2": "c => e",
        "m.x_k__mutmut_1": "a => b",
    }
    updated = confirmed_hashes(verdicts, survivors_run, {"m.x_f": H1})
    assert updated["m.x_f__mutmut_1"] == _verdict("m.x_f__mutmut_1", H1)
    assert updated["m.x_f__mutmut_2"] == verdicts["m.x_f__mutmut_2"]
    assert updated["m.x_g__mutmut_1"] == verdicts["m.x_g__mutmut_1"]
    assert updated["m.x_k__mutmut_1"] == verdicts["m.x_k__mutmut_1"]
    assert verdicts["m.x_f__mutmut_1"].function_hash == ""  # the input is not modified


def test_function_hashes_are_mutmuts_own_and_change_with_the_source(tmp_path: Path) -> None:
    """Every function of every mutated module gets mutmut's hash (its own function, on the
    unmutated source), keyed as mutmut keys its stats; editing one function changes its hash
    and no other."""
    hashes = function_hashes(ROOT)
    source = (ROOT / "wacc" / "gate" / "compare.py").read_text(encoding="utf-8")
    own = mutmut_file_mutation.compute_function_hashes(source)
    for key, value in own.items():
        assert hashes[f"wacc.gate.compare.{key}"] == value
    assert any(key.startswith("wacc_torch.") and "ǁ" in key for key in hashes)
    assert any(key.startswith("wacc_ref.bounds.") for key in hashes)
    # a copy of the project with one function edited
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    for package in ("wacc_torch", "wacc_ref", "wacc"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("*.pyc"))
    edited = tmp_path / "wacc" / "gate" / "compare.py"
    name = next(key for key in own if key.startswith("x_") and "ǁ" not in key)
    function = name.removeprefix("x_")
    text = edited.read_text(encoding="utf-8")
    assert f"def {function}(" in text
    at = text.index(f"def {function}(")
    body = text.index(":\n", at) + 2
    edited.write_text(text[:body] + "    _ = 0\n" + text[body:], encoding="utf-8")
    after = function_hashes(tmp_path)
    changed = {key for key in hashes if after.get(key) != hashes[key]}
    assert changed == {f"wacc.gate.compare.{name}"}
